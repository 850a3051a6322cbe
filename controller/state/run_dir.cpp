#include "state/run_dir.h"

#include <cerrno>
#include <cstring>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "safe_file.h"

namespace fracgpu::controller {
namespace {

constexpr size_t kErrBytes = 512;

// The run dir itself, as its path names it, with the daemon's checks.
UniqueFd open_root_checked(const std::string& path, std::string* error) {
  char err[kErrBytes] = {};
  const shm::Opened root = shm::open_dir_path(path.c_str(), geteuid(), /*private_only=*/true, err, sizeof err);
  if (!root.ok()) {
    *error = err;
    if (root.status == shm::FileStatus::kOpenToOthers || root.status == shm::FileStatus::kWrongOwner)
      *error += fmt::format(": the run dir holds every tenant's policy and is the daemon's alone (chown it to uid {} "
                            "and chmod 755 it)",
                            geteuid());
    return UniqueFd();
  }
  return UniqueFd(root.fd);
}

UniqueFd make_dir(int parent, const std::string& shown_parent, const char* name, mode_t mode, std::string* error,
                  std::string* notes) {
  char err[kErrBytes] = {};
  bool fixed = false;
  const shm::Opened dir = shm::make_dir_at(parent, name, mode, geteuid(), shown_parent.c_str(), &fixed, err, sizeof err);
  if (!dir.ok()) {
    *error = err;
    return UniqueFd();
  }
  if (fixed && notes != nullptr)
    *notes += fmt::format("{}{}/{}: mode set to {:04o}", notes->empty() ? "" : "; ", shown_parent, name, mode);
  return UniqueFd(dir.fd);
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

bool make_path(const std::string& path, mode_t mode, std::string* error) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string partial = path.substr(0, at);
    if (mkdir(partial.c_str(), mode) != 0 && errno != EEXIST) {
      *error = fmt::format("cannot create {}: {}", partial, strerror(errno));
      return false;
    }
  }
  struct stat st {};
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *error = fmt::format("{}: not a directory", path);
    return false;
  }
  return true;
}

std::optional<DaemonRunDir> open_daemon_run_dir(const std::string& path, std::string* error, std::string* notes) {
  // The path itself is the operator's: created like `mkdir -p` would.
  if (!make_path(path, 0755, error)) return std::nullopt;
  DaemonRunDir run;
  run.path = path;
  run.root = open_root_checked(path, error);
  if (!run.root.valid()) return std::nullopt;
  run.private_dir = make_dir(run.root.get(), path, kPrivateDirName, 0700, error, notes);
  if (!run.private_dir.valid()) return std::nullopt;
  run.tenants = make_dir(run.root.get(), path, "tenants", 0755, error, notes);
  if (!run.tenants.valid()) return std::nullopt;
  return run;
}

std::optional<RunDirView> open_run_dir_view(const std::string& path, std::string* error) {
  char err[kErrBytes] = {};
  const shm::Opened root = shm::open_dir_path(path.c_str(), shm::kAnyOwner, false, err, sizeof err);
  if (!root.ok()) {
    *error = err;
    return std::nullopt;
  }
  RunDirView view;
  view.root.reset(root.fd);
  struct stat st {};
  if (fstat(root.fd, &st) != 0) {
    *error = fmt::format("{}: cannot stat: {}", path, strerror(errno));
    return std::nullopt;
  }
  view.owner = st.st_uid;
  return view;
}

UniqueFd make_daemon_dir(int parent, const std::string& shown_parent, const char* name, std::string* error) {
  return make_dir(parent, shown_parent, name, 0755, error, nullptr);
}

std::optional<std::string> read_file_at(int dirfd, const std::string& shown_dir, const char* name, uid_t owner,
                                        size_t max_bytes, std::string* error, bool* missing) {
  char err[kErrBytes] = {};
  const shm::Opened file = shm::open_file_at(dirfd, name, O_RDONLY, owner, -1, shown_dir.c_str(), err, sizeof err);
  if (missing != nullptr) *missing = file.status == shm::FileStatus::kMissing;
  if (!file.ok()) {
    *error = err;
    return std::nullopt;
  }
  const UniqueFd fd(file.fd);
  std::string text;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *error = fmt::format("{}/{}: cannot read: {}", shown_dir, name, strerror(errno));
      return std::nullopt;
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      *error = fmt::format("{}/{}: refused: longer than {} bytes", shown_dir, name, max_bytes);
      return std::nullopt;
    }
  }
  return text;
}

bool write_run_file(const std::string& run_dir, std::string_view subdir, const std::string& name,
                    std::string_view text, std::string* error, RunFileWrite how) {
  const std::string shown = subdir.empty() ? run_dir : fmt::format("{}/{}", run_dir, subdir);
  const auto fail = [&](const std::string& why) {
    *error = fmt::format("cannot write {}/{}: {}; the previous version (if any) is kept", shown, name, why);
    return false;
  };
  std::string why;
  const UniqueFd root = open_root_checked(run_dir, &why);
  if (!root.valid()) return fail(why);
  const UniqueFd priv = make_dir(root.get(), run_dir, kPrivateDirName, 0700, &why, nullptr);
  if (!priv.valid()) return fail(why);
  UniqueFd sub;
  if (!subdir.empty()) {
    sub = make_dir(root.get(), run_dir, std::string(subdir).c_str(), 0755, &why, nullptr);
    if (!sub.valid()) return fail(why);
  }
  const int target = subdir.empty() ? root.get() : sub.get();
  char tmp[64];
  UniqueFd fd;
  for (int attempt = 0; attempt < 8 && !fd.valid(); ++attempt) {
    if (!shm::random_name(".new-", tmp, sizeof tmp)) return fail("no randomness for a temporary name");
    fd.reset(openat(priv.get(), tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (!fd.valid() && errno != EEXIST) return fail(strerror(errno));
  }
  if (!fd.valid()) return fail("no free temporary name");
  const auto discard = [&](int e) {
    unlinkat(priv.get(), tmp, 0);
    return fail(strerror(e));
  };
  fchmod(fd.get(), 0644);  // whatever the umask: readers (the CLI, the metrics child) need it
  // Space first: a full file system fails here, before anything is replaced.
  if (!text.empty()) {
    const int e = shm::reserve_blocks(fd.get(), text.size());
    if (e != 0 && e != EOPNOTSUPP) return discard(e);
  }
  for (std::string_view rest = text; !rest.empty();) {
    const ssize_t n = ::write(fd.get(), rest.data(), rest.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return discard(n < 0 ? errno : ENOSPC);
    rest.remove_prefix(static_cast<size_t>(n));
  }
  const bool durable = how == RunFileWrite::kDurable;
  // Durable: the content is on disk before the name points at it.
  if (durable && ::fsync(fd.get()) != 0) return discard(errno);
  if (::close(fd.release()) != 0) return discard(errno);
  // Readers see the old file or the new one, never half of one.
  if (renameat(priv.get(), tmp, target, name.c_str()) != 0) return discard(errno);
  // And the rename itself. The new file is in place whatever this says.
  if (durable && ::fsync(target) != 0) {
    *error = fmt::format("{}/{} replaced, but syncing {} failed: {}; a crash of the machine may still lose the change",
                         shown, name, shown, strerror(errno));
    return false;
  }
  return true;
}

bool link_replacing(int src_dir, const char* src_name, int dst_dir, const char* dst_name, int private_dir,
                    std::string* error) {
  char tmp[64];
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (!shm::random_name(".link-", tmp, sizeof tmp)) break;
    // Flags 0: a link at the source is linked itself, never what it names.
    if (linkat(src_dir, src_name, private_dir, tmp, 0) != 0) {
      if (errno == EEXIST) continue;
      *error = strerror(errno);
      return false;
    }
    if (renameat(private_dir, tmp, dst_dir, dst_name) != 0) {
      *error = strerror(errno);
      unlinkat(private_dir, tmp, 0);
      return false;
    }
    return true;
  }
  *error = "no free temporary name";
  return false;
}

bool remove_tenant_dir(int tenants_dir, const std::string& shown_parent, const std::string& name, std::string* error) {
  char err[kErrBytes] = {};
  const shm::Opened opened = shm::open_dir_at(tenants_dir, name.c_str(), geteuid(), false, shown_parent.c_str(), err,
                                              sizeof err);
  if (!opened.ok()) {
    *error = err;
    return false;
  }
  UniqueFd dir(opened.fd);
  const std::string shown = shown_parent + "/" + name;
  const int listing_fd = dup(dir.get());
  DIR* listing = listing_fd >= 0 ? fdopendir(listing_fd) : nullptr;
  if (listing == nullptr) {
    if (listing_fd >= 0) ::close(listing_fd);
    *error = fmt::format("cannot list {}: {}", shown, strerror(errno));
    return false;
  }
  bool ok = true;
  while (const struct dirent* entry = readdir(listing)) {
    const std::string entry_name = entry->d_name;
    if (entry_name == "." || entry_name == "..") continue;
    // Without AT_REMOVEDIR, unlinkat removes a name, never what a link names.
    if (unlinkat(dir.get(), entry_name.c_str(), 0) != 0) {
      *error = fmt::format("cannot remove {}/{}: {}", shown, entry_name, strerror(errno));
      ok = false;
      break;
    }
  }
  closedir(listing);
  if (ok && unlinkat(tenants_dir, name.c_str(), AT_REMOVEDIR) != 0) {
    *error = fmt::format("cannot remove {}: {}", shown, strerror(errno));
    ok = false;
  }
  return ok;
}

}  // namespace fracgpu::controller

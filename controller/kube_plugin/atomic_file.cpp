#include "kube_plugin/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include <fmt/format.h>

namespace fracgpu::kube_plugin {
namespace {

std::string why(const std::string& what) { return fmt::format("{}: {}", what, std::strerror(errno)); }

bool sync_dir(const std::string& dir, std::string* error) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    *error = why("open " + dir);
    return false;
  }
  const bool ok = ::fsync(fd) == 0;
  if (!ok) *error = why("fsync " + dir);
  ::close(fd);
  return ok;
}

bool write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    text.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

}  // namespace

bool write_file_atomic(const std::string& dir, const std::string& name, std::string_view text, std::string* error) {
  static thread_local std::mt19937_64 random{std::random_device{}()};
  const std::string temp = fmt::format(".{}.{:016x}.tmp", name, random());
  const std::string temp_path = dir + "/" + temp;
  const std::string path = dir + "/" + name;
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = why("create " + temp_path);
    return false;
  }
  bool ok = write_all(fd, text);
  if (!ok) *error = why("write " + temp_path);
  if (ok && ::fchmod(fd, 0644) != 0) ok = false, *error = why("chmod " + temp_path);  // whatever the umask
  if (ok && ::fsync(fd) != 0) ok = false, *error = why("fsync " + temp_path);
  ::close(fd);
  if (ok && ::rename(temp_path.c_str(), path.c_str()) != 0) ok = false, *error = why("rename to " + path);
  if (!ok) {
    ::unlink(temp_path.c_str());
    return false;
  }
  return sync_dir(dir, error);
}

bool remove_file_durable(const std::string& dir, const std::string& name, std::string* error) {
  const std::string path = dir + "/" + name;
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return true;
    *error = why("remove " + path);
    return false;
  }
  return sync_dir(dir, error);
}

std::optional<std::string> read_regular_file(const std::string& dir, const std::string& name, size_t max_bytes,
                                             bool* missing, std::string* error) {
  *missing = false;
  const std::string path = dir + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) *missing = true;
    *error = why("open " + path);
    return std::nullopt;
  }
  struct stat st {};
  std::optional<std::string> out;
  if (::fstat(fd, &st) != 0) {
    *error = why("stat " + path);
  } else if (!S_ISREG(st.st_mode)) {
    *error = path + ": not a regular file";
  } else if (static_cast<size_t>(st.st_size) > max_bytes) {
    *error = fmt::format("{}: {} bytes, more than the {} allowed", path, st.st_size, max_bytes);
  } else {
    std::string text(static_cast<size_t>(st.st_size), '\0');
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    if (got == text.size())
      out = std::move(text);
    else
      *error = why("read " + path);
  }
  ::close(fd);
  return out;
}

bool make_dirs(const std::string& path, unsigned mode, std::string* error) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string part = path.substr(0, at);
    if (::mkdir(part.c_str(), mode) != 0 && errno != EEXIST) {
      *error = why("mkdir " + part);
      return false;
    }
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *error = path + ": not a directory";
    return false;
  }
  return true;
}

}  // namespace fracgpu::kube_plugin

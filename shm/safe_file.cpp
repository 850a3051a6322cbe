#include "safe_file.h"

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fracgpu::shm {

void set_error(char* err, size_t err_len, const char* fmt, ...) {
  if (err == nullptr || err_len == 0) return;
  va_list args;
  va_start(args, fmt);
  vsnprintf(err, err_len, fmt, args);
  va_end(args);
}

namespace {

std::atomic<int> g_private_dir{-1};
std::atomic<bool> g_no_tmpfile{false};

Opened failed(FileStatus status, int e = 0) {
  Opened o;
  o.status = status;
  o.sys_errno = e;
  return o;
}

// "dir/name", for messages.
struct Shown {
  char text[4096 + 256];
  Shown(const char* dir, const char* name) { snprintf(text, sizeof text, "%s/%s", dir, name); }
};

Opened system_error(int e, const char* what, const char* shown, char* err, size_t err_len) {
  if (e == ENOENT) {
    set_error(err, err_len, "%s: missing", shown);
    return failed(FileStatus::kMissing, e);
  }
  set_error(err, err_len, "%s: cannot %s: %s", shown, what, strerror(e));
  return failed(FileStatus::kSystem, e);
}

// The checks on what an fstat found: kind, owner and (files) size.
Opened check_stat(const struct stat& st, bool directory, uid_t owner, int64_t size, bool private_only,
                  const char* shown, char* err, size_t err_len) {
  const bool kind_ok = directory ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode);
  if (!kind_ok) {
    set_error(err, err_len, "%s: refused: not a %s (%s)", shown, directory ? "directory" : "regular file",
        file_type_name(st.st_mode));
    return failed(FileStatus::kWrongType);
  }
  if (owner != kAnyOwner && st.st_uid != owner) {
    set_error(err, err_len, "%s: refused: owned by uid %u, expected uid %u", shown,
        static_cast<unsigned>(st.st_uid), static_cast<unsigned>(owner));
    return failed(FileStatus::kWrongOwner);
  }
  if (!directory && size >= 0 && st.st_size != size) {
    set_error(err, err_len, "%s: size is %lld bytes, this fracgpu expects %lld", shown,
        static_cast<long long>(st.st_size), static_cast<long long>(size));
    return failed(FileStatus::kWrongSize);
  }
  if (directory && private_only && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    set_error(err, err_len, "%s: refused: writable by %s (mode %04o)", shown,
        (st.st_mode & S_IWOTH) != 0 ? "every user" : "its group", static_cast<unsigned>(st.st_mode & 07777));
    return failed(FileStatus::kOpenToOthers);
  }
  return Opened{};
}

// The checks again on what `fd` really is (closed if refused).
Opened check_opened(int fd, bool directory, uid_t owner, int64_t size, bool private_only, const char* shown, char* err,
                    size_t err_len) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return system_error(e, "stat", shown, err, err_len);
  }
  Opened checked = check_stat(st, directory, owner, size, private_only, shown, err, err_len);
  if (!checked.ok()) {
    ::close(fd);
    return checked;
  }
  checked.fd = fd;
  return checked;
}

Opened open_checked_at(int dirfd, const char* name, int flags, bool directory, uid_t owner, int64_t size,
                       bool private_only, const char* shown_dir, char* err, size_t err_len) {
  const Shown shown(shown_dir, name);
  // Look before opening: a FIFO must not be opened at all (an open for
  // reading blocks until a writer comes), nor a device.
  struct stat before {};
  if (fstatat(dirfd, name, &before, AT_SYMLINK_NOFOLLOW) != 0)
    return system_error(errno, "stat", shown.text, err, err_len);
  Opened checked = check_stat(before, directory, owner, size, private_only, shown.text, err, err_len);
  if (!checked.ok()) return checked;
  const int fd = openat(dirfd, name, flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    if (e == ELOOP || e == ENOTDIR || e == ENXIO) {  // swapped for a link, or a socket, since the look
      set_error(err, err_len, "%s: refused: not a %s (replaced while being opened)", shown.text,
                directory ? "directory" : "regular file");
      return failed(FileStatus::kWrongType, e);
    }
    return system_error(e, "open", shown.text, err, err_len);
  }
  // And again on what was really opened: the name may have changed hands.
  return check_opened(fd, directory, owner, size, private_only, shown.text, err, err_len);
}

// Creates an unnamed file for create_file_at: O_TMPFILE in the target
// directory, or O_EXCL under a random name in the private directory
// (*tmp_name then holds it).
int make_unnamed(int dirfd, mode_t mode, char* tmp_name, size_t tmp_len, int* sys_errno) {
  tmp_name[0] = '\0';
  if (!g_no_tmpfile.load(std::memory_order_relaxed)) {
    const int fd = openat(dirfd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, mode);
    if (fd >= 0) return fd;
    // Anything but "not supported here" is a real error.
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
      *sys_errno = errno;
      return -1;
    }
  }
  const int priv = g_private_dir.load(std::memory_order_acquire);
  if (priv < 0) {
    *sys_errno = EOPNOTSUPP;
    return -1;
  }
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (!random_name(".new-", tmp_name, tmp_len)) break;
    const int fd = openat(priv, tmp_name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0) return fd;
    if (errno != EEXIST) {
      *sys_errno = errno;
      tmp_name[0] = '\0';
      return -1;
    }
  }
  tmp_name[0] = '\0';
  *sys_errno = EEXIST;
  return -1;
}

// Links the finished unnamed file in as `name`; fails (EEXIST) if taken.
int publish(int fd, const char* tmp_name, int dirfd, const char* name) {
  if (tmp_name[0] != '\0') return linkat(g_private_dir.load(std::memory_order_acquire), tmp_name, dirfd, name, 0);
  if (linkat(fd, "", dirfd, name, AT_EMPTY_PATH) == 0) return 0;
  if (errno != EPERM && errno != ENOENT && errno != EINVAL) return -1;
  // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH; through /proc it does not.
  char proc_path[64];
  snprintf(proc_path, sizeof proc_path, "/proc/self/fd/%d", fd);
  return linkat(AT_FDCWD, proc_path, dirfd, name, AT_SYMLINK_FOLLOW);
}

}  // namespace

const char* file_type_name(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFLNK: return "a symbolic link";
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    default: return "of an unknown type";
  }
}

Opened open_file_at(int dirfd, const char* name, int access, uid_t owner, int64_t size, const char* shown_dir,
                    char* err, size_t err_len) {
  return open_checked_at(dirfd, name, access, false, owner, size, false, shown_dir, err, err_len);
}

Opened open_dir_at(int dirfd, const char* name, uid_t owner, bool private_only, const char* shown_dir, char* err,
                   size_t err_len) {
  return open_checked_at(dirfd, name, O_RDONLY | O_DIRECTORY, true, owner, -1, private_only, shown_dir, err, err_len);
}

Opened open_dir_path(const char* path, uid_t owner, bool private_only, char* err, size_t err_len) {
  const int fd = ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) {
      set_error(err, err_len, "%s: missing", path);
      return failed(FileStatus::kMissing, e);
    }
    if (e == ENOTDIR) {
      set_error(err, err_len, "%s: refused: not a directory", path);
      return failed(FileStatus::kWrongType, e);
    }
    set_error(err, err_len, "%s: cannot open: %s", path, strerror(e));
    return failed(FileStatus::kSystem, e);
  }
  return check_opened(fd, true, owner, -1, private_only, path, err, err_len);
}

Opened make_dir_at(int dirfd, const char* name, mode_t mode, uid_t owner, const char* shown_dir, bool* mode_fixed,
                   char* err, size_t err_len) {
  if (mode_fixed != nullptr) *mode_fixed = false;
  if (mkdirat(dirfd, name, mode) != 0 && errno != EEXIST)
    return system_error(errno, "create", Shown(shown_dir, name).text, err, err_len);
  // Not private_only here: a mode to fix is fixed below, once the directory
  // is known to be the owner's.
  Opened o = open_dir_at(dirfd, name, owner, false, shown_dir, err, err_len);
  if (!o.ok()) return o;
  struct stat st {};
  if (fstat(o.fd, &st) == 0 && (st.st_mode & 07777) != mode) {
    if (fchmod(o.fd, mode) != 0) {
      const int e = errno;
      ::close(o.fd);
      return system_error(e, "change the mode of", Shown(shown_dir, name).text, err, err_len);
    }
    if (mode_fixed != nullptr) *mode_fixed = true;
  }
  return o;
}

FileStatus create_file_at(int dirfd, const char* name, mode_t mode, uint64_t bytes, FillFn fill, const void* fill_arg,
                          const char* shown_dir, int* sys_errno, char* err, size_t err_len) {
  int ignored = 0;
  if (sys_errno == nullptr) sys_errno = &ignored;
  *sys_errno = 0;
  char tmp_name[64];
  const int fd = make_unnamed(dirfd, mode, tmp_name, sizeof tmp_name, sys_errno);
  if (fd < 0) {
    if (*sys_errno == EOPNOTSUPP)
      set_error(err, err_len, "%s/%s: cannot create: the file system has no O_TMPFILE and no private directory is set",
          shown_dir, name);
    else
      set_error(err, err_len, "%s/%s: cannot create: %s", shown_dir, name, strerror(*sys_errno));
    return FileStatus::kSystem;
  }
  const auto fail = [&](const char* what, int e) {
    ::close(fd);
    if (tmp_name[0] != '\0') unlinkat(g_private_dir.load(std::memory_order_acquire), tmp_name, 0);
    *sys_errno = e;
    set_error(err, err_len, "%s/%s: cannot %s: %s", shown_dir, name, what, strerror(e));
    return e == EEXIST ? FileStatus::kExists : FileStatus::kSystem;
  };
  fchmod(fd, mode);  // not subject to the umask
  if (bytes > 0) {
    const int e = reserve_blocks(fd, bytes);
    // A file system that cannot reserve gets a sparse file, as before; a
    // full one gets no file at all.
    if (e == EOPNOTSUPP) {
      if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail("size", errno);
    } else if (e != 0) {
      return fail("reserve space for", e);
    }
  }
  if (fill != nullptr && bytes > 0) {
    void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return fail("map", errno);
    fill(map, fill_arg);
    munmap(map, bytes);
  }
  if (publish(fd, tmp_name, dirfd, name) != 0) return fail("publish", errno);
  if (tmp_name[0] != '\0') unlinkat(g_private_dir.load(std::memory_order_acquire), tmp_name, 0);
  ::close(fd);
  return FileStatus::kOk;
}

void set_private_dir(int dirfd) { g_private_dir.store(dirfd, std::memory_order_release); }
int private_dir() { return g_private_dir.load(std::memory_order_acquire); }

void force_no_tmpfile_for_testing(bool on) { g_no_tmpfile.store(on, std::memory_order_relaxed); }

bool random_name(const char* prefix, char* out, size_t out_len) {
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, 0) != static_cast<ssize_t>(sizeof r)) return false;
  return snprintf(out, out_len, "%s%016llx", prefix, static_cast<unsigned long long>(r)) < static_cast<int>(out_len);
}

int reserve_blocks(int fd, uint64_t bytes) {
  // fallocate(2), not posix_fallocate: where the file system cannot, glibc's
  // emulation writes into the file, which would race with its other writers.
  if (fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0) return 0;
  return errno == ENOSYS ? EOPNOTSUPP : errno;
}

}  // namespace fracgpu::shm

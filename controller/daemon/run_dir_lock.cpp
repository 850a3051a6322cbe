#include "daemon/run_dir_lock.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fmt/format.h>

#include "safe_file.h"

namespace fracgpu::controller {

pid_t flock_holder(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return 0;
  FILE* locks = fopen("/proc/locks", "re");
  if (locks == nullptr) return 0;
  // "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF": device numbers in hex,
  // the inode in decimal; waiters' lines ("1: -> FLOCK ...") have one field more
  // and never match the pattern.
  char line[256];
  pid_t holder = 0;
  while (holder == 0 && fgets(line, sizeof line, locks) != nullptr) {
    char kind[16] = {};
    int pid = 0;
    unsigned dev_major = 0, dev_minor = 0;
    uint64_t inode = 0;
    if (sscanf(line, "%*d: %15s %*s %*s %d %x:%x:%" SCNu64, kind, &pid, &dev_major, &dev_minor, &inode) != 5) continue;
    if (strcmp(kind, "FLOCK") == 0 && inode == st.st_ino && dev_major == major(st.st_dev) &&
        dev_minor == minor(st.st_dev) && pid > 0)
      holder = pid;
  }
  fclose(locks);
  return holder;
}

bool RunDirLock::acquire(const std::string& run_dir, std::string* error) {
  release();
  const int root = ::open(run_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root < 0) {
    *error = fmt::format("cannot open the run dir {}: {}", run_dir, strerror(errno));
    return false;
  }
  // The lock directory is ours and 0700: only our user can open it, so only
  // our user can hold a lock on it (see the header).
  char err[512] = {};
  const shm::Opened dir = shm::make_dir_at(root, kLockDirName, 0700, geteuid(), run_dir.c_str(), nullptr, err, sizeof err);
  ::close(root);
  if (!dir.ok()) {
    *error = fmt::format("cannot lock the run dir: {}", err);
    return false;
  }
  const int fd = dir.fd;
  const std::string shown = fmt::format("{}/{}", run_dir, kLockDirName);
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e == EWOULDBLOCK) {
      const pid_t holder = flock_holder(fd);
      *error = holder > 0 ? fmt::format("another fracgpud (pid {}) already manages {}", holder, run_dir)
                          : fmt::format("another process (fracgpud, most likely) holds the lock on {}; its PID "
                                        "cannot be told from here",
                                        shown);
    } else {
      *error = fmt::format("cannot lock {}: {}", shown, strerror(e));
    }
    ::close(fd);
    return false;
  }
  fd_ = fd;
  return true;
}

void RunDirLock::release() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace fracgpu::controller

// Where the timing tests keep the files their processes map and write at
// every launch (the simulated GPU's state, the ledgers, the usage files).
#pragma once

#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace fracgpu::testing {

// /dev/shm (tmpfs) where it has room, else /tmp. A node keeps these files on
// tmpfs (/run/fracgpu); on a disk file system the kernel's writeback stalls
// writes into such mappings now and then, at times that differ between a
// test's runs with and without fracgpu: a `sync` every 20 ms beside the 10 us
// launch-bound pair took its GPU busy from 0.956 to 0.900 with the files in
// /tmp (ext4) and left it at 0.945 with them in /dev/shm. 1 GiB free at
// least: a container's small /dev/shm (64 MiB by default) is left alone.
inline const std::string& timing_tmp_dir() {
  static const std::string dir = [] {
    struct statvfs v {};
    const bool roomy = statvfs("/dev/shm", &v) == 0 &&
                       static_cast<uint64_t>(v.f_bavail) * v.f_frsize >= (uint64_t{1} << 30) &&
                       access("/dev/shm", W_OK) == 0;
    return std::string(roomy ? "/dev/shm" : "/tmp");
  }();
  return dir;
}

// Removes the files named `<prefix><pid>` in timing_tmp_dir() whose process
// is gone: a test binary killed at its timeout leaves its state file, which
// on tmpfs would hold memory until the next boot.
inline void remove_stale_state_files(const std::string& prefix) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(timing_tmp_dir(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || end == nullptr || *end != '\0') continue;
    if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) std::filesystem::remove(entry.path(), ec);
  }
}

}  // namespace fracgpu::testing

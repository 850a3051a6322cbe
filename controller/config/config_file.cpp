#include "config/config_file.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

namespace fracgpu::controller {
namespace {

// What a non-regular file is, for the refusal.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::string format_limit(size_t bytes) {
  if (bytes % (1u << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes % (1u << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} bytes", bytes);
}

// Closes the descriptor however the read ends.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::optional<std::string> read_config_file(const std::string& path, std::string* why, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  // It changes nothing for the regular file that is read below.
  Fd file{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY)};
  if (file.fd < 0) {
    *why = fmt::format("cannot open: {}", std::strerror(errno));
    return std::nullopt;
  }
  struct stat st {};
  if (fstat(file.fd, &st) != 0) {
    *why = fmt::format("cannot stat: {}", std::strerror(errno));
    return std::nullopt;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = fmt::format("it is {}, not a regular file", file_kind(st.st_mode));
    return std::nullopt;
  }
  const std::string limit = format_limit(max_bytes);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    *why = fmt::format("it is {} bytes, above the {} a config file may have", st.st_size, limit);
    return std::nullopt;
  }
  // Up to one byte past the limit, to tell "exactly the limit" from "more":
  // the size fstat reported may be wrong (0 for /proc files) or change.
  std::string text;
  text.resize(max_bytes + 1);
  size_t have = 0;
  while (have < text.size()) {
    const ssize_t n = ::read(file.fd, text.data() + have, text.size() - have);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = fmt::format("read failed: {}", std::strerror(errno));
      return std::nullopt;
    }
    if (n == 0) break;
    have += static_cast<size_t>(n);
  }
  if (have > max_bytes) {
    *why = fmt::format("it holds more than the {} a config file may have", limit);
    return std::nullopt;
  }
  text.resize(have);
  return text;
}

}  // namespace fracgpu::controller

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

}  // namespace fracgpu::kube_plugin

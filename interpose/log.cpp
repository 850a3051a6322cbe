#include "log.h"

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

namespace fracgpu::interpose {
namespace {

// -1: not read yet. Read lazily because this may run before main.
std::atomic<int> g_level{-1};

int read_level() {
  const char* env = getenv("FRACGPU_LOG");
  int level = static_cast<int>(LogLevel::kError);
  if (env != nullptr) {
    if (strcmp(env, "warn") == 0) level = static_cast<int>(LogLevel::kWarn);
    else if (strcmp(env, "info") == 0) level = static_cast<int>(LogLevel::kInfo);
    else if (strcmp(env, "debug") == 0) level = static_cast<int>(LogLevel::kDebug);
  }
  g_level.store(level, std::memory_order_relaxed);
  return level;
}

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

}  // namespace

bool log_enabled(LogLevel level) {
  int current = g_level.load(std::memory_order_relaxed);
  if (current < 0) current = read_level();
  return static_cast<int>(level) <= current;
}

void log_line(LogLevel level, const char* fmt, ...) {
  if (!log_enabled(level)) return;
  const int saved_errno = errno;
  char buf[512];
  int n = snprintf(buf, sizeof buf, "fracgpu[%d] %s: ", static_cast<int>(getpid()), level_name(level));
  va_list args;
  va_start(args, fmt);
  int m = vsnprintf(buf + n, sizeof buf - n - 1, fmt, args);
  va_end(args);
  size_t len = static_cast<size_t>(n) + (m < 0 ? 0 : static_cast<size_t>(m));
  if (len > sizeof buf - 2) len = sizeof buf - 2;
  buf[len++] = '\n';
  ssize_t ignored = write(STDERR_FILENO, buf, len);
  (void)ignored;
  errno = saved_errno;
}

}  // namespace fracgpu::interpose

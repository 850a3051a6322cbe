// Logging from inside a user's process: no allocation, no locks, errno kept,
// one write(2) per line to stderr. Only slow paths log; FRACGPU_LOG sets the
// level (error by default, so a healthy process prints nothing).
#pragma once

#include <atomic>

namespace fracgpu::interpose {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool log_enabled(LogLevel level);
void log_line(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Logs at most once per call site.
#define FRACGPU_LOG_ONCE(level, ...)                                           \
  do {                                                                         \
    static std::atomic<bool> fracgpu_logged_{false};                           \
    if (!fracgpu_logged_.exchange(true, std::memory_order_relaxed))            \
      ::fracgpu::interpose::log_line(level, __VA_ARGS__);                      \
  } while (0)

}  // namespace fracgpu::interpose

// fracgpud's log, bounded: tenants can make the daemon log (a corrupt usage
// file, a process outside the gate, a refused create), and a log that grows
// as fast as a tenant can provoke it fills the node's disk or journal and
// buries what an operator needs. Lines at info and above pass through a
// token bucket (a burst, then a steady rate); past it they are dropped and
// counted, and the next line that passes is preceded by one saying how many
// went. Debug and trace lines, which an operator turns on deliberately, are
// not limited.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <spdlog/sinks/base_sink.h>

namespace fracgpu::controller {

class RateLimitedSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  using Clock = std::function<uint64_t()>;  // monotonic ns

  // At most `burst` lines at once, then `per_second` lines a second.
  RateLimitedSink(std::shared_ptr<spdlog::sinks::sink> out, uint32_t burst, uint32_t per_second, Clock clock = {});

  uint64_t dropped_total() const { return dropped_total_; }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override;
  void flush_() override;
  // The logger's pattern is for the lines written: the inner sink's.
  void set_pattern_(const std::string& pattern) override;
  void set_formatter_(std::unique_ptr<spdlog::formatter> formatter) override;

 private:
  std::shared_ptr<spdlog::sinks::sink> out_;
  double burst_, per_ns_;
  Clock clock_;
  double tokens_;
  uint64_t refilled_ns_ = 0;
  uint64_t dropped_ = 0;        // since the last line that passed
  uint64_t dropped_total_ = 0;
};

// fracgpud's own: 2,000 lines at once, 100 a second after.
inline constexpr uint32_t kLogBurst = 2000;
inline constexpr uint32_t kLogLinesPerSecond = 100;

}  // namespace fracgpu::controller

#include "daemon/log_limit.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "ledger.h"  // shm/: monotonic_ns

namespace fracgpu::controller {

RateLimitedSink::RateLimitedSink(std::shared_ptr<spdlog::sinks::sink> out, uint32_t burst, uint32_t per_second,
                                 Clock clock)
    : out_(std::move(out)),
      burst_(burst),
      per_ns_(per_second / 1e9),
      clock_(clock ? std::move(clock) : Clock([] { return ledger::monotonic_ns(); })),
      tokens_(burst) {
  refilled_ns_ = clock_();
}

void RateLimitedSink::sink_it_(const spdlog::details::log_msg& msg) {
  if (msg.level < spdlog::level::info) {
    out_->log(msg);
    return;
  }
  const uint64_t now = clock_();
  tokens_ = std::min(burst_, tokens_ + static_cast<double>(now - refilled_ns_) * per_ns_);
  refilled_ns_ = now;
  if (tokens_ < 1) {
    ++dropped_;
    ++dropped_total_;
    return;
  }
  tokens_ -= 1;
  if (dropped_ > 0) {
    const std::string text =
        fmt::format("log rate limit: {} line(s) dropped (more than {} at once, or {} a second)", dropped_,
                    static_cast<uint64_t>(burst_), static_cast<uint64_t>(per_ns_ * 1e9 + 0.5));
    out_->log(spdlog::details::log_msg(msg.time, msg.source, msg.logger_name, spdlog::level::warn, text));
    dropped_ = 0;
  }
  out_->log(msg);
}

void RateLimitedSink::flush_() { out_->flush(); }

void RateLimitedSink::set_pattern_(const std::string& pattern) { out_->set_pattern(pattern); }

void RateLimitedSink::set_formatter_(std::unique_ptr<spdlog::formatter> formatter) {
  out_->set_formatter(std::move(formatter));
}

}  // namespace fracgpu::controller

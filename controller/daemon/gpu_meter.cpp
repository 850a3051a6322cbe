#include "daemon/gpu_meter.h"

#include <algorithm>

namespace fracgpu::controller {
namespace {
// A sample covers at most this long: a process first seen, or seen again
// after a gap, is not credited with a period it may not have been measured in.
constexpr unsigned long long kMaxPeriodUs = 1'000'000;
}  // namespace

bool NvmlMeter::read(uint64_t, std::vector<ProcessUse>* out) {
  const auto fn = nvml_.api().get_process_utilization;
  if (fn == nullptr) {
    problem_ = "NVML lacks nvmlDeviceGetProcessUtilization";
    return false;
  }
  unsigned int count = static_cast<unsigned>(std::max<size_t>(samples_.size(), 16));
  samples_.resize(count);
  nvmlReturn_t rc = fn(device_, samples_.data(), &count, last_seen_us_);
  if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
    samples_.resize(count + 16);
    count = static_cast<unsigned>(samples_.size());
    rc = fn(device_, samples_.data(), &count, last_seen_us_);
  }
  if (rc == NVML_ERROR_NOT_FOUND) return true;  // no process ran: no samples
  if (rc != NVML_SUCCESS) {
    problem_ = "nvmlDeviceGetProcessUtilization: " + nvml_.describe(rc);
    return false;
  }
  problem_.clear();
  count = std::min<unsigned>(count, static_cast<unsigned>(samples_.size()));
  // The first reading only sets where the next begins: what ran before
  // this meter existed (under an earlier daemon, which charged it, or
  // before the tenant was scheduled) is nobody's to pay now.
  const bool baseline = last_seen_us_ == 0;
  unsigned long long newest = last_seen_us_;
  for (unsigned i = 0; i < count; ++i) {
    const nvmlProcessUtilizationSample_t& s = samples_[i];
    if (s.timeStamp <= last_seen_us_ || s.smUtil > 100) continue;  // old, or not a percentage
    // The period a sample covers: since this process's previous sample, or
    // since what we asked for, whichever is later.
    unsigned long long& seen = pid_seen_us_[s.pid];
    unsigned long long from = std::max(seen, last_seen_us_);
    if (from == 0 || s.timeStamp - from > kMaxPeriodUs) from = s.timeStamp - std::min(s.timeStamp, kMaxPeriodUs);
    if (s.timeStamp <= seen) continue;
    seen = s.timeStamp;
    newest = std::max(newest, s.timeStamp);
    if (baseline) continue;
    const uint64_t busy = (s.timeStamp - from) * 1000ull * s.smUtil / 100;
    if (busy > 0) out->push_back({s.pid, busy});
  }
  last_seen_us_ = newest;
  // Forget processes not seen for a while (they exited): bounded memory.
  if (pid_seen_us_.size() > 4096)
    std::erase_if(pid_seen_us_, [&](const auto& kv) { return newest - kv.second > 10 * kMaxPeriodUs; });
  return true;
}

}  // namespace fracgpu::controller

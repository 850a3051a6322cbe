#include "daemon/gpu_meter.h"

#include <algorithm>
#include <ctime>

namespace fracgpu::controller {
namespace {
// A sample covers at most this long: a process first seen, or seen again
// after a gap, is not credited with a period it may not have been measured in.
constexpr unsigned long long kMaxPeriodUs = 1'000'000;
}  // namespace

bool NvmlMeter::read(uint64_t now, std::vector<ProcessUse>* out) {
  const auto fn = nvml_.api().get_process_utilization;
  if (fn == nullptr) {
    problem_ = "NVML lacks nvmlDeviceGetProcessUtilization";
    return false;
  }
  // The driver keeps a ring of 72 samples and may answer with that many
  // records: ask with room for them from the start.
  unsigned int count = static_cast<unsigned>(std::max<size_t>(samples_.size(), 80));
  samples_.resize(count);
  nvmlReturn_t rc = fn(device_, samples_.data(), &count, last_seen_us_);
  if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
    samples_.resize(std::min<unsigned>(count, 4096) + 16);
    count = static_cast<unsigned>(samples_.size());
    rc = fn(device_, samples_.data(), &count, last_seen_us_);
  }
  if (rc == NVML_ERROR_NOT_FOUND) return true;  // no sample since the last one: nothing new
  if (rc != NVML_SUCCESS) {
    problem_ = "nvmlDeviceGetProcessUtilization: " + nvml_.describe(rc);
    return false;
  }
  problem_.clear();
  count = std::min<unsigned>(count, static_cast<unsigned>(samples_.size()));
  // NVML's time stamps are CPU time (CLOCK_REALTIME, us); ours monotonic.
  struct timespec real {};
  clock_gettime(CLOCK_REALTIME, &real);
  const uint64_t real_ns = static_cast<uint64_t>(real.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(real.tv_nsec);
  auto monotonic_of = [&](unsigned long long stamp_us) -> uint64_t {
    const uint64_t stamp_ns = stamp_us * 1000ull;
    if (stamp_ns >= real_ns) return now;
    return real_ns - stamp_ns < now ? now - (real_ns - stamp_ns) : 0;
  };
  // The first reading only sets where the next begins: what ran before
  // this meter existed (under an earlier daemon, which charged it, or
  // before the tenant was scheduled) is nobody's to pay now.
  const bool baseline = last_seen_us_ == 0;
  unsigned long long newest = last_seen_us_;
  for (unsigned i = 0; i < count; ++i) newest = std::max(newest, samples_[i].timeStamp);
  if (newest == last_seen_us_) return true;
  const unsigned long long gap = baseline ? 0 : newest - last_seen_us_;
  if (gap > 0) {
    gaps_us_.push_back(gap);
    if (gaps_us_.size() > 15) gaps_us_.erase(gaps_us_.begin());
    std::vector<unsigned long long> sorted = gaps_us_;
    std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
    period_us_ = sorted[sorted.size() / 2];
  }
  // What one record stands for: one period, or the gap when it is about one.
  const unsigned long long period = std::min(gap < period_us_ * 3 / 2 ? gap : period_us_, kMaxPeriodUs);
  for (unsigned i = 0; i < count; ++i) {
    const nvmlProcessUtilizationSample_t& s = samples_[i];
    if (s.timeStamp <= last_seen_us_ || s.smUtil > 100) continue;  // old, or not a percentage
    unsigned long long& seen = pid_seen_us_[s.pid];
    if (s.timeStamp <= seen) continue;
    seen = s.timeStamp;
    if (baseline) continue;
    const uint64_t busy = period * 1000ull * s.smUtil / 100;
    if (busy > 0) out->push_back({s.pid, busy, monotonic_of(s.timeStamp)});
  }
  last_seen_us_ = newest;
  // Forget processes not seen for a while (they exited): bounded memory.
  if (pid_seen_us_.size() > 4096)
    std::erase_if(pid_seen_us_, [&](const auto& kv) { return newest - kv.second > 10 * kMaxPeriodUs; });
  return true;
}

}  // namespace fracgpu::controller

#include "daemon/gpu_meter.h"

#include <algorithm>
#include <ctime>
#include <utility>

#include <fmt/format.h>

namespace fracgpu::controller {
namespace {
// A sample covers at most this long: a process first seen, or seen again
// after a gap, is not credited with a period it may not have been measured in.
constexpr unsigned long long kMaxPeriodUs = 1'000'000;
// How far a newest stamp may lie ahead of its clock's now (host and driver
// read the clock at different moments), and behind it (a ring of samples
// from before an idle spell).
constexpr uint64_t kStampAheadNs = 600'000'000'000ull;        // 10 minutes
constexpr uint64_t kStampBehindNs = 30ull * 86'400'000'000'000ull;  // 30 days

uint64_t clock_ns(clockid_t clock) {
  struct timespec ts {};
  clock_gettime(clock, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}
}  // namespace

uint64_t stamp_clock_now_ns(unsigned long long stamp_us) {
  if (stamp_us > UINT64_MAX / 1000) return 0;
  const uint64_t stamp_ns = stamp_us * 1000ull;
  for (const clockid_t clock : {CLOCK_REALTIME, CLOCK_MONOTONIC}) {
    const uint64_t now = clock_ns(clock);
    if (stamp_ns <= now + kStampAheadNs && stamp_ns + kStampBehindNs >= now) return now;
  }
  return 0;
}

void NvmlMeter::Period::learn(unsigned long long gap_us) {
  if (gap_us == 0) return;
  gaps_us.push_back(gap_us);
  if (gaps_us.size() > 15) gaps_us.erase(gaps_us.begin());
  if (smallest) {
    us = *std::min_element(gaps_us.begin(), gaps_us.end());
    return;
  }
  std::vector<unsigned long long> sorted = gaps_us;
  std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
  us = sorted[sorted.size() / 2];
}

// One period, or the gap when it is about one.
unsigned long long NvmlMeter::Period::covered(unsigned long long gap_us) const {
  return std::min(gap_us < us * 3 / 2 ? gap_us : us, kMaxPeriodUs);
}

void NvmlMeter::add_warning(const std::string& text) { warning_ += (warning_.empty() ? "" : "; ") + text; }

bool NvmlMeter::device_busy(uint64_t* busy_ns) {
  if (device_read_after_ + 1 != reads_) device_seen_us_ = 0;  // not asked after the last read: afresh
  device_read_after_ = reads_;
  return read_device(busy_ns);
}

// The device ring's samples since the last read of it: their busy time,
// each sample its percentage of the period it stands for. The ring leaves out
// samples of 0 % (and answers NOT_FOUND when all are), so the gap to the
// previous sample can span idle periods: it stands for one period at most.
// The first answer only sets where the next begins, as for the per-process
// samples.
bool NvmlMeter::read_device(uint64_t* busy_ns) {
  *busy_ns = 0;
  const auto fn = nvml_.api().get_samples;
  if (fn == nullptr) return false;
  device_samples_.resize(std::max<size_t>(device_samples_.size(), 80));
  unsigned int count = static_cast<unsigned>(device_samples_.size());
  nvmlValueType_t type{};
  nvmlReturn_t rc = fn(device_, NVML_GPU_UTILIZATION_SAMPLES, device_seen_us_, &type, &count, device_samples_.data());
  if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
    device_samples_.resize(std::min<unsigned>(count, 4096) + 16);
    count = static_cast<unsigned>(device_samples_.size());
    rc = fn(device_, NVML_GPU_UTILIZATION_SAMPLES, device_seen_us_, &type, &count, device_samples_.data());
  }
  if (rc == NVML_ERROR_NOT_FOUND) return device_seen_us_ != 0 && !device_unit_unknown_;  // none since: idle
  if (rc != NVML_SUCCESS || type != NVML_VALUE_TYPE_UNSIGNED_INT) return false;
  count = std::min<unsigned>(count, static_cast<unsigned>(device_samples_.size()));
  const bool baseline = device_seen_us_ == 0;
  // Oldest first, as NVML answers; sorted anyway (a figure out of order
  // must not count twice).
  std::sort(device_samples_.begin(), device_samples_.begin() + count,
            [](const nvmlSample_t& a, const nvmlSample_t& b) { return a.timeStamp < b.timeStamp; });
  unsigned int beyond = 0;  // a value above 100: not a percentage
  for (unsigned i = 0; i < count; ++i) {
    const nvmlSample_t& s = device_samples_[i];
    if (s.timeStamp <= device_seen_us_) continue;
    const unsigned long long gap = baseline ? 0 : s.timeStamp - device_seen_us_;
    device_period_.learn(gap);
    device_seen_us_ = s.timeStamp;
    if (s.sampleValue.uiVal > 100) beyond = std::max(beyond, s.sampleValue.uiVal);
    if (baseline) continue;
    *busy_ns += device_period_.covered(gap) * 1000ull * std::min(s.sampleValue.uiVal, 100u) / 100;
  }
  // nvml.h gives the values no unit; a driver whose values are not whole
  // percent (pct x 100, say, as the driver's own samples are) would make
  // every figure wrong: none is used then, and the log says so once.
  if (beyond > 0 && !std::exchange(device_unit_unknown_, true))
    add_warning(fmt::format("nvmlDeviceGetSamples' GPU utilization reads {} (above 100%): the GPU's busy time is "
                            "taken from the per-process samples alone",
                            beyond));
  return !baseline && !device_unit_unknown_;
}

bool NvmlMeter::read(uint64_t now, std::vector<ProcessUse>* out) {
  if (!read_processes(now, out)) return false;
  ++reads_;
  return true;
}

bool NvmlMeter::read_processes(uint64_t now, std::vector<ProcessUse>* out) {
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
  count = std::min<unsigned>(count, static_cast<unsigned>(samples_.size()));
  // The first reading only sets where the next begins: what ran before
  // this meter existed (under an earlier daemon, which charged it, or
  // before the tenant was scheduled) is nobody's to pay now.
  const bool baseline = last_seen_us_ == 0;
  unsigned long long newest = last_seen_us_;
  for (unsigned i = 0; i < count; ++i) newest = std::max(newest, samples_[i].timeStamp);
  if (newest == last_seen_us_) return true;
  // NVML's time stamps are "CPU time" in us, ours CLOCK_MONOTONIC. Drivers
  // stamp the wall clock (CLOCK_REALTIME), but nvml.h does not say so: the
  // clock is the one of the two the newest stamp is near (they are decades
  // apart). Stamps on neither place each sample at the time it is read
  // (at_ns 0): a few ms late, as the meter reads every few ms, and said.
  const uint64_t stamps_now_ns = stamp_clock_now_ns(newest);
  if (stamps_now_ns == 0 && !std::exchange(stamps_unplaced_, true))
    add_warning(fmt::format("nvmlDeviceGetProcessUtilization's time stamps are on no clock this host has (the "
                            "newest: {} us): each sample is placed at the time it is read",
                            newest));
  auto monotonic_of = [&](unsigned long long stamp_us) -> uint64_t {
    const uint64_t stamp_ns = stamp_us * 1000ull;
    if (stamps_now_ns == 0) return 0;
    if (stamp_ns >= stamps_now_ns) return now;
    return stamps_now_ns - stamp_ns < now ? now - (stamps_now_ns - stamp_ns) : 0;
  };
  const unsigned long long gap = baseline ? 0 : newest - last_seen_us_;
  period_.learn(gap);
  const unsigned long long period = period_.covered(gap);
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
  problem_.clear();
  // Forget processes not seen for a while (they exited): bounded memory.
  if (pid_seen_us_.size() > 4096)
    std::erase_if(pid_seen_us_, [&](const auto& kv) { return newest - kv.second > 10 * kMaxPeriodUs; });
  return true;
}

}  // namespace fracgpu::controller

// The GPU-time meter: how much GPU time each process actually used, as the
// driver measures it (docs/sm-time.md, "What is measured"). The scheduler
// (gpu_scheduler.h) charges tenants by it instead of by the time they held
// the GPU, and decides from it whether the GPU has room for another tenant.
//
// UsageMeter is the interface the scheduler calls on its own thread, once
// every few milliseconds; NvmlMeter implements it with NVML's per-process
// utilization samples (nvmlDeviceGetProcessUtilization), and the scheduler's
// unit tests with made-up figures.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/nvml.h"

namespace fracgpu::controller {

struct ProcessUse {
  uint32_t pid = 0;      // host PID (the daemon's PID namespace), as NVML reports it
  uint64_t busy_ns = 0;  // GPU time its kernels ran since the previous reading
};

class UsageMeter {
 public:
  virtual ~UsageMeter() = default;
  // Appends to *out the GPU time each process used since the previous call
  // (processes that used none may be left out). False: no reading this
  // time (the driver did not answer); the next call covers the gap.
  virtual bool read(uint64_t now, std::vector<ProcessUse>* out) = 0;
};

// NVML's samples: each says what share of a sampling period (from the
// previous sample, or from the time asked for, to its time stamp) the
// process had a kernel running, in whole percent. Busy time is that share of
// the period. Inexact by nature: whole percents, the driver's own sampling
// period (on real GPUs about 1/6 s: finer requests return nothing new),
// "a kernel was running" rather than how many SMs it used, and processes
// attributed by host PID only.
class NvmlMeter final : public UsageMeter {
 public:
  // `nvml` outlives the meter; `device` is the GPU's handle.
  NvmlMeter(const Nvml& nvml, nvmlDevice_t device) : nvml_(nvml), device_(device) {}
  bool read(uint64_t now, std::vector<ProcessUse>* out) override;
  // The last NVML error, for the daemon's log ("" if none).
  const std::string& problem() const { return problem_; }

 private:
  const Nvml& nvml_;
  nvmlDevice_t device_;
  unsigned long long last_seen_us_ = 0;  // newest sample time stamp consumed (NVML's clock, us)
  std::unordered_map<uint32_t, unsigned long long> pid_seen_us_;  // per process: its newest sample
  std::vector<nvmlProcessUtilizationSample_t> samples_;
  std::string problem_;
};

}  // namespace fracgpu::controller

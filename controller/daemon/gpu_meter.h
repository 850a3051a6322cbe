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
  // When the driver took the sample that named it (CLOCK_MONOTONIC); 0:
  // the time of the reading. Held mode's audit asks who held the GPU then.
  uint64_t at_ns = 0;
};

class UsageMeter {
 public:
  virtual ~UsageMeter() = default;
  // Appends to *out the GPU time each process used since the previous call
  // (processes that used none may be left out). False: no reading this
  // time (the driver did not answer); the next call covers the gap.
  virtual bool read(uint64_t now, std::vector<ProcessUse>* out) = 0;
  // The driver's sampling period as seen so far (the usual gap between
  // successive samples); 0: not known yet.
  virtual uint64_t sample_period_ns() const { return 0; }
  // Why the last read() returned false, for the log ("": the driver did not
  // answer this time, nothing to say).
  virtual std::string problem() const { return {}; }
  // What the log should say once about readings that succeed ("": nothing).
  virtual std::string warning() const { return {}; }
  // Asked right after a read() that returned true: how long the GPU was
  // busy (all its processes, whoever the driver's samples name) since the
  // previous such call. Asked only when needed: the first call, and a call
  // after reads that were not followed by one, starts afresh (false), so it
  // never hands over the busy time of a spell nobody asked about. False
  // also when there is no such figure (the driver lacks it or did not
  // answer); the per-process figures are all there is then.
  virtual bool device_busy(uint64_t* busy_ns) {
    (void)busy_ns;
    return false;
  }
};

// The current time, in ns, of the host clock a driver's sample time stamp
// (`stamp_us`, "CPU time" in us) is on: CLOCK_REALTIME's if the stamp is
// near it, else CLOCK_MONOTONIC's; 0 if it is near neither (no more than 10
// minutes ahead of the clock, 30 days behind).
uint64_t stamp_clock_now_ns(unsigned long long stamp_us);

// NVML's samples (docs/sm-time.md, "What is measured"; the facts in the
// NVML notes it cites): the driver samples the GPU every ~1/6 s to 1 s; a
// sample holds the engine's busy share of its period, in whole percent, and
// names ONE process, the one resident at the sampling instant. Between
// samples NVML answers NOT_FOUND. So a record is read as "at this instant
// this process was on the GPU, which was this busy over one period": busy
// time = smUtil x the period. The period is learnt from the gaps between
// successive samples (their median); a gap much longer than that (samples
// that named nobody, or a reader that fell behind) still counts one period,
// never the whole gap, since the percentage is an average over samples,
// not over time. Inexact by nature: right only statistically, over many
// samples, and only while who runs is unrelated to the sampling instants.
class NvmlMeter final : public UsageMeter {
 public:
  // `nvml` outlives the meter; `device` is the GPU's handle.
  NvmlMeter(const Nvml& nvml, nvmlDevice_t device) : nvml_(nvml), device_(device) {}
  bool read(uint64_t now, std::vector<ProcessUse>* out) override;
  uint64_t sample_period_ns() const override { return period_.us * 1000; }
  // The last NVML error, for the daemon's log ("" if none).
  std::string problem() const override { return problem_; }
  std::string warning() const override { return warning_; }
  // From the device's own ring (nvmlDeviceGetSamples, GPU utilization):
  // every sample's busy share counts, including those of periods whose
  // instant found the GPU idle, which name no process and so are missing
  // from the per-process figures (a lone process busy 0.9 of the time is
  // named in about 0.9 of the samples: its figure reads 0.81).
  bool device_busy(uint64_t* busy_ns) override;

 private:
  // The sampling period, learnt from the gaps between successive samples
  // (the median of the last few): a gap much longer than one period (no
  // sample in between, a reader that fell behind) still stands for one.
  struct Period {
    // The smallest gap instead of the median: the device ring leaves out
    // samples of 0 %, so on a GPU idle in most periods most gaps span
    // several (the per-process samples' median is what the audits were
    // measured with, and stays).
    explicit Period(bool smallest_gap = false) : smallest(smallest_gap) {}
    bool smallest;
    std::vector<unsigned long long> gaps_us;
    unsigned long long us = 0;
    void learn(unsigned long long gap_us);
    // What a sample `gap_us` after the previous one stands for (us).
    unsigned long long covered(unsigned long long gap_us) const;
  };
  bool read_processes(uint64_t now, std::vector<ProcessUse>* out);
  // The device ring's busy time since device_seen_us_ (0: only sets it).
  bool read_device(uint64_t* busy_ns);

  const Nvml& nvml_;
  nvmlDevice_t device_;
  unsigned long long last_seen_us_ = 0;  // newest sample time stamp consumed (NVML's clock, us)
  std::unordered_map<uint32_t, unsigned long long> pid_seen_us_;  // per process: its newest sample
  std::vector<nvmlProcessUtilizationSample_t> samples_;
  Period period_;  // from the newest per-process stamps of successive reads
  // The device ring's: the newest stamp consumed, its own period; and the
  // good reads so far, and after which one the ring was last read.
  unsigned long long device_seen_us_ = 0;
  Period device_period_{true};
  std::vector<nvmlSample_t> device_samples_;
  uint64_t reads_ = 0, device_read_after_ = 0;
  bool device_unit_unknown_ = false;  // a value above 100 was seen: the figure is never used
  bool stamps_unplaced_ = false;      // a newest stamp was on neither clock
  void add_warning(const std::string& text);  // once each: the log shows warning() when it changes
  std::string problem_;
  std::string warning_;
};

}  // namespace fracgpu::controller

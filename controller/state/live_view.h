// The live view of `fracgpu status --watch` and `fracgpu top`: the per-GPU
// table of status.h, one frame at a time, with each tenant's share of GPU
// time over the last 1 s and 10 s as fracgpu itself measures it between
// readings of the daemon's cumulative counters. Everything here is plain
// text; drawing it on a terminal (and signals) is the CLI's (cli/live_view_command.h).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "state/status.h"

namespace fracgpu::controller {

inline constexpr uint64_t kLiveShortWindowNs = 1'000'000'000;   // the "1S" column
inline constexpr uint64_t kLiveLongWindowNs = 10'000'000'000;   // "10S" and THROTTLED
// Seconds between frames: what --watch and --interval accept.
inline constexpr double kLiveMinIntervalS = 0.1;
inline constexpr double kLiveMaxIntervalS = 3600;
// Readings are taken at least this often, whatever the interval, so the 1 s
// window has readings to span it.
inline constexpr uint64_t kLiveMaxReadingPeriodNs = 500'000'000;

// "1", "0.5", "2.25": seconds between frames, from kLiveMinIntervalS to
// kLiveMaxIntervalS. nullopt, with *why saying what is wrong, otherwise.
std::optional<double> parse_interval_seconds(std::string_view text, std::string* why);

// Row order. kGpu: as `fracgpu status` (by GPU, then tenant); the others
// are top's --sort: GPU-time share over the last second (then 10 s),
// memory used, tenant name (each largest first, ties in status order).
enum class LiveOrder { kGpu, kGpuTime, kMemory, kName };
std::optional<LiveOrder> parse_live_order(std::string_view text);  // "gpu", "memory", "name"
std::string_view live_order_description(LiveOrder order);          // "GPU time (1 s)", ...

// A share of time over a span: what a counter grew by, over how long.
struct WindowShare {
  uint32_t ppm = 0;      // of the span, capped at 100%
  uint64_t span_ns = 0;  // between the two readings it is computed from
};

// Readings of every tenant's cumulative GPU time, per GPU, kept between
// frames. The counter is the one the daemon's own achieved shares use: GPU
// time used as measured where the daemon charges measured time, else time
// charged (held). A share over a window is the counter's increase between
// the latest reading and the earlier one whose age is closest to the
// window, over the time between the two; until readings go back that far,
// the span is shorter (WindowShare::span_ns says by how much).
class GpuTimeReadings {
 public:
  // Adds the readings of `report`, taken at `now_ns` (CLOCK_MONOTONIC).
  // A counter that went back (a restarted daemon, a tenant made again) or
  // a change of charging starts that series afresh; tenants and GPUs no
  // longer in the report are forgotten.
  void record(const StatusReport& report, uint64_t now_ns);
  void clear() { series_.clear(); }

  // GPU time used and time throttled (wanted the GPU, did not hold it) over
  // `window_ns`; nullopt without two readings of that tenant and GPU.
  std::optional<WindowShare> used(const std::string& tenant, const std::string& uuid, uint64_t window_ns) const;
  std::optional<WindowShare> throttled(const std::string& tenant, const std::string& uuid, uint64_t window_ns) const;

 private:
  struct Reading {
    uint64_t at_ns = 0;
    uint64_t used_ns = 0;
    uint64_t throttled_ns = 0;
  };
  struct Series {
    bool measured = false;
    std::deque<Reading> readings;  // oldest first
  };
  std::optional<WindowShare> share(const std::string& tenant, const std::string& uuid, uint64_t window_ns,
                                   uint64_t Reading::*counter) const;
  std::map<std::pair<std::string, std::string>, Series> series_;  // by (tenant, GPU UUID)
};

// What a frame says besides the report's figures.
struct LiveFrameInfo {
  std::string title;     // "fracgpu top", "fracgpu status --watch"
  std::string node;      // the host's name
  std::string clock;     // the node's wall-clock time, as shown
  double interval_s = 1;
  LiveOrder order = LiveOrder::kGpu;
};

// One frame as lines, without line ends or terminal controls. `report` is
// nullopt when the run dir could not be read this time; `error` says why.
std::vector<std::string> live_view_lines(const std::optional<StatusReport>& report, const std::string& error,
                                         const GpuTimeReadings& readings, const LiveFrameInfo& info);

}  // namespace fracgpu::controller

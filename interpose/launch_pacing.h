// Pacing a tenant's launches while a latency tenant shares its GPU
// (docs/sm-time.md, "Latency tenants").
//
// Work already queued on a GPU cannot be recalled: when a latency tenant
// takes the GPU, whatever the holder has queued runs first. So while the
// daemon asks for it (gputime::DaemonSection::pace_inflight_ns), every
// launch of a process of any other tenant goes through the launch gate's
// slow path, which waits here until the process has less than the budget
// queued on that GPU (one launch at least), and records an event after the
// launch on the launch's own stream. What is still queued is what those
// events say has not completed; a launch's GPU time is estimated from the
// events of launches that ran back to back. Slow path only: outside pacing
// nothing here runs, and the launch fast path is unchanged.
#pragma once

#include <cuda.h>
#include <pthread.h>

#include <cstdint>

namespace fracgpu::interpose {

class LaunchPacer {
 public:
  // Waits until less than `budget_ns` of this GPU's launches (as estimated)
  // is still queued, or none is. Returns how long it waited.
  uint64_t wait_for_room(uint64_t budget_ns);
  // After a successful launch into `stream` of context `ctx`: records an
  // event behind it.
  void launched(CUcontext ctx, CUstream stream);
  // Drops what it tracks (its events), e.g. when pacing ends or a context
  // goes away. Events of a destroyed context are not touched.
  void forget(CUcontext ctx);
  void reset_after_fork();
  // Launches queued now, as the events say (for tests and status).
  uint32_t queued();

 private:
  static constexpr uint32_t kRing = 64;  // launches tracked at most; a full ring waits for its oldest
  struct Tracked {
    CUevent event = nullptr;
    CUcontext ctx = nullptr;
    bool behind_work = false;  // queued while earlier tracked work was: its elapsed time is its own
    uint64_t launched_ns = 0;
    uint64_t start_ns = 0;  // when it is expected to start on the GPU; 0: unknown
  };
  static constexpr uint64_t kLeadNs = 150'000;     // the next launch may queue this long before the oldest's end
  static constexpr uint64_t kMaxNapNs = 2'000'000;  // longest sleep before looking at the events again
  void retire_completed_locked();
  void recycle_locked(CUevent event, CUcontext ctx);
  Tracked ring_[kRing] = {};
  uint32_t head_ = 0, count_ = 0;
  CUevent last_done_ = nullptr;  // the newest retired event: its successor's elapsed time starts there
  CUcontext last_done_ctx_ = nullptr;
  uint64_t estimate_ns_ = 0;  // one launch's GPU time, smoothed; 0: nothing measured yet
  CUevent spare_[kRing] = {};  // events kept for reuse, with their contexts
  CUcontext spare_ctx_[kRing] = {};
  uint32_t spares_ = 0;
  pthread_mutex_t lock_ = PTHREAD_MUTEX_INITIALIZER;
};

}  // namespace fracgpu::interpose

// Pacing a tenant's launches while a latency tenant shares its GPU
// (docs/sm-time.md, "Latency tenants").
//
// Work already queued on a GPU cannot be recalled: when a latency tenant
// takes the GPU, whatever the holder has queued runs first. So while the
// daemon asks for it (gputime::DaemonSection::pace_inflight_ns), every
// launch of a process of any other tenant goes through the launch gate's
// slow path, which waits here until there is room for it, and records an
// event after the launch on the launch's own stream. Room is judged twice:
//
// - For the whole tenant: all its processes reserve their launches' GPU
//   time on one word of the tenant's usage file (TenantQueue::end_us, when
//   the tenant's queued work is expected to end). A launch may reserve while
//   less than the budget is ahead, or while what is ahead is about to end
//   (one launch at least, for the tenant, not for each of its processes:
//   split over eight processes, training still has one kernel ahead).
// - For this process, by its events: what they say has not completed. This
//   bounds what the reservations (estimates) do not: a kernel that runs
//   longer than its estimate keeps the next one waiting.
//
// A launch's GPU time is estimated per kernel (CUfunction, or graph exec),
// from that kernel's own past runs: cheap kernels cannot make an expensive
// one look cheap. A kernel never seen counts as the whole budget (so it
// queues alone), and one that runs far past its estimate (the same function
// made long by its arguments) puts the whole tenant on one launch at a time
// for a while (TenantQueue::strict_until_ms).
//
// Slow path only: outside pacing nothing here runs, and the launch fast path
// is unchanged.
#pragma once

#include <cuda.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>

namespace fracgpu::interpose {

class LaunchPacer {
 public:
  // The tenant's words in its usage file (ledger_layout.h, UsageSegment).
  struct TenantQueue {
    std::atomic<uint32_t>* end_us = nullptr;
    std::atomic<uint32_t>* strict_until_ms = nullptr;
  };
  // Waits until the tenant and this process have room for a launch of
  // `kernel` (its function or graph exec; null: unknown) under `budget_ns`,
  // then reserves its estimated time on the tenant's queue. Returns early,
  // reserving nothing, as soon as `open` is false (the gate closed: the
  // caller waits for the GPU, then comes back). Returns true if it reserved.
  // The launch will go into `stream` of context `ctx`.
  bool wait_for_room(uint64_t budget_ns, CUcontext ctx, CUstream stream, const void* kernel, const TenantQueue& tenant,
                     const std::atomic<bool>& open);
  // After a successful launch into `stream` of context `ctx`: records an
  // event behind it.
  void launched(CUcontext ctx, CUstream stream, const void* kernel);
  // Drops what it tracks (its events, its estimates), e.g. when a context
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
    const void* kernel = nullptr;
    CUevent marker = nullptr;  // recorded just before it when nothing of ours was queued: where it started
    bool behind_work = false;  // queued while earlier tracked work was: its elapsed time is its own
    uint64_t launched_ns = 0;
    uint64_t start_ns = 0;     // when it is expected to start on the GPU; 0: unknown
    uint64_t estimate_ns = 0;  // its GPU time as estimated when it was launched
    uint32_t reserved_end_us = 0;  // the tenant's queue end its reservation set (0: none)
  };
  // Per-kernel estimates: an open-addressed table keyed by the kernel's
  // handle. A kernel pushed out (or never seen) is unknown again.
  static constexpr uint32_t kKinds = 256, kProbe = 4;
  struct Kind {
    const void* kernel = nullptr;
    uint64_t estimate_ns = 0;
    uint64_t last_ns = 0;  // its last run measured
  };
  static constexpr uint64_t kLeadNs = 150'000;     // the next launch may queue this long before the oldest's end
  static constexpr uint64_t kMaxNapNs = 2'000'000;  // longest sleep before looking at the events again
  void retire_completed_locked();
  void recycle_locked(CUevent event, CUcontext ctx);
  CUevent take_event_locked(CUcontext ctx);  // a spare of ctx's, or a new one (null: none)
  Kind* find_kind_locked(const void* kernel, bool insert);
  void learn_locked(const Tracked& t, uint64_t ns, bool exact);
  uint64_t estimate_locked(const void* kernel, uint64_t budget_ns, bool strict);
  Tracked ring_[kRing] = {};
  uint32_t head_ = 0, count_ = 0;
  CUevent last_done_ = nullptr;  // the newest retired event: its successor's elapsed time starts there
  CUcontext last_done_ctx_ = nullptr;
  Kind kinds_[kKinds] = {};
  uint64_t budget_ns_ = 0;  // the budget of the last wait (overruns are judged against it)
  std::atomic<uint32_t>* strict_word_ = nullptr;  // the tenant's, as of the last wait: where an overrun is told
  std::atomic<uint32_t>* end_word_ = nullptr;     // the tenant's queue end, as of the last wait
  CUevent spare_[kRing] = {};  // events kept for reuse, with their contexts
  CUcontext spare_ctx_[kRing] = {};
  uint32_t spares_ = 0;
  pthread_mutex_t lock_ = PTHREAD_MUTEX_INITIALIZER;
};

}  // namespace fracgpu::interpose

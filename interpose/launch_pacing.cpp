// Launch pacing (launch_pacing.h; docs/sm-time.md, "Latency tenants").
#include "launch_pacing.h"

#include <algorithm>
#include <cstring>
#include <ctime>

#include "gputime.h"  // shm/: monotonic_ns
#include "hook_table.h"

namespace fracgpu::interpose {

namespace {

struct Locked {
  explicit Locked(pthread_mutex_t& m) : mutex(m) { pthread_mutex_lock(&mutex); }
  ~Locked() { pthread_mutex_unlock(&mutex); }
  pthread_mutex_t& mutex;
};

}  // namespace

void LaunchPacer::retire_completed_locked() {
  if (g_driver.cuEventQuery == nullptr) {
    count_ = 0;  // cannot tell what is queued: track nothing
    return;
  }
  const uint64_t now = gputime::monotonic_ns();
  while (count_ > 0) {
    Tracked& t = ring_[head_];
    const CUresult state = g_driver.cuEventQuery(t.event);
    if (state == CUDA_ERROR_NOT_READY) break;
    // Another error (its context gone) counts as done: nothing of it is queued.
    if (state == CUDA_SUCCESS) {
      // Queued behind earlier work, it started when its predecessor ended
      // (the GPU runs one context's work in order), so the time between the
      // two events is its own. Otherwise the time since its launch is an
      // upper bound, which can only bring a stale estimate down.
      float ms = -1;
      if (t.behind_work && last_done_ != nullptr && last_done_ctx_ == t.ctx && g_driver.cuEventElapsedTime != nullptr &&
          g_driver.cuEventElapsedTime(&ms, last_done_, t.event) == CUDA_SUCCESS && ms >= 0 && ms < 10'000) {
        const auto ns = static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
        estimate_ns_ = estimate_ns_ == 0 ? ns : (estimate_ns_ * 7 + ns) / 8;
      } else if (!t.behind_work && t.launched_ns != 0 && now > t.launched_ns && now - t.launched_ns < estimate_ns_) {
        estimate_ns_ = now - t.launched_ns;
      }
    }
    recycle_locked(last_done_, last_done_ctx_);
    last_done_ = state == CUDA_SUCCESS ? t.event : nullptr;
    last_done_ctx_ = state == CUDA_SUCCESS ? t.ctx : nullptr;
    if (state != CUDA_SUCCESS) recycle_locked(t.event, t.ctx);
    t = Tracked{};
    head_ = (head_ + 1) % kRing;
    --count_;
  }
}

void LaunchPacer::recycle_locked(CUevent event, CUcontext ctx) {
  if (event == nullptr) return;
  if (spares_ < kRing) {
    spare_[spares_] = event;
    spare_ctx_[spares_] = ctx;
    ++spares_;
  } else if (g_driver.cuEventDestroy_v2 != nullptr) {
    g_driver.cuEventDestroy_v2(event);
  }
}

uint64_t LaunchPacer::wait_for_room(uint64_t budget_ns) {
  auto sync = real<HookId::cuEventSynchronize>();
  Locked locked(lock_);
  uint64_t started = 0;
  for (;;) {
    retire_completed_locked();
    if (count_ == 0) break;
    // Nothing measured yet: let two launches queue, so that the second is
    // measured (it runs behind the first) and the estimate can form.
    const uint64_t each = estimate_ns_ != 0 ? estimate_ns_ : budget_ns / 2;
    // The oldest is what the GPU runs now. Within kLeadNs of its expected
    // end it no longer counts: the next launch then queues behind it and
    // the GPU does not idle while this thread wakes (which costs a few
    // percent with 2 ms kernels); what may wait behind us grows by at most
    // kLeadNs.
    const uint64_t now = gputime::monotonic_ns();
    const Tracked& oldest = ring_[head_];
    const uint64_t oldest_end = estimate_ns_ != 0 && oldest.start_ns != 0 ? oldest.start_ns + each : 0;
    const bool oldest_ending = oldest_end != 0 && now + kLeadNs >= oldest_end;
    const uint64_t queued = static_cast<uint64_t>(std::min<unsigned __int128>(
        static_cast<unsigned __int128>(count_ - (oldest_ending ? 1 : 0)) * each, UINT64_MAX));
    if (count_ < kRing && queued < budget_ns) break;
    if (sync == nullptr) break;
    if (started == 0) started = now;
    if (oldest_end != 0 && count_ == 1 && oldest_end > now + kLeadNs && oldest_end - now - kLeadNs < 100'000'000) {
      // One launch queued, its end expected: sleep until just before it
      // (a completion sooner than expected is seen when we wake).
      const uint64_t sleep_ns = std::min<uint64_t>(oldest_end - now - kLeadNs, kMaxNapNs);
      struct timespec ts {0, static_cast<long>(sleep_ns)};
      pthread_mutex_unlock(&lock_);
      nanosleep(&ts, nullptr);
      pthread_mutex_lock(&lock_);
      continue;
    }
    if (sync(oldest.event) != CUDA_SUCCESS) {
      // Its context is gone, or the driver cannot say: stop tracking it.
      recycle_locked(ring_[head_].event, nullptr);
      ring_[head_] = Tracked{};
      head_ = (head_ + 1) % kRing;
      --count_;
    }
  }
  return started != 0 ? gputime::monotonic_ns() - started : 0;
}

void LaunchPacer::launched(CUcontext ctx, CUstream stream) {
  // Without cuEventQuery nothing tracked could ever be retired (its events
  // would only pile up): track nothing.
  if (g_driver.cuEventCreate == nullptr || g_driver.cuEventRecord == nullptr || g_driver.cuEventQuery == nullptr) return;
  Locked locked(lock_);
  retire_completed_locked();
  if (count_ == kRing) return;  // another thread filled it meanwhile: this launch goes untracked
  CUevent event = nullptr;
  for (uint32_t i = spares_; i-- > 0;) {
    if (spare_ctx_[i] != ctx) continue;
    event = spare_[i];
    spare_[i] = spare_[spares_ - 1];
    spare_ctx_[i] = spare_ctx_[spares_ - 1];
    --spares_;
    break;
  }
  // Events are made in the launching thread's current context: the launch's.
  if (event == nullptr && g_driver.cuEventCreate(&event, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return;
  if (g_driver.cuEventRecord(event, stream) != CUDA_SUCCESS) {
    recycle_locked(event, ctx);
    return;
  }
  // When it will start: now on an empty queue, else when the launch before
  // it is expected to end (unknown until an estimate exists).
  const uint64_t now = gputime::monotonic_ns();
  uint64_t start = now;
  if (count_ > 0) {
    const Tracked& before = ring_[(head_ + count_ - 1) % kRing];
    start = estimate_ns_ != 0 && before.start_ns != 0 ? std::max(now, before.start_ns + estimate_ns_) : 0;
  }
  ring_[(head_ + count_) % kRing] = Tracked{event, ctx, count_ > 0, now, start};
  ++count_;
}

uint32_t LaunchPacer::queued() {
  Locked locked(lock_);
  retire_completed_locked();
  return count_;
}

void LaunchPacer::forget(CUcontext ctx) {
  Locked locked(lock_);
  // Events of `ctx` are about to go with it; others are destroyed here.
  // ctx null: a device was reset, whose contexts we cannot name: nothing is
  // destroyed (the driver frees what went with the device's contexts).
  auto drop = [&](CUevent event, CUcontext owner) {
    if (event != nullptr && ctx != nullptr && owner != ctx && g_driver.cuEventDestroy_v2 != nullptr)
      g_driver.cuEventDestroy_v2(event);
  };
  for (uint32_t i = 0; i < count_; ++i) {
    Tracked& t = ring_[(head_ + i) % kRing];
    drop(t.event, t.ctx);
    t = Tracked{};
  }
  for (uint32_t i = 0; i < spares_; ++i) drop(spare_[i], spare_ctx_[i]);
  drop(last_done_, last_done_ctx_);
  head_ = count_ = spares_ = 0;
  last_done_ = nullptr;
  last_done_ctx_ = nullptr;
}

void LaunchPacer::reset_after_fork() {
  // The parent's events are the parent's: forgotten, not destroyed.
  memset(static_cast<void*>(ring_), 0, sizeof ring_);
  head_ = count_ = spares_ = 0;
  last_done_ = nullptr;
  last_done_ctx_ = nullptr;
  estimate_ns_ = 0;
  pthread_mutex_init(&lock_, nullptr);
}

}  // namespace fracgpu::interpose

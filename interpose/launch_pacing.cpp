// Launch pacing (launch_pacing.h; docs/sm-time.md, "Latency tenants").
#include "launch_pacing.h"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <utility>

#include "gputime.h"  // shm/: monotonic_ns
#include "hook_table.h"

namespace fracgpu::interpose {

namespace {

struct Locked {
  explicit Locked(pthread_mutex_t& m) : mutex(m) { pthread_mutex_lock(&mutex); }
  ~Locked() { pthread_mutex_unlock(&mutex); }
  pthread_mutex_t& mutex;
};

// A kernel that ran this many times its estimate, and this many budgets
// past it, was made long on purpose or by its arguments (a function's
// length is otherwise steady): its tenant paces one launch at a time for
// kStrictMs. Generous, so that a neighbour's work interleaved with ours (a
// latency tenant's burst between two of our kernels) is not taken for one.
constexpr uint64_t kOverrunFactor = 8, kOverrunBudgets = 8;
constexpr uint32_t kStrictMs = 5'000;
// One launch reserves at most this much on the tenant's queue, and an end
// further ahead than kMaxAheadUs is a damaged word (a budget is at most
// 100 ms): it is started over from now.
constexpr uint64_t kMaxReserveNs = 100'000'000;
constexpr int64_t kMaxAheadUs = 250'000;
// A marker measures its kernel's run only if the launch followed it at once:
// it completes when recorded (nothing of ours is queued), so a thread that
// lost its CPU between the two (a loaded host) would count that wait as GPU
// time, and a wait of 8 budgets puts the whole tenant in strict mode for
// kStrictMs. A launch later than this after its marker is measured from the
// launch instead, an upper bound that can only lower an estimate.
constexpr uint64_t kMarkerLateNs = 1'000'000;

uint32_t ms_of(uint64_t ns) { return static_cast<uint32_t>(ns / 1'000'000); }
uint32_t us_of(uint64_t ns) { return static_cast<uint32_t>(ns / 1'000); }

bool strict_now(const std::atomic<uint32_t>* word, uint64_t now) {
  if (word == nullptr) return false;
  const auto left = static_cast<int32_t>(word->load(std::memory_order_relaxed) - ms_of(now));
  return left > 0 && left <= static_cast<int32_t>(kStrictMs);
}

// Between wait_for_room and launched, in the launching thread: what the
// launch reserved (when it is expected to start, its estimate) and the
// event recorded just before it.
thread_local uint64_t t_start_ns = 0;
thread_local uint64_t t_estimate_ns = 0;
thread_local uint32_t t_reserved_end_us = 0;
thread_local CUevent t_marker = nullptr;
thread_local uint64_t t_marker_ns = 0;  // when t_marker was recorded
thread_local CUcontext t_marker_ctx = nullptr;

}  // namespace

LaunchPacer::Kind* LaunchPacer::find_kind_locked(const void* kernel, bool insert) {
  if (kernel == nullptr) return nullptr;
  const auto h = static_cast<uint32_t>(((reinterpret_cast<uintptr_t>(kernel) >> 4) * 0x9E3779B97F4A7C15ull) >> 56);
  for (uint32_t i = 0; i < kProbe; ++i) {
    Kind& k = kinds_[(h + i) % kKinds];
    if (k.kernel == kernel) return &k;
    if (insert && k.kernel == nullptr) {
      k = Kind{kernel, 0};
      return &k;
    }
  }
  if (!insert) return nullptr;
  Kind& k = kinds_[h % kKinds];  // crowded: the first of its probe makes room (it is unknown again)
  k = Kind{kernel, 0};
  return &k;
}

uint64_t LaunchPacer::estimate_locked(const void* kernel, uint64_t budget_ns, bool strict) {
  const Kind* k = find_kind_locked(kernel, false);
  // Never seen (or unnamed): the whole budget, so it queues alone until
  // its first run says what it costs.
  const uint64_t e = k != nullptr && k->estimate_ns != 0 ? k->estimate_ns : budget_ns;
  return strict ? std::max(e, budget_ns) : e;
}

void LaunchPacer::learn_locked(const Tracked& t, uint64_t ns, bool exact) {
  Kind* k = find_kind_locked(t.kernel, true);
  if (k == nullptr) return;
  // A run measured includes whatever of others' the GPU ran between it and
  // its predecessor (a latency tenant's burst): it errs long, once in a
  // while. The smaller of a kernel's last two runs goes into its average, so
  // one such run does not make the pacer keep the GPU idle for it; a kernel
  // that really grew shows it twice in a row. Far longer than estimated is
  // caught below, at once.
  if (exact) {
    const uint64_t sample = k->last_ns != 0 ? std::min(ns, k->last_ns) : ns;
    k->last_ns = std::max<uint64_t>(ns, 1);
    k->estimate_ns = std::max<uint64_t>(k->estimate_ns == 0 ? sample : (k->estimate_ns * 7 + sample) / 8, 1);
  } else if (k->estimate_ns == 0 || ns < k->estimate_ns) {
    k->estimate_ns = std::max<uint64_t>(ns, 1);  // an upper bound: it can only bring a stale estimate down
  }
  if (exact && t.estimate_ns != 0 && strict_word_ != nullptr && ns / kOverrunFactor > t.estimate_ns &&
      ns > t.estimate_ns + kOverrunBudgets * budget_ns_)
    strict_word_->store(ms_of(gputime::monotonic_ns()) + kStrictMs, std::memory_order_relaxed);
}

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
      // Its own GPU time: from the event just before it (nothing of ours
      // was queued), or from its predecessor's (it started when that one
      // ended: the GPU runs one context's work in order). Either includes
      // whatever the GPU ran of others' meanwhile, which only errs long.
      // Otherwise the time since its launch is an upper bound.
      CUevent from = t.marker != nullptr ? t.marker
                     : t.behind_work && last_done_ != nullptr && last_done_ctx_ == t.ctx ? last_done_
                                                                                          : nullptr;
      float ms = -1;
      if (from != nullptr && g_driver.cuEventElapsedTime != nullptr &&
          g_driver.cuEventElapsedTime(&ms, from, t.event) == CUDA_SUCCESS && ms >= 0 && ms < 10'000) {
        learn_locked(t, static_cast<uint64_t>(static_cast<double>(ms) * 1e6), true);
      } else if (!t.behind_work && t.launched_ns != 0 && now > t.launched_ns) {
        learn_locked(t, now - t.launched_ns, false);
      }
    }
    if (t.marker != nullptr) recycle_locked(t.marker, t.ctx);
    recycle_locked(last_done_, last_done_ctx_);
    last_done_ = state == CUDA_SUCCESS ? t.event : nullptr;
    last_done_ctx_ = state == CUDA_SUCCESS ? t.ctx : nullptr;
    if (state != CUDA_SUCCESS) recycle_locked(t.event, t.ctx);
    const uint32_t reserved_end = t.reserved_end_us;
    t = Tracked{};
    head_ = (head_ + 1) % kRing;
    --count_;
    // Done before the end it reserved, with nothing of ours queued after
    // it, and the last to reserve: the tenant's queue is empty now, not at
    // that end. An estimate that errs long (a neighbour's work ran between
    // two of our kernels) would otherwise keep the GPU idle until then.
    if (count_ == 0 && reserved_end != 0 && end_word_ != nullptr &&
        static_cast<int32_t>(reserved_end - us_of(now)) > 0) {
      uint32_t expected = reserved_end;
      end_word_->compare_exchange_strong(expected, us_of(now), std::memory_order_acq_rel);
    }
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

CUevent LaunchPacer::take_event_locked(CUcontext ctx) {
  for (uint32_t i = spares_; i-- > 0;) {
    if (spare_ctx_[i] != ctx) continue;
    CUevent event = spare_[i];
    spare_[i] = spare_[spares_ - 1];
    spare_ctx_[i] = spare_ctx_[spares_ - 1];
    --spares_;
    return event;
  }
  // Events are made in the launching thread's current context: the launch's.
  CUevent event = nullptr;
  return g_driver.cuEventCreate(&event, CU_EVENT_DEFAULT) == CUDA_SUCCESS ? event : nullptr;
}

bool LaunchPacer::wait_for_room(uint64_t budget_ns, CUcontext ctx, CUstream stream, const void* kernel,
                                const TenantQueue& tenant, const std::atomic<bool>& open) {
  auto sync = real<HookId::cuEventSynchronize>();
  Locked locked(lock_);
  budget_ns_ = budget_ns;
  strict_word_ = tenant.strict_until_ms;
  end_word_ = tenant.end_us;
  if (t_marker != nullptr) {
    recycle_locked(t_marker, t_marker_ctx);  // a launch that failed left it
    t_marker = nullptr;
  }
  for (;;) {
    if (!open.load(std::memory_order_acquire)) return false;
    retire_completed_locked();
    const uint64_t now = gputime::monotonic_ns();
    const bool strict = strict_now(tenant.strict_until_ms, now);
    // This process's own queue, by its events.
    if (count_ > 0 && sync != nullptr) {
      uint64_t queued = 0;
      for (uint32_t i = 0; i < count_; ++i)
        queued = std::min(queued + estimate_locked(ring_[(head_ + i) % kRing].kernel, budget_ns, strict), UINT64_MAX / 4);
      // The oldest is what the GPU runs now. Within kLeadNs of its expected
      // end it no longer counts: the next launch then queues behind it and
      // the GPU does not idle while this thread wakes (which costs a few
      // percent with 2 ms kernels); what may wait behind us grows by at
      // most kLeadNs. Well past that end (by its estimate again) it counts
      // whole again: it is longer than estimated, and whatever queues
      // behind it waits for all of it.
      const Tracked& oldest = ring_[head_];
      const uint64_t each = estimate_locked(oldest.kernel, budget_ns, strict);
      const uint64_t oldest_end = oldest.start_ns != 0 ? oldest.start_ns + each : 0;
      if (oldest_end != 0 && now + kLeadNs >= oldest_end && now < oldest_end + std::max(each, kLeadNs))
        queued -= each;
      if (count_ >= kRing || queued >= budget_ns) {
        if (oldest_end != 0 && count_ == 1 && oldest_end > now + kLeadNs && oldest_end - now - kLeadNs < 100'000'000) {
          // One launch queued, its end expected: sleep until just before it
          // (a completion sooner than expected is seen when we wake).
          const uint64_t sleep_ns = std::min<uint64_t>(oldest_end - now - kLeadNs, kMaxNapNs);
          struct timespec ts {0, static_cast<long>(sleep_ns)};
          pthread_mutex_unlock(&lock_);
          nanosleep(&ts, nullptr);
          pthread_mutex_lock(&lock_);
        } else if (sync(oldest.event) != CUDA_SUCCESS) {
          // Its context is gone, or the driver cannot say: stop tracking it.
          if (ring_[head_].marker != nullptr) recycle_locked(ring_[head_].marker, nullptr);
          recycle_locked(ring_[head_].event, nullptr);
          ring_[head_] = Tracked{};
          head_ = (head_ + 1) % kRing;
          --count_;
        }
        continue;
      }
    }
    // The tenant's queue, over all its processes: reserve this launch's
    // time on it while less than the budget is ahead, or while what is
    // ahead is about to end (one launch at least).
    const uint64_t estimate = std::min(estimate_locked(kernel, budget_ns, strict), kMaxReserveNs);
    uint64_t start = now;
    if (tenant.end_us != nullptr) {
      uint32_t end = tenant.end_us->load(std::memory_order_acquire);
      int64_t ahead_us = static_cast<int32_t>(end - us_of(now));
      if (ahead_us > kMaxAheadUs) ahead_us = 0;  // damaged (only our tenant can write it): start over
      const uint64_t ahead = ahead_us > 0 ? static_cast<uint64_t>(ahead_us) * 1000 : 0;
      if (ahead > kLeadNs && ahead + estimate > budget_ns) {
        const uint64_t sleep_ns = std::min<uint64_t>(ahead - kLeadNs, kMaxNapNs);
        struct timespec ts {0, static_cast<long>(sleep_ns)};
        pthread_mutex_unlock(&lock_);
        nanosleep(&ts, nullptr);
        pthread_mutex_lock(&lock_);
        continue;
      }
      const uint32_t next = (ahead > 0 ? end : us_of(now)) + static_cast<uint32_t>((estimate + 999) / 1000);
      if (!tenant.end_us->compare_exchange_strong(end, next, std::memory_order_acq_rel)) continue;
      start = now + ahead;
      t_reserved_end_us = next != 0 ? next : 1;
    }
    t_start_ns = start;
    t_estimate_ns = estimate;
    // Nothing of ours queued: an event just before the launch tells when
    // it started, so its run is measured (launched would only see an
    // upper bound).
    if (count_ == 0 && ctx != nullptr && g_driver.cuEventCreate != nullptr && g_driver.cuEventRecord != nullptr &&
        g_driver.cuEventQuery != nullptr) {
      CUevent marker = take_event_locked(ctx);
      if (marker != nullptr && g_driver.cuEventRecord(marker, stream) == CUDA_SUCCESS) {
        t_marker = marker;
        t_marker_ctx = ctx;
        t_marker_ns = gputime::monotonic_ns();
      } else {
        recycle_locked(marker, ctx);
      }
    }
    return true;
  }
}

void LaunchPacer::launched(CUcontext ctx, CUstream stream, const void* kernel) {
  CUevent marker = std::exchange(t_marker, nullptr);
  const uint64_t marker_ns = std::exchange(t_marker_ns, 0);
  const bool marker_late = marker != nullptr && gputime::monotonic_ns() - marker_ns > kMarkerLateNs;
  const uint64_t reserved_start = std::exchange(t_start_ns, 0), estimate = std::exchange(t_estimate_ns, 0);
  const uint32_t reserved_end = std::exchange(t_reserved_end_us, 0);
  // Without cuEventQuery nothing tracked could ever be retired (its events
  // would only pile up): track nothing.
  if (g_driver.cuEventCreate == nullptr || g_driver.cuEventRecord == nullptr || g_driver.cuEventQuery == nullptr) return;
  Locked locked(lock_);
  retire_completed_locked();
  if (count_ == kRing) {  // another thread filled it meanwhile: this launch goes untracked
    recycle_locked(marker, ctx);
    return;
  }
  CUevent event = take_event_locked(ctx);
  if (event == nullptr) {
    recycle_locked(marker, ctx);
    return;
  }
  if (g_driver.cuEventRecord(event, stream) != CUDA_SUCCESS) {
    recycle_locked(event, ctx);
    recycle_locked(marker, ctx);
    return;
  }
  // When it will start: when the tenant's queue ahead of its reservation is
  // expected to end, and not before the launch before it (of ours).
  const uint64_t now = gputime::monotonic_ns();
  if (marker_late) {
    recycle_locked(marker, ctx);
    marker = nullptr;
  }
  uint64_t start = std::max(now, reserved_start);
  if (count_ > 0) {
    const Tracked& before = ring_[(head_ + count_ - 1) % kRing];
    start = before.start_ns != 0 ? std::max(start, before.start_ns + estimate_locked(before.kernel, budget_ns_, false))
                                 : 0;
  }
  // Behind our own work, the marker (if another thread of ours queued
  // meanwhile) measures nothing of its own.
  if (count_ > 0 && marker != nullptr) {
    recycle_locked(marker, ctx);
    ring_[(head_ + count_) % kRing] = Tracked{event, ctx, kernel, nullptr, true, now, start, estimate, reserved_end};
  } else {
    ring_[(head_ + count_) % kRing] = Tracked{event, ctx, kernel, marker, count_ > 0, now, start, estimate, reserved_end};
  }
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
    drop(t.marker, t.ctx);
    t = Tracked{};
  }
  // Handles of a context gone may come back for other kernels.
  for (Kind& k : kinds_) k = Kind{};
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
  for (Kind& k : kinds_) k = Kind{};
  strict_word_ = end_word_ = nullptr;
  t_marker = nullptr;
  t_start_ns = t_estimate_ns = t_marker_ns = 0;
  t_reserved_end_us = 0;
  pthread_mutex_init(&lock_, nullptr);
}

}  // namespace fracgpu::interpose

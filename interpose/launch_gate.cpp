// The launch gate and the pacer (see launch_gate.h, shm/gputime.h, docs/sm-time.md).
//
// Per GPU entry of the tenant this process tracks whether the GPU is
// metered (shared with another tenant, or capped below a whole GPU), whether
// this process holds it, and whether its launches may go now ("open": held
// and neither draining nor over the limit). Launching threads only read
// that; the pacer thread does everything else: charging, handing the GPU on,
// draining, heartbeats. Threads that may not launch sleep on the arbiter's
// futex, which every change of holder bumps, with a timeout so that a dead
// holder is noticed even if nobody wakes them.
#include "launch_gate.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <cstdio>
#include <cstring>

#include "gputime.h"  // shm/: the arbiter
#include "hook_table.h"
#include "log.h"
#include "tenant.h"

namespace fracgpu::interpose {

std::atomic<uint64_t> g_launch_gate{1};  // 1: not set up yet; real epochs start at 2
thread_local uint64_t t_launch_pass = 0;
std::atomic<int> g_threads_in_sync{0};

namespace {

using gputime::Arbiter;
using gputime::GpuTimeSegment;
using gputime::kPpm;

constexpr uint64_t kGateUnset = 1;
constexpr uint64_t kTickNs = 1'000'000;              // pacer period while metered and busy
constexpr uint64_t kQuietTickNs = 20'000'000;        // ... otherwise (watching for reloads)
constexpr uint64_t kWaitSliceNs = 10'000'000;        // longest futex sleep before re-checking the holder
constexpr int kIdleTicks = 2;                        // ticks without a launch before the GPU goes back
constexpr int kMaxContexts = 8;                      // contexts per GPU the pacer drains

enum GpuStatus : int { kUnknown = 0, kUnmetered = 1, kReady = 2 };

struct GpuTime {
  std::atomic<int> status{kUnknown};
  Arbiter arbiter;
  int process = -1;   // our entry in the arbiter
  uint32_t tenant = 0;
  std::atomic<bool> metered{false};
  std::atomic<bool> holding{false};  // pacer's view: we hold the GPU
  std::atomic<bool> open{false};     // launches may go
  std::atomic<uint32_t> activity{0}; // slow-path passes since the pacer last looked
  std::atomic<int> waiting{0};       // threads blocked in wait_for_gpu
  int idle_ticks = 0;                // pacer only
  // Since when other processes' slices kept us waiting (0: they did not);
  // the hold that follows keeps the limit's allowance accrued since then.
  std::atomic<uint64_t> kept_off_since{0};
  uint64_t credit_from = 0;          // for the current hold (see gputime::charge)
  CUcontext contexts[kMaxContexts] = {};
  CUdevice context_device[kMaxContexts] = {};
  std::atomic<int> context_count{0};
};

GpuTime g_gpus[ledger::kMaxGpus];
pthread_mutex_t g_setup_lock = PTHREAD_MUTEX_INITIALIZER;   // setting up GPU entries, starting the pacer
pthread_mutex_t g_context_lock = PTHREAD_MUTEX_INITIALIZER; // contexts lists vs draining them
std::atomic<bool> g_pacer_started{false};
std::atomic<bool> g_atfork_done{false};

void bump_gate() {
  uint64_t gate = g_launch_gate.load(std::memory_order_relaxed);
  uint64_t next;
  do {
    next = gate + 1;
    if (next < 2 || next == ~0ull) next = 2;
  } while (!g_launch_gate.compare_exchange_weak(gate, next, std::memory_order_acq_rel));
}

bool any_metered() {
  for (const GpuTime& g : g_gpus)
    if (g.status.load(std::memory_order_acquire) == kReady && g.metered.load(std::memory_order_acquire)) return true;
  return false;
}

// The gate word as the metering of all GPUs requires: 0 if none is metered.
void refresh_gate() {
  if (!any_metered()) {
    g_launch_gate.store(0, std::memory_order_release);
    return;
  }
  bump_gate();
}

uint32_t my_share(int gpu) { return gpu_policy(gpu).share_ppm; }
uint32_t my_limit(int gpu) {
  const uint32_t limit = gpu_policy(gpu).limit_ppm;
  return limit == 0 ? kPpm : limit;
}

bool compute_metered(int gpu) {
  const GpuTimeSegment& seg = *g_gpus[gpu].arbiter.seg;
  return seg.active_tenants.load(std::memory_order_acquire) > 1 || my_limit(gpu) < kPpm;
}

// ---- contexts the pacer drains ----

void note_context(GpuTime& g, CUcontext ctx, CUdevice device) {
  const int n = g.context_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g.contexts[i] == ctx) return;
  pthread_mutex_lock(&g_context_lock);
  int count = g.context_count.load(std::memory_order_relaxed);
  bool known = false;
  for (int i = 0; i < count; ++i) known |= g.contexts[i] == ctx;
  if (!known && count < kMaxContexts) {
    g.contexts[count] = ctx;
    g.context_device[count] = device;
    g.context_count.store(count + 1, std::memory_order_release);
  } else if (!known) {
    FRACGPU_LOG_ONCE(LogLevel::kWarn, "more than %d contexts on one GPU: later ones are not drained at hand-over",
                     kMaxContexts);
  }
  pthread_mutex_unlock(&g_context_lock);
}

template <class Match>
void forget_contexts(Match match) {
  pthread_mutex_lock(&g_context_lock);
  for (GpuTime& g : g_gpus) {
    int count = g.context_count.load(std::memory_order_relaxed);
    for (int i = 0; i < count;) {
      if (!match(g.contexts[i], g.context_device[i])) {
        ++i;
        continue;
      }
      g.contexts[i] = g.contexts[count - 1];
      g.context_device[i] = g.context_device[count - 1];
      --count;
    }
    g.context_count.store(count, std::memory_order_release);
  }
  pthread_mutex_unlock(&g_context_lock);
}

// Waits until every context of this process on the GPU has finished its
// work, so the next holder starts on an empty GPU and we are charged for
// all our work. The pacer's capture mode is relaxed (see pacer_main), so a
// user thread capturing a graph does not make this fail.
void drain(GpuTime& g) {
  auto sync = real<HookId::cuCtxSynchronize>();
  if (sync == nullptr || g_driver.cuCtxPushCurrent_v2 == nullptr || g_driver.cuCtxPopCurrent_v2 == nullptr) return;
  pthread_mutex_lock(&g_context_lock);
  const int count = g.context_count.load(std::memory_order_relaxed);
  for (int i = 0; i < count; ++i) {
    if (g_driver.cuCtxPushCurrent_v2(g.contexts[i]) != CUDA_SUCCESS) continue;
    sync();
    CUcontext popped = nullptr;
    g_driver.cuCtxPopCurrent_v2(&popped);
  }
  pthread_mutex_unlock(&g_context_lock);
}

// ---- holding the GPU ----

// Charges the time held since the last charge to our tenant.
void charge_held(int gpu, uint64_t now) {
  GpuTime& g = g_gpus[gpu];
  GpuTimeSegment& seg = *g.arbiter.seg;
  // Only the holder charges: charged_ns is the current holder's (the exit
  // path may have handed the GPU on while the pacer was about to charge).
  if (seg.arbiter.holder.load(std::memory_order_acquire) != static_cast<uint32_t>(g.process) + 1) return;
  const uint64_t charged = seg.arbiter.charged_ns.load(std::memory_order_relaxed);
  if (now <= charged) return;
  gputime::charge(seg, g.tenant, static_cast<uint32_t>(g.process), now - charged, my_share(gpu), my_limit(gpu),
                  std::min(g.credit_from, now));
  seg.arbiter.charged_ns.store(now, std::memory_order_release);
}

// We just became the holder (claimed it, took it over, or were handed it).
void begin_holding(int gpu) {
  GpuTime& g = g_gpus[gpu];
  bool expected = false;
  if (!g.holding.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return;
  g.idle_ticks = 0;
  g.activity.store(1, std::memory_order_relaxed);  // count the grant itself as activity
  const uint64_t kept_off = g.kept_off_since.exchange(0, std::memory_order_acq_rel);
  g.credit_from = kept_off != 0 ? kept_off : gputime::monotonic_ns();
  gputime::ProcessTime& me = g.arbiter.seg->processes[g.process];
  const uint64_t since = me.want_since_ns.exchange(0, std::memory_order_acq_rel);
  const uint64_t now = gputime::monotonic_ns();
  if (since != 0 && now > since) me.waited_ns.fetch_add(now - since, std::memory_order_relaxed);
  g.open.store(true, std::memory_order_release);
  bump_gate();
}

// Hands the GPU on: stop our launches, let our work finish, pay for it, and
// give it to `next` (or to nobody). Pacer (or exit) only.
void end_holding(int gpu, int next, bool drain_first) {
  GpuTime& g = g_gpus[gpu];
  if (!g.holding.load(std::memory_order_acquire)) return;
  g.open.store(false, std::memory_order_release);
  bump_gate();
  if (drain_first) drain(g);
  GpuTimeSegment& seg = *g.arbiter.seg;
  const uint64_t now = gputime::monotonic_ns();
  charge_held(gpu, now);
  // Hand over before clearing `holding`: a thread of ours that finds the
  // arbiter still naming us and `holding` clear takes the GPU up again
  // (wait_for_turn), and would reopen our gate under the next holder.
  gputime::hand_over(seg, static_cast<uint32_t>(g.process), next, now);
  g.holding.store(false, std::memory_order_release);
  // Threads that still want the GPU re-register when they wake.
}

// One pacer step for a GPU we hold.
void pace_holder(int gpu, uint64_t now) {
  GpuTime& g = g_gpus[gpu];
  GpuTimeSegment& seg = *g.arbiter.seg;
  seg.arbiter.heartbeat_ns.store(now, std::memory_order_release);
  charge_held(gpu, now);
  const bool active = g.activity.exchange(0, std::memory_order_acq_rel) != 0 ||
                      g.waiting.load(std::memory_order_acquire) > 0 ||
                      g_threads_in_sync.load(std::memory_order_relaxed) > 0;
  g.idle_ticks = active ? 0 : g.idle_ticks + 1;
  const bool idle = g.idle_ticks >= kIdleTicks;
  const bool over_limit = !gputime::within_limit(seg.tenants[g.tenant], my_limit(gpu), now, nullptr);
  const uint64_t slice = seg.slice_ns.load(std::memory_order_relaxed);
  const bool expired = now - seg.arbiter.grant_ns.load(std::memory_order_relaxed) >=
                       (slice != 0 ? slice : gputime::kDefaultSliceNs);
  if (!idle && !over_limit && !expired) return;
  const gputime::Candidate next =
      gputime::pick_next(g.arbiter, g.process, g.tenant, now);
  if (over_limit || (idle && (next.process >= 0 || g.idle_ticks >= 10 * kIdleTicks))) {
    end_holding(gpu, next.process, true);
    return;
  }
  if (expired && next.process >= 0) {
    const uint64_t mine = gputime::effective_vtime(seg, g.tenant);
    if (next.vtime < mine || next.tenant == g.tenant) end_holding(gpu, next.process, true);
  }
}

// ---- setting up a GPU entry ----

bool open_gpu(int gpu) {
  GpuTime& g = g_gpus[gpu];
  char path[1100];
  snprintf(path, sizeof path, "%s/gputime-%d", g_tenant.dir, gpu);
  char err[512] = {};
  const ledger::GpuEntry policy = gpu_policy(gpu);
  Arbiter arbiter;
  ledger::LedgerError e = gputime::open_arbiter(path, false, false, policy.uuid, &arbiter, err, sizeof err);
  if (e == ledger::LedgerError::kMissing) {
    // An older daemon, or a GPU granted before the arbiter existed: memory
    // quotas still hold, GPU time is not shared.
    log_line(LogLevel::kWarn, "no GPU-time arbiter for GPU entry %d (%s): its time is not shared", gpu, path);
    return false;
  }
  if (e != ledger::LedgerError::kOk) {
    log_line(LogLevel::kError, "GPU-time arbiter refused (%s): %s; its time is not shared",
             ledger::ledger_error_name(e), err);
    return false;
  }
  const int tenant = gputime::find_tenant(*arbiter.seg, g_tenant.ledger.policy->tenant);
  if (tenant < 0) {
    log_line(LogLevel::kWarn, "%s does not list tenant \"%s\": its time is not shared", path,
             g_tenant.ledger.policy->tenant);
    gputime::close_arbiter(&arbiter);
    return false;
  }
  // Our identity as attach read it (/proc/self/stat), from our ledger slot.
  const ledger::ProcessSlot& self = g_tenant.ledger.usage->slots[g_tenant.slot];
  auto claim = [&] {
    return gputime::claim_process(arbiter, static_cast<uint32_t>(tenant), self.pid.load(), self.start_time.load());
  };
  int process = claim();
  if (process < 0) {
    // Full of entries, perhaps of dead processes not yet reclaimed.
    gputime::reclaim_dead_processes(arbiter, -1);
    process = claim();
  }
  if (process < 0) {
    log_line(LogLevel::kError, "%s: no free process entry: this process's GPU time is not shared", path);
    gputime::close_arbiter(&arbiter);
    return false;
  }
  g.arbiter = arbiter;
  g.tenant = static_cast<uint32_t>(tenant);
  g.process = process;
  return true;
}

void* pacer_main(void*);

void start_pacer() {
  if (g_pacer_started.exchange(true)) return;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  // No user signal handler may run on our thread.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t thread;
  if (pthread_create(&thread, &attr, pacer_main, nullptr) != 0) {
    g_pacer_started.store(false);
    log_line(LogLevel::kError, "cannot start the GPU-time pacer thread: GPU time is not shared");
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  pthread_attr_destroy(&attr);
}

void on_fork_child() {
  // The parent's entries, holdership and pacer are the parent's; the child
  // starts over on its first launch. Its inherited mappings are closed
  // (closing drops none of the parent's record locks: those are the parent's).
  for (GpuTime& g : g_gpus) {
    if (g.status.load(std::memory_order_relaxed) == kReady) gputime::close_arbiter(&g.arbiter);
    g.status.store(kUnknown, std::memory_order_relaxed);
    g.process = -1;
    g.metered.store(false, std::memory_order_relaxed);
    g.holding.store(false, std::memory_order_relaxed);
    g.open.store(false, std::memory_order_relaxed);
    g.waiting.store(0, std::memory_order_relaxed);
    g.context_count.store(0, std::memory_order_relaxed);
  }
  pthread_mutex_init(&g_setup_lock, nullptr);
  pthread_mutex_init(&g_context_lock, nullptr);
  g_pacer_started.store(false, std::memory_order_relaxed);
  g_launch_gate.store(kGateUnset, std::memory_order_release);
}

// The entry's status, setting it up on first use.
int ensure_gpu(int gpu) {
  GpuTime& g = g_gpus[gpu];
  const int status = g.status.load(std::memory_order_acquire);
  if (status != kUnknown) return status;
  pthread_mutex_lock(&g_setup_lock);
  if (g.status.load(std::memory_order_relaxed) == kUnknown) {
    if (!g_atfork_done.exchange(true)) pthread_atfork(nullptr, nullptr, on_fork_child);
    if (open_gpu(gpu)) {
      g.metered.store(compute_metered(gpu), std::memory_order_relaxed);
      g.status.store(kReady, std::memory_order_release);
      start_pacer();
    } else {
      g.status.store(kUnmetered, std::memory_order_release);
    }
  }
  pthread_mutex_unlock(&g_setup_lock);
  return g.status.load(std::memory_order_acquire);
}

bool stream_is_capturing(CUstream stream) {
  if (g_driver.cuStreamIsCapturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  // An error (e.g. the legacy stream while another stream captures) is the
  // launch's to report: let it through rather than block.
  if (g_driver.cuStreamIsCapturing(stream, &status) != CUDA_SUCCESS) return true;
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

// Blocks until this process holds the GPU and its launches are open.
void wait_for_turn(int gpu) {
  GpuTime& g = g_gpus[gpu];
  GpuTimeSegment& seg = *g.arbiter.seg;
  gputime::ProcessTime& me = seg.processes[g.process];
  g.waiting.fetch_add(1, std::memory_order_acq_rel);
  for (;;) {
    if (g.open.load(std::memory_order_acquire) || !g.metered.load(std::memory_order_acquire)) break;
    const uint32_t turn = seg.arbiter.turn.load(std::memory_order_acquire);
    const uint64_t now = gputime::monotonic_ns();
    uint64_t zero = 0;
    me.want_since_ns.compare_exchange_strong(zero, now, std::memory_order_acq_rel);
    const uint32_t holder = seg.arbiter.holder.load(std::memory_order_acquire);
    uint64_t eligible_at = 0;
    const bool within = gputime::within_limit(seg.tenants[g.tenant], my_limit(gpu), now, &eligible_at);
    if (holder == static_cast<uint32_t>(g.process) + 1) {
      // Handed to us, or we still hold it while the pacer drains: in the
      // first case take it up; in the second the pacer bumps turn when done.
      if (!g.holding.load(std::memory_order_acquire)) {
        begin_holding(gpu);
        continue;
      }
    } else if (holder == 0 && within) {
      if (gputime::try_claim(seg, static_cast<uint32_t>(g.process), now)) {
        begin_holding(gpu);
        continue;
      }
    } else if (holder != 0 && gputime::try_take_over(g.arbiter, static_cast<uint32_t>(g.process), now)) {
      log_line(LogLevel::kInfo, "GPU entry %d: took the GPU over from a dead or stuck process", gpu);
      begin_holding(gpu);
      continue;
    }
    uint64_t timeout = kWaitSliceNs;
    if (holder == static_cast<uint32_t>(g.process) + 1) timeout = kTickNs;  // our own pacer is at work
    if (holder != 0 && holder != static_cast<uint32_t>(g.process) + 1 && within) {
      uint64_t none = 0;
      g.kept_off_since.compare_exchange_strong(none, now, std::memory_order_acq_rel);
    }
    if (!within && eligible_at > now) timeout = std::min(timeout, eligible_at - now);
    gputime::wait_for_turn(seg, turn, timeout);
    gputime::add_throttled(seg.tenants[g.tenant], now, gputime::monotonic_ns());
  }
  // The last waiter out withdraws the process's request unless it holds
  // the GPU (metering was switched off meanwhile).
  if (g.waiting.fetch_sub(1, std::memory_order_acq_rel) == 1 && !g.holding.load(std::memory_order_acquire)) {
    me.want_since_ns.store(0, std::memory_order_release);
    g.kept_off_since.store(0, std::memory_order_release);
  }
}

void* pacer_main(void*) {
  // Graph capture in global mode forbids unsafe calls from every thread;
  // this thread's own mode is relaxed, so draining cannot break a capture.
  if (load_real_driver() && g_driver.cuThreadExchangeStreamCaptureMode != nullptr) {
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    g_driver.cuThreadExchangeStreamCaptureMode(&mode);
  }
  uint64_t next_refresh = 0;
  for (;;) {
    const uint64_t now = gputime::monotonic_ns();
    bool busy = false;
    const bool refresh = now >= next_refresh;
    if (refresh) next_refresh = now + kQuietTickNs;
    bool metering_changed = false;
    for (int gpu = 0; gpu < static_cast<int>(ledger::kMaxGpus); ++gpu) {
      GpuTime& g = g_gpus[gpu];
      if (g.status.load(std::memory_order_acquire) != kReady) continue;
      if (refresh) {
        // Shares, limits and the set of tenants change on reload.
        const bool metered = compute_metered(gpu);
        if (metered != g.metered.load(std::memory_order_relaxed)) {
          g.metered.store(metered, std::memory_order_release);
          metering_changed = true;
          if (!metered) end_holding(gpu, -1, false);
          gputime::wake_waiters(*g.arbiter.seg);
        }
      }
      if (!g.metered.load(std::memory_order_relaxed)) continue;
      const uint32_t holder = g.arbiter.seg->arbiter.holder.load(std::memory_order_acquire);
      // Handed to us while no thread was awake to take it up: take it (the
      // idle check gives it back if nobody here wants it any more).
      if (holder == static_cast<uint32_t>(g.process) + 1 && !g.holding.load(std::memory_order_acquire))
        begin_holding(gpu);
      if (g.holding.load(std::memory_order_acquire)) {
        pace_holder(gpu, gputime::monotonic_ns());
        busy = true;
      }
      busy |= g.waiting.load(std::memory_order_acquire) > 0;
    }
    if (metering_changed) refresh_gate();
    // Each tick ends every thread's pass: the next launch shows it is active.
    if (busy) bump_gate();
    struct timespec ts {0, static_cast<long>(busy ? kTickNs : kQuietTickNs)};
    nanosleep(&ts, nullptr);
  }
  return nullptr;
}

// At exit the driver abandons our work: give the GPU back at once.
__attribute__((destructor)) void release_on_exit() {
  for (int gpu = 0; gpu < static_cast<int>(ledger::kMaxGpus); ++gpu) {
    GpuTime& g = g_gpus[gpu];
    if (g.status.load(std::memory_order_acquire) != kReady || !g.holding.load(std::memory_order_acquire)) continue;
    const gputime::Candidate next = gputime::pick_next(g.arbiter, g.process, g.tenant, gputime::monotonic_ns());
    end_holding(gpu, next.process, false);
  }
}

}  // namespace

void wait_for_gpu(CUstream stream) {
  if (!load_real_driver() || tenant_mode() != TenantMode::kManaged) {
    g_launch_gate.store(0, std::memory_order_release);  // nothing is metered in this process
    t_launch_pass = 0;
    return;
  }
  if (g_launch_gate.load(std::memory_order_acquire) == kGateUnset) {
    // First launch in the process: nothing metered until a GPU says so.
    uint64_t unset = kGateUnset;
    g_launch_gate.compare_exchange_strong(unset, any_metered() ? 2 : 0, std::memory_order_acq_rel);
  }
  CUcontext ctx = nullptr;
  CUdevice device = 0;
  int gpu = kNotGranted;
  // Read the gate before deciding: a change after this read makes the pass stale.
  const uint64_t gate = g_launch_gate.load(std::memory_order_acquire);
  if (!current_gpu_entry(&ctx, &device, &gpu) || gpu < 0) return;  // the driver or the memory hooks decide
  if (ensure_gpu(gpu) != kReady) {
    t_launch_pass = gate;
    return;
  }
  GpuTime& g = g_gpus[gpu];
  if (!g.metered.load(std::memory_order_acquire)) {
    // The pass is the gate word read before `metered`: metering a GPU sets
    // `metered`, then changes the word, so a GPU metered since makes this
    // pass stale. Dropping the word to 0 (no GPU metered) only if it has not
    // changed since: a plain store could undo a change made meanwhile.
    uint64_t seen = gate;
    if (seen != 0 && !any_metered() &&
        g_launch_gate.compare_exchange_strong(seen, 0, std::memory_order_acq_rel))
      seen = 0;
    t_launch_pass = seen;
    return;
  }
  if (g_launch_gate.load(std::memory_order_acquire) == 0) refresh_gate();
  note_context(g, ctx, device);
  if (!g.open.load(std::memory_order_acquire)) {
    // Work captured into a graph does not run now; blocking would only stall
    // the capture. It is governed when the graph is launched.
    if (stream_is_capturing(stream)) return;
    wait_for_turn(gpu);
  }
  g.activity.fetch_add(1, std::memory_order_relaxed);
  // Pass until the pacer's next tick. The word is read *before* `open`: the
  // pacer closes `open`, then changes the word, so either this read of the
  // word precedes the change (the pass is stale at once) or the read of
  // `open` below sees it closed. Read the other way round, a close and
  // change between the two reads would leave a pass that matches the new
  // word: a thread launching ungoverned until the word changes again, which
  // may be never once its process neither holds nor waits for the GPU.
  const uint64_t word = g_launch_gate.load(std::memory_order_acquire);
  t_launch_pass = g.open.load(std::memory_order_acquire) ? word : ~0ull;
}

void wait_for_gpu_of_stream(CUstream stream) {
  CUcontext ctx = nullptr;
  if (stream == nullptr || g_driver.cuStreamGetCtx == nullptr || g_driver.cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS ||
      g_driver.cuCtxPushCurrent_v2 == nullptr || g_driver.cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS) {
    wait_for_gpu(stream);
    return;
  }
  wait_for_gpu(stream);
  CUcontext popped = nullptr;
  g_driver.cuCtxPopCurrent_v2(&popped);
  invalidate_launch_pass();
}

void gputime_forget_context(CUcontext ctx) {
  forget_contexts([ctx](CUcontext c, CUdevice) { return c == ctx; });
}

void gputime_forget_device(CUdevice device) {
  forget_contexts([device](CUcontext, CUdevice d) { return d == device; });
}

}  // namespace fracgpu::interpose

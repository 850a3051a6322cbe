// The launch gate and the pacer (see launch_gate.h, shm/gputime.h, docs/sm-time.md).
//
// The daemon schedules; this process only asks and reports. Per GPU entry
// of each of its tenants (tenant.h) it tracks whether the GPU is metered (shared with another
// tenant, or capped below a whole GPU), which grant of the daemon's it
// entered, and whether its launches may go now ("open": its tenant holds
// the GPU and it entered that grant, or the daemon is down and the GPU runs
// unshared). Launching threads only read `open`; a thread that may not
// launch asks for the GPU in the process's GpuTimeRequest (its tenant's
// usage file), rings the daemon's doorbell and sleeps on the arbiter's
// `turn` futex, which the daemon bumps at every grant and revocation. The
// pacer thread leaves grants that were revoked (close, drain, report),
// tells the daemon when the process last launched, and watches the
// daemon's heartbeat. The arbiter itself is mapped read-only.
#include "launch_gate.h"

#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "gputime.h"  // shm/: the arbiter
#include "hook_table.h"
#include "launch_pacing.h"
#include "log.h"
#include "tenant.h"

namespace fracgpu::interpose {

std::atomic<uint64_t> g_launch_gate{1};  // 1: not set up yet; real epochs start at 2
constinit thread_local uint64_t t_launch_pass = 0;
thread_local int t_paced_gpu = -1;  // the GPU entry of this thread's paced launch (wait_for_gpu -> launch_paced)
thread_local CUcontext t_paced_ctx = nullptr;
thread_local const void* t_paced_kernel = nullptr;
std::atomic<int> g_threads_in_sync{0};
std::atomic<bool> g_latency_held{false};
std::atomic<bool> g_unsynced{false};

namespace {

using gputime::Arbiter;
using gputime::GpuTimeSegment;
using gputime::kPpm;

constexpr uint64_t kGateUnset = 1;
constexpr uint64_t kTickNs = 1'000'000;              // pacer period while holding a GPU
constexpr uint64_t kQuietTickNs = 20'000'000;        // ... otherwise (watching for reloads and the daemon)
// A process that has launched nothing for kRestAfterNs has no use for the
// quiet tick (reloads and the daemon matter to its next launch, not before):
// its pacer rests, up to kRestTickNs at a time, woken by that launch. An
// idle process (a notebook between cells, a server between requests) then
// costs the host one wake-up a second instead of fifty.
constexpr uint64_t kRestAfterNs = 1'000'000'000;
constexpr uint64_t kRestTickNs = 1'000'000'000;
// Longest futex sleep of a waiter (and of the pacer of a process that only
// waits) before it looks again. What it must do on its own is renew its
// ask (kWantFreshNs, 50 ms: two renewers, each at least every 20 ms), see
// the daemon go down (1 s), and ring again when its first ring may have
// been lost (a narrow race: the daemon passes every millisecond while
// anyone asks or holds): a grant wakes it at once through `turn`.
constexpr uint64_t kWaitSliceNs = 20'000'000;
constexpr uint64_t kRestateNs = 1'000'000'000;       // a waiter restates its slot's drain words this often
// A latency tenant's process gives its grant back once it has been idle
// (no launch, no thread waiting for the GPU or synchronizing) for its hold
// time: the others' work waits while it holds the GPU. The hold adapts to
// the process: a grant given back and asked for again within kReaskNs was
// given back too soon (a decode loop's CPU work between two steps: the next
// step would wait for a hand-over and whatever the others queued), so the
// hold doubles, up to kMaxHoldNs; a process that stays away kQuietNs or
// more (requests that come and go) halves it, down to nothing (given back
// at its synchronization's return). Its pacer looks every kLatencyTickNs.
constexpr uint64_t kFirstHoldNs = 40'000;
constexpr uint64_t kMinHoldNs = 10'000;  // a hold halved below this is none
constexpr uint64_t kMaxHoldNs = 1'000'000;
constexpr uint64_t kReaskNs = 1'000'000;
constexpr uint64_t kQuietNs = 5'000'000;
constexpr uint64_t kLatencyTickNs = 40'000;
// A process that launched since its last synchronization returned may have
// work queued, and is most likely between two launches of one request (a
// thread that lost its CPU for a moment, a launch slowed by the driver): it
// keeps the grant at least this long after its last launch. Given back
// there, the request's next launch waited for the drain and a new grant,
// 5-8 ms on a loaded host, where the whole request takes 2 ms.
constexpr uint64_t kUnsyncedHoldNs = kMaxHoldNs;
// What a pace budget from the arbiter may be (a damaged one is clamped).
constexpr uint64_t kMinPaceNs = 10'000, kMaxPaceNs = 100'000'000;
constexpr int kMaxContexts = 8;                      // contexts per GPU the pacer drains
// The daemon counts as down once its heartbeat has looked dead this long:
// a heartbeat damaged for a moment (the daemon rewrites it every pass) is
// not a daemon gone.
constexpr uint64_t kDownConfirmNs = 10'000'000;

// kRefused: the GPU's time is scheduled (its arbiter exists) but not for
// our tenant: the daemon gave the tenant no row there (refused it), or the
// arbiter was refused as corrupt or foreign. Launches on it fail.
enum GpuStatus : int { kUnknown = 0, kUnmetered = 1, kReady = 2, kRefused = 3 };
constexpr uint64_t kRefusedRetryNs = 100'000'000;  // a refused GPU is looked at again at most this often
constexpr int kFirstRefusalRetries = 5;              // ... and, the first time, this many times more
constexpr uint64_t kFirstRefusalPauseNs = 10'000'000;  // this far apart

struct GpuTime {
  std::atomic<int> status{kUnknown};
  Arbiter arbiter;                             // mapped read-only: the daemon's
  uint32_t row = 0;                            // our tenant's row in it
  ledger::GpuTimeRequest* request = nullptr;   // our slot's requests, in our usage file
  std::atomic<bool> metered{false};
  std::atomic<bool> open{false};      // launches may go: a grant entered, or unshared
  // The grant (sequence number) this process entered; 0: none. Changed
  // under `transition` only.
  std::atomic<uint64_t> entered{0};
  std::atomic<bool> unshared{false};  // the daemon is down: the GPU runs unshared
  std::atomic<uint64_t> dead_since{0};  // when its heartbeat first looked dead (0: it does not)
  std::atomic<uint32_t> activity{0};  // slow-path passes since the pacer last looked
  std::atomic<int> waiting{0};        // threads blocked in wait_for_gpu
  pthread_mutex_t transition = PTHREAD_MUTEX_INITIALIZER;  // entering, leaving, going unshared
  uint64_t accounted_ns = 0;          // request->used_ns counts the grant up to here (under transition)
  CUcontext contexts[kMaxContexts] = {};
  CUdevice context_device[kMaxContexts] = {};
  std::atomic<int> context_count{0};
  uint64_t retry_ns = 0;  // kRefused: when to look again (under g_setup_lock)
  LaunchPacer pacer;          // our launches' queue on the GPU, while others' latency asks for it
  uint64_t idle_since = 0;    // a latency tenant's grant: since when the process is idle (pacer thread only)
  // A latency tenant's hold (see kFirstHoldNs) and when it last gave a
  // grant back for being idle; under `transition`.
  uint64_t hold_ns = kFirstHoldNs;
  uint64_t released_ns = 0;
};

GpuTime g_gpus[kMaxTenantGpus];
// The pacer sleeps on this (a private futex) while it holds a latency
// tenant's grant, so that a synchronization's return wakes it at once.
std::atomic<uint32_t> g_pacer_kick{0};
// A launch took the slow path since the pacer last looked.
std::atomic<bool> g_launched{false};
// The pacer rests (kRestAfterNs). It set this, then changed the gate word,
// so every thread's next launch takes the slow path and wakes it.
std::atomic<bool> g_pacer_resting{false};
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

// True if some GPU needs the launch gate: metered, or refused (a pass must
// never carry a thread's launches onto it).
bool any_metered() {
  for (const GpuTime& g : g_gpus) {
    const int status = g.status.load(std::memory_order_acquire);
    if (status == kRefused || (status == kReady && g.metered.load(std::memory_order_acquire))) return true;
  }
  return false;
}

// The gate word as the metering of all GPUs requires: 0 if none is metered
// (or refused).
void refresh_gate() {
  if (!any_metered()) {
    g_launch_gate.store(0, std::memory_order_release);
    return;
  }
  bump_gate();
}

uint32_t my_limit(int gpu) {
  const uint32_t limit = gpu_policy(gpu).limit_ppm;
  return limit == 0 ? kPpm : limit;
}

bool compute_metered(int gpu) {
  const GpuTimeSegment& seg = *g_gpus[gpu].arbiter.seg;
  return gputime::gated(seg.daemon.active_tenants.load(std::memory_order_acquire), my_limit(gpu));
}

// True once the daemon's heartbeat has looked dead (gputime::daemon_alive)
// for kDownConfirmNs.
bool daemon_down(GpuTime& g, uint64_t now) {
  if (gputime::daemon_alive(*g.arbiter.seg, now)) {
    if (g.dead_since.load(std::memory_order_relaxed) != 0) g.dead_since.store(0, std::memory_order_relaxed);
    return false;
  }
  uint64_t since = g.dead_since.load(std::memory_order_relaxed);
  if (since == 0 && g.dead_since.compare_exchange_strong(since, now, std::memory_order_relaxed)) return false;
  return since != 0 && now > since && now - since >= kDownConfirmNs;
}

// The grant in `word` (read from our tenant's own grant word) is ours, and
// its processes may launch.
bool granted_to_us(const GpuTime& g, uint64_t word) {
  return gputime::grant_valid(word) && gputime::grant_state(word) == gputime::kGranted &&
         gputime::grant_row(word) == g.row;
}

// Our tenant's priority on this GPU, as the daemon wrote it in our row.
bool latency_tenant(const GpuTime& g) {
  return g.arbiter.seg->tenants[g.row].priority.load(std::memory_order_relaxed) == gputime::kPriorityLatency;
}

// How much of our work may be queued on the GPU now: 0 (no limit) unless a
// latency tenant is active there and we are not one.
uint64_t pace_budget(const GpuTime& g) {
  const uint64_t budget = g.arbiter.seg->daemon.pace_inflight_ns.load(std::memory_order_relaxed);
  if (budget == 0 || latency_tenant(g)) return 0;
  return std::clamp(budget, kMinPaceNs, kMaxPaceNs);
}

// ---- contexts the pacer drains ----

// Tells the daemon how many contexts of ours the GPU runs (side by side
// needs one per process). Under g_context_lock.
void publish_context_count(GpuTime& g, int count) {
  if (g.request != nullptr) g.request->contexts.store(static_cast<uint64_t>(count), std::memory_order_relaxed);
}

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
    publish_context_count(g, count + 1);
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
    publish_context_count(g, count);
  }
  pthread_mutex_unlock(&g_context_lock);
}

// Waits until every context of this process on the GPU has finished its
// work, so the next holder starts on an empty GPU and our tenant is charged
// for all our work. The pacer's capture mode is relaxed (see pacer_main), so
// a user thread capturing a graph does not make this fail.
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

// ---- asking for, holding and giving back the GPU ----
//
// The daemon grants the GPU to our tenant; each of its processes enters the
// grant on its own (gputime::enter_grant, the handshake's process half),
// launches while it holds it, and on seeing the grant revoked or moved on
// closes its gate, drains and reports the drain. Transitions take
// `transition`; the launch path only reads `open`.

// Credits our request's display figure with the grant time since the last call.
void account_used(GpuTime& g, uint64_t now) {
  if (g.accounted_ns != 0 && now > g.accounted_ns)
    g.request->used_ns.fetch_add(now - g.accounted_ns, std::memory_order_relaxed);
  g.accounted_ns = now;
}

// A latency tenant's process asked again at `asked`, after giving a grant
// back for being idle: was that too soon, or was it away long? Caller
// holds `transition`.
void adapt_hold(GpuTime& g, uint64_t asked) {
  const uint64_t away = asked > g.released_ns ? asked - g.released_ns : 0;
  g.released_ns = 0;
  if (away < kReaskNs)
    g.hold_ns = std::min(std::max(g.hold_ns * 2, kMinHoldNs), kMaxHoldNs);
  else if (away >= kQuietNs)
    g.hold_ns = g.hold_ns / 2 < kMinHoldNs ? 0 : g.hold_ns / 2;
}

// Enters the grant in `word` (our tenant's) if we have not: true if the
// gate is open now. Caller holds `transition`.
bool enter_locked(GpuTime& g, uint64_t word) {
  if (g.entered.load(std::memory_order_relaxed) != 0) return g.open.load(std::memory_order_acquire);
  if (!gputime::enter_grant(*g.arbiter.seg, *g.request, word)) return false;
  const uint64_t now = gputime::monotonic_ns();
  g.entered.store(gputime::grant_seq(word), std::memory_order_release);
  g.accounted_ns = now;
  g.request->last_active_ns.store(now, std::memory_order_relaxed);  // the grant counts as activity
  g.activity.store(1, std::memory_order_relaxed);
  // After entered_grant (enter_grant stored it): a reader that finds the
  // want withdrawn finds us entered, so it never sees neither.
  const uint64_t since = g.request->want_since_ns.exchange(0, std::memory_order_seq_cst);
  if (since != 0 && now > since) g.request->waited_ns.fetch_add(now - since, std::memory_order_relaxed);
  if (g.released_ns != 0 && since != 0) adapt_hold(g, since);
  g.open.store(true, std::memory_order_release);
  bump_gate();
  // A pacer asleep in its quiet tick (it neither held nor waited when it
  // last looked) must now watch this grant: a revocation must reach it at
  // once, and a latency tenant's grant needs its short ticks.
  kick_pacer();
  return true;
}

// A process waiting in the gate has entered no grant, so nothing of any
// grant is its on the GPU, and its slot's words should say so. But they are
// in its tenant's usage file, which any process of the tenant can write: a
// grant that reads there as entered and not drained (a hostile tenant's
// garbage: a drained word wiped, a grant number guessed) makes the daemon
// wait for a drain report this process has no reason to send, its tenant
// blocked until then and this process waiting for a grant, for good. So a
// waiter reports such a grant drained (true: none of its work is on the
// GPU), once a second while it waits. Caller holds `transition`, with
// nothing entered.
void restate_nothing_entered_locked(GpuTime& g) {
  const uint64_t said = g.request->entered_grant.load(std::memory_order_seq_cst);
  if (said != 0 && g.request->drained_grant.load(std::memory_order_seq_cst) != said)
    gputime::report_drained(*g.arbiter.seg, *g.request, said);
}

// Closes the gate on the grant we entered, drains (unless `drain_first` is
// false: at exit, or when the GPU stopped being metered) and reports it.
// Caller holds `transition`.
void leave_locked(GpuTime& g, bool drain_first) {
  const uint64_t seq = g.entered.load(std::memory_order_relaxed);
  if (seq == 0) return;
  g.open.store(false, std::memory_order_release);
  bump_gate();
  if (drain_first) drain(g);
  account_used(g, gputime::monotonic_ns());
  g.accounted_ns = 0;
  g.entered.store(0, std::memory_order_release);
  gputime::report_drained(*g.arbiter.seg, *g.request, seq);
}

// The daemon is down (no heartbeat for a second, or it stopped): nobody
// grants, so the GPU runs unshared until it is back. Caller holds `transition`.
void go_unshared_locked(int gpu) {
  GpuTime& g = g_gpus[gpu];
  if (g.unshared.load(std::memory_order_relaxed)) return;
  // What we entered is over (a new daemon starts with no holder); nobody
  // waits for the report, which is harmless.
  leave_locked(g, false);
  g.request->want_since_ns.store(0, std::memory_order_release);
  g.unshared.store(true, std::memory_order_release);
  g.open.store(true, std::memory_order_release);
  bump_gate();
  // An error, shown by default: the tenant's share is not enforced meanwhile.
  log_line(LogLevel::kError,
           "GPU entry %u of tenant \"%s\": fracgpud is not scheduling GPU time: running unshared until it is back",
           entry_of(gpu), tenant_of(gpu).ledger.policy->tenant);
}

void back_to_shared_locked(int gpu) {
  GpuTime& g = g_gpus[gpu];
  if (!g.unshared.load(std::memory_order_relaxed)) return;
  g.unshared.store(false, std::memory_order_release);
  g.open.store(false, std::memory_order_release);
  bump_gate();
  log_line(LogLevel::kInfo, "GPU entry %u of tenant \"%s\": fracgpud schedules GPU time again: asking for the GPU",
           entry_of(gpu), tenant_of(gpu).ledger.policy->tenant);
}

// ---- setting up a GPU entry ----

// What opening a GPU entry's arbiter found: kReady (opened, our row found),
// kUnmetered (no arbiter: nothing schedules this GPU's time) or kRefused;
// why, in `why`, for the caller to log.
int open_gpu(int gpu, char* why, size_t why_len) {
  GpuTime& g = g_gpus[gpu];
  const TenantState& tenant = tenant_of(gpu);
  char path[1100];
  snprintf(path, sizeof path, "%s/gputime-%u", tenant.dir, entry_of(gpu));
  char err[512] = {};
  const ledger::GpuEntry policy = gpu_policy(gpu);
  Arbiter arbiter;
  // Read-only: the daemon alone writes it (and the file is 0644).
  ledger::LedgerError e = gputime::open_arbiter(path, false, true, policy.uuid, &arbiter, err, sizeof err);
  if (e == ledger::LedgerError::kMissing) {
    // The daemon links every granted GPU's arbiter into the tenant's
    // directory; none there is an older daemon, or one that could not set
    // it up (its log says so). Nothing schedules this GPU's time.
    snprintf(why, why_len,
             "no GPU-time arbiter (%s): fracgpud does not schedule this GPU's time (an older daemon, or one that "
             "could not set the arbiter up: see its log); launches on it run ungoverned, memory quotas still hold",
             path);
    return kUnmetered;
  }
  if (e != ledger::LedgerError::kOk) {
    snprintf(why, why_len, "GPU-time arbiter refused (%s): %s", ledger::ledger_error_name(e), err);
    return kRefused;
  }
  const int row = gputime::find_tenant(*arbiter.seg, tenant.ledger.policy->tenant);
  if (row < 0) {
    // The daemon gives every tenant granted the GPU a row, unless its table
    // is full: a tenant without one is one it cannot schedule.
    snprintf(why, why_len, "%s does not list tenant \"%s\": fracgpud cannot schedule its time on this GPU", path,
             tenant.ledger.policy->tenant);
    gputime::close_arbiter(&arbiter);
    return kRefused;
  }
  g.arbiter = arbiter;
  g.row = static_cast<uint32_t>(row);
  g.request = &tenant.ledger.usage->gputime[entry_of(gpu)][tenant.slot];
  publish_context_count(g, g.context_count.load(std::memory_order_acquire));
  // Nothing asked, nothing entered yet (claim_slot cleared the row; a
  // process re-opening its GPU entries clears what it said before).
  g.request->want_since_ns.store(0, std::memory_order_relaxed);
  g.request->entered_grant.store(0, std::memory_order_relaxed);
  g.request->drained_grant.store(0, std::memory_order_relaxed);
  return kReady;
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
  // The parent's grants, requests and pacer are the parent's; the child
  // starts over on its first launch, in a ledger slot of its own. Its
  // inherited mappings are closed.
  for (GpuTime& g : g_gpus) {
    if (g.status.load(std::memory_order_relaxed) == kReady) gputime::close_arbiter(&g.arbiter);
    g.status.store(kUnknown, std::memory_order_relaxed);
    g.request = nullptr;
    g.metered.store(false, std::memory_order_relaxed);
    g.open.store(false, std::memory_order_relaxed);
    g.entered.store(0, std::memory_order_relaxed);
    g.unshared.store(false, std::memory_order_relaxed);
    g.dead_since.store(0, std::memory_order_relaxed);
    g.waiting.store(0, std::memory_order_relaxed);
    g.accounted_ns = 0;
    g.retry_ns = 0;
    pthread_mutex_init(&g.transition, nullptr);
    g.context_count.store(0, std::memory_order_relaxed);
    g.pacer.reset_after_fork();
    g.idle_since = 0;
    g.hold_ns = kFirstHoldNs;
    g.released_ns = 0;
  }
  pthread_mutex_init(&g_setup_lock, nullptr);
  pthread_mutex_init(&g_context_lock, nullptr);
  g_pacer_started.store(false, std::memory_order_relaxed);
  g_pacer_resting.store(false, std::memory_order_relaxed);
  g_launched.store(false, std::memory_order_relaxed);
  g_launch_gate.store(kGateUnset, std::memory_order_release);
}

// The entry's status, setting it up on first use, and looking again (at most
// every kRefusedRetryNs) while it is refused: the daemon may give the tenant
// a row, or repair its arbiter.
int ensure_gpu(int gpu) {
  GpuTime& g = g_gpus[gpu];
  const int status = g.status.load(std::memory_order_acquire);
  if (status != kUnknown && status != kRefused) [[likely]]
    return status;
  if (status == kRefused && pthread_mutex_trylock(&g_setup_lock) != 0) return kRefused;
  if (status == kUnknown) pthread_mutex_lock(&g_setup_lock);
  const int before = g.status.load(std::memory_order_relaxed);
  const uint64_t now = gputime::monotonic_ns();
  if (before == kUnknown || (before == kRefused && now >= g.retry_ns)) {
    if (!g_atfork_done.exchange(true)) pthread_atfork(nullptr, nullptr, on_fork_child);
    char why[1400] = {};
    int opened = open_gpu(gpu, why, sizeof why);
    // The daemon links a tenant's arbiter a moment before it gives the
    // tenant its row, and rewrites a damaged header within a pass: a first
    // refusal is looked at again for a while before it stands.
    for (int again = 0; opened == kRefused && before == kUnknown && again < kFirstRefusalRetries; ++again) {
      struct timespec pause {0, static_cast<long>(kFirstRefusalPauseNs)};
      nanosleep(&pause, nullptr);
      opened = open_gpu(gpu, why, sizeof why);
    }
    const unsigned entry = entry_of(gpu);
    const char* tenant = tenant_of(gpu).ledger.policy->tenant;
    if (opened == kReady) {
      g.metered.store(compute_metered(gpu), std::memory_order_relaxed);
      g.status.store(kReady, std::memory_order_release);
      start_pacer();
      if (before == kRefused) {
        log_line(LogLevel::kInfo, "GPU entry %u of tenant \"%s\": fracgpud schedules its time now: launches allowed",
                 entry, tenant);
        refresh_gate();
      }
    } else if (opened == kRefused) {
      g.retry_ns = now + kRefusedRetryNs;
      if (before == kUnknown) {
        // Never let through: a tenant the scheduler cannot schedule would
        // take the GPU's time from those it does.
        log_line(LogLevel::kError,
                 "GPU entry %u of tenant \"%s\": kernel launches refused (CUDA_ERROR_NOT_PERMITTED): %s", entry,
                 tenant, why);
        g.status.store(kRefused, std::memory_order_release);
        refresh_gate();
      }
    } else {
      log_line(LogLevel::kWarn, "GPU entry %u of tenant \"%s\": %s", entry, tenant, why);
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

// Blocks until this process may launch on the GPU: its tenant holds it and
// the process entered the grant, or the GPU runs unshared (the daemon is
// down), or it is no longer metered.
void wait_for_turn(int gpu) {
  GpuTime& g = g_gpus[gpu];
  const GpuTimeSegment& seg = *g.arbiter.seg;
  g.waiting.fetch_add(1, std::memory_order_acq_rel);
  uint64_t rang_ns = 0;  // when this thread last rang the doorbell; 0: it has not
  uint64_t restated_ns = gputime::monotonic_ns();
  for (;;) {
    if (g.open.load(std::memory_order_acquire) || !g.metered.load(std::memory_order_acquire)) break;
    // Read before the grant: a change after this read ends the sleep below.
    const uint32_t turn = seg.grant.turn.load(std::memory_order_acquire);
    const uint64_t now = gputime::monotonic_ns();
    g.request->poll_ns.store(now, std::memory_order_relaxed);  // still asking
    const bool alive = !daemon_down(g, now);
    const uint64_t word = seg.tenants[g.row].grant.load(std::memory_order_seq_cst);  // our tenant's own
    if (!alive || g.unshared.load(std::memory_order_acquire) ||
        (granted_to_us(g, word) && g.entered.load(std::memory_order_acquire) == 0)) {
      // A transition: the pacer may be at one (a drain); then look again soon.
      if (pthread_mutex_trylock(&g.transition) == 0) {
        if (!alive) {
          go_unshared_locked(gpu);
        } else {
          back_to_shared_locked(gpu);
          if (granted_to_us(g, word)) enter_locked(g, word);
        }
        pthread_mutex_unlock(&g.transition);
        continue;
      }
    } else if (g.request->want_since_ns.load(std::memory_order_relaxed) == 0) {
      // Ask: the first waiter of the process says since when, and wakes the
      // daemon (the doorbell's value never changes: only the wake matters).
      g.request->want_since_ns.store(now, std::memory_order_seq_cst);
      gputime::ring_doorbell(seg);
      rang_ns = gputime::monotonic_ns();
    } else if (rang_ns != 0 && seg.daemon.daemon_heartbeat_ns.load(std::memory_order_acquire) < rang_ns) {
      // Still waiting a slice later, and no pass has begun since we rang:
      // the daemon may have been between a pass and its sleep then, and
      // missed the wake. A pass that began after the ring read our want
      // (it reads the requests after taking its time), so once one has,
      // ringing again only costs the daemon a wake-up.
      gputime::ring_doorbell(seg);
      rang_ns = gputime::monotonic_ns();
    }
    if (now - restated_ns >= kRestateNs && pthread_mutex_trylock(&g.transition) == 0) {
      if (g.entered.load(std::memory_order_relaxed) == 0) restate_nothing_entered_locked(g);
      pthread_mutex_unlock(&g.transition);
      restated_ns = now;
    }
    gputime::wait_for_turn(seg, turn, kWaitSliceNs);
  }
  // The last waiter out withdraws the process's request unless the gate is
  // open (metering was switched off meanwhile).
  if (g.waiting.fetch_sub(1, std::memory_order_acq_rel) == 1 && !g.open.load(std::memory_order_acquire))
    g.request->want_since_ns.store(0, std::memory_order_release);
}

// One pacer step for a metered GPU: follows the daemon (down: unshared;
// back: ask again), leaves a grant that was revoked or moved on, and while
// it holds one, reports when the process last launched. True if the GPU
// needs the pacer's short tick.
bool pace_gpu(int gpu, uint64_t now) {
  GpuTime& g = g_gpus[gpu];
  const GpuTimeSegment& seg = *g.arbiter.seg;
  const bool alive = !daemon_down(g, now);
  if (alive == g.unshared.load(std::memory_order_acquire)) {
    pthread_mutex_lock(&g.transition);
    if (alive)
      back_to_shared_locked(gpu);
    else
      go_unshared_locked(gpu);
    pthread_mutex_unlock(&g.transition);
  }
  if (!alive) return false;
  const uint64_t entered = g.entered.load(std::memory_order_acquire);
  const uint64_t word = seg.tenants[g.row].grant.load(std::memory_order_seq_cst);  // our tenant's own
  if (entered != 0 && !(granted_to_us(g, word) && gputime::grant_seq(word) == entered)) {
    // Revoked, or over (a deadline passed, a new daemon): close, drain, say so.
    pthread_mutex_lock(&g.transition);
    leave_locked(g, true);
    pthread_mutex_unlock(&g.transition);
  } else if (entered != 0) {
    const bool active = g.activity.exchange(0, std::memory_order_acq_rel) != 0 ||
                        g.waiting.load(std::memory_order_acquire) > 0 ||
                        g_threads_in_sync.load(std::memory_order_relaxed) > 0;
    if (active) g.request->last_active_ns.store(now, std::memory_order_release);
    // A latency tenant holds the GPU only while it uses it: idle for its
    // hold time, it gives the grant back (after draining, so what it queued
    // is its own), and the daemon hands the GPU on at once.
    if (latency_tenant(g)) {
      if (active) {
        g.idle_since = 0;
      } else {
        if (g.idle_since == 0) g.idle_since = now;
        pthread_mutex_lock(&g.transition);
        const uint64_t hold =
            g_unsynced.load(std::memory_order_relaxed) ? std::max(g.hold_ns, kUnsyncedHoldNs) : g.hold_ns;
        const bool release = now - g.idle_since >= hold && g.entered.load(std::memory_order_relaxed) == entered;
        if (release) {
          leave_locked(g, true);
          g_unsynced.store(false, std::memory_order_relaxed);  // drained: nothing of ours is queued
          g.released_ns = gputime::monotonic_ns();
          g.idle_since = 0;
        }
        pthread_mutex_unlock(&g.transition);
        if (release) return false;
      }
    }
    if (pthread_mutex_trylock(&g.transition) == 0) {
      account_used(g, now);
      pthread_mutex_unlock(&g.transition);
    }
    return true;
  } else if (g.waiting.load(std::memory_order_acquire) > 0) {
    g.request->poll_ns.store(now, std::memory_order_relaxed);  // still asking
    if (granted_to_us(g, word)) {
      // Granted while no waiting thread was awake to enter: enter for them.
      pthread_mutex_lock(&g.transition);
      enter_locked(g, word);
      pthread_mutex_unlock(&g.transition);
    }
  }
  return g.waiting.load(std::memory_order_acquire) > 0;
}

void* pacer_main(void*) {
  // Our sleeps are short (a latency tenant's pacer ticks every 40 us): the
  // default 50 us of timer slack would more than double them. This thread's
  // own setting; the user's threads keep theirs.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  // Graph capture in global mode forbids unsafe calls from every thread;
  // this thread's own mode is relaxed, so draining cannot break a capture.
  if (load_real_driver() && g_driver.cuThreadExchangeStreamCaptureMode != nullptr) {
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    g_driver.cuThreadExchangeStreamCaptureMode(&mode);
  }
  uint64_t next_refresh = 0;
  uint64_t last_launch = gputime::monotonic_ns();  // or grant held, or thread waiting
  for (;;) {
    // Read before looking at the GPUs: a kick after this (a grant entered by
    // a launching thread, a synchronization's return) ends the sleep below.
    const uint32_t kick = g_pacer_kick.load(std::memory_order_acquire);
    const uint64_t now = gputime::monotonic_ns();
    bool busy = false;
    const bool refresh = now >= next_refresh;
    if (refresh) next_refresh = now + kQuietTickNs;
    bool metering_changed = false;
    // The futex to sleep on: the turn of the first GPU whose grant we
    // entered, read before its grant, so that a revocation wakes us at once
    // rather than at the tick.
    const GpuTimeSegment* sleep_on = nullptr;
    uint32_t sleep_turn = 0;
    bool latency_grant = false;  // a latency tenant's grant entered: look again soon, to give it back
    for (int gpu = 0; gpu < kMaxTenantGpus; ++gpu) {
      GpuTime& g = g_gpus[gpu];
      if (g.status.load(std::memory_order_acquire) != kReady) continue;
      if (refresh) {
        // Shares, limits and the set of tenants change on reload.
        const bool metered = compute_metered(gpu);
        if (metered != g.metered.load(std::memory_order_relaxed)) {
          g.metered.store(metered, std::memory_order_release);
          metering_changed = true;
          if (!metered) {
            pthread_mutex_lock(&g.transition);
            leave_locked(g, false);
            g.unshared.store(false, std::memory_order_release);
            pthread_mutex_unlock(&g.transition);
          }
        }
      }
      if (!g.metered.load(std::memory_order_relaxed)) continue;
      const uint32_t turn = g.arbiter.seg->grant.turn.load(std::memory_order_acquire);
      if (pace_gpu(gpu, gputime::monotonic_ns())) {
        busy = true;
        const bool entered = g.entered.load(std::memory_order_relaxed) != 0;
        latency_grant |= entered && latency_tenant(g);
        if (entered && sleep_on == nullptr) {
          sleep_on = g.arbiter.seg;
          sleep_turn = turn;
        }
      }
    }
    if (metering_changed) refresh_gate();
    // Each tick ends every thread's pass: the next launch shows it is active.
    if (busy) bump_gate();
    g_latency_held.store(latency_grant, std::memory_order_relaxed);
    if (busy || g_launched.exchange(false, std::memory_order_acq_rel)) last_launch = now;
    if (sleep_on != nullptr && !latency_grant) {
      gputime::wait_for_turn(*sleep_on, sleep_turn, kTickNs);
    } else if (!busy && now - last_launch >= kRestAfterNs) {
      // Rest. The flag first, then the gate word: a thread whose pass
      // outlives the change read the word after it, and so finds the flag
      // set (wait_for_gpu wakes us on its way out).
      g_pacer_resting.store(true, std::memory_order_seq_cst);
      bump_gate();
      struct timespec ts {static_cast<time_t>(kRestTickNs / 1'000'000'000), static_cast<long>(kRestTickNs % 1'000'000'000)};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&g_pacer_kick), FUTEX_WAIT_PRIVATE, kick, &ts, nullptr, 0);
      g_pacer_resting.store(false, std::memory_order_relaxed);
      next_refresh = 0;  // what changed while we rested, the launch that woke us must see
    } else {
      // On our own futex, so that a kick (kick_pacer: a grant entered, a
      // synchronization's return) wakes us. Holding a latency tenant's
      // grant: short ticks, and a revocation is seen at the next one. Only
      // waiting for a grant: the threads that wait ask, renew their asking
      // and enter by themselves, and the grant they enter kicks us; our
      // tick (as long as theirs) is a fallback.
      const uint64_t tick = latency_grant ? kLatencyTickNs : busy ? kWaitSliceNs : kQuietTickNs;
      struct timespec ts {0, static_cast<long>(tick)};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&g_pacer_kick), FUTEX_WAIT_PRIVATE, kick, &ts, nullptr, 0);
    }
  }
  return nullptr;
}

// At exit the driver abandons our work: report every grant entered as
// drained (no drain needed), so the daemon can hand the GPU on at once.
__attribute__((destructor)) void release_on_exit() {
  for (GpuTime& g : g_gpus) {
    if (g.status.load(std::memory_order_acquire) != kReady) continue;
    if (pthread_mutex_trylock(&g.transition) != 0) continue;  // the pacer is draining: the daemon sees us die
    g.request->want_since_ns.store(0, std::memory_order_seq_cst);
    leave_locked(g, false);
    pthread_mutex_unlock(&g.transition);
  }
}

}  // namespace

namespace {

// A resting pacer is woken by the first launch: on the way in (it must
// follow a grant, reloads, the daemon) and on the way out, where a pass
// made from the gate word the pacer changed when it went to rest finds the
// flag it set before.
void wake_resting_pacer() {
  if (g_pacer_resting.load(std::memory_order_seq_cst) && g_pacer_resting.exchange(false, std::memory_order_acq_rel))
    kick_pacer();
}

struct WakeRestingPacerOnExit {
  ~WakeRestingPacerOnExit() { wake_resting_pacer(); }
};

}  // namespace

CUresult wait_for_gpu(CUstream stream, bool* paced, const void* kernel) {
  if (!load_real_driver() || tenant_mode() != TenantMode::kManaged) {
    g_launch_gate.store(0, std::memory_order_release);  // nothing is metered in this process
    t_launch_pass = 0;
    return CUDA_SUCCESS;
  }
  if (!g_launched.load(std::memory_order_relaxed)) g_launched.store(true, std::memory_order_relaxed);
  wake_resting_pacer();
  const WakeRestingPacerOnExit wake_on_exit;
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
  if (!current_gpu_entry(&ctx, &device, &gpu)) return CUDA_SUCCESS;  // the driver reports it
  // Not granted: the memory hooks refused its context; two tenants grant it: refused.
  if (gpu < 0) return device_denied(device) ? CUDA_ERROR_NOT_PERMITTED : CUDA_SUCCESS;
  const int status = ensure_gpu(gpu);
  if (status == kRefused) {
    t_launch_pass = ~0ull;  // every launch comes back here
    return CUDA_ERROR_NOT_PERMITTED;
  }
  if (status != kReady) {
    t_launch_pass = gate;
    return CUDA_SUCCESS;
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
    return CUDA_SUCCESS;
  }
  if (g_launch_gate.load(std::memory_order_acquire) == 0) refresh_gate();
  note_context(g, ctx, device);
  bool pacing = false;
  for (;;) {
    if (!g.open.load(std::memory_order_acquire)) {
      // Work captured into a graph does not run now; blocking would only stall
      // the capture. It is governed when the graph is launched.
      if (stream_is_capturing(stream)) return CUDA_SUCCESS;
      wait_for_turn(gpu);
    }
    // A latency tenant is active on this GPU: keep our queue short (every
    // launch comes back here while it is). The gate may close while we
    // wait for room: then wait for the GPU again.
    const uint64_t budget = paced != nullptr && g.metered.load(std::memory_order_acquire) ? pace_budget(g) : 0;
    if (budget == 0 || stream_is_capturing(stream)) break;
    // The budget is the tenant's, over all its processes: their launches
    // reserve on one word of its usage file.
    ledger::UsageSegment* usage = tenant_of(gpu).ledger.usage;
    const LaunchPacer::TenantQueue queue{usage != nullptr ? &usage->pace_end_us[entry_of(gpu)] : nullptr,
                                         usage != nullptr ? &usage->pace_strict_until_ms : nullptr};
    const bool reserved = g.pacer.wait_for_room(budget, ctx, stream, kernel, queue, g.open);
    pacing = true;
    if (reserved || g.open.load(std::memory_order_acquire) || !g.metered.load(std::memory_order_acquire)) break;
  }
  if (pacing) {
    *paced = true;
    t_paced_gpu = gpu;
    t_paced_ctx = ctx;
    t_paced_kernel = kernel;
  }
  g.activity.fetch_add(1, std::memory_order_relaxed);
  if (latency_tenant(g)) g_unsynced.store(true, std::memory_order_relaxed);
  // Pass until the pacer's next tick. The word is read *before* `open`: the
  // pacer closes `open`, then changes the word, so either this read of the
  // word precedes the change (the pass is stale at once) or the read of
  // `open` below sees it closed. Read the other way round, a close and
  // change between the two reads would leave a pass that matches the new
  // word: a thread launching ungoverned until the word changes again, which
  // may be never once its process neither holds nor waits for the GPU.
  const uint64_t word = g_launch_gate.load(std::memory_order_acquire);
  t_launch_pass = g.open.load(std::memory_order_acquire) && !pacing ? word : ~0ull;
  return CUDA_SUCCESS;
}

void kick_pacer() {
  g_pacer_kick.fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&g_pacer_kick), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

void paced_launch_done(CUstream stream) {
  const int gpu = std::exchange(t_paced_gpu, -1);
  if (gpu < 0 || gpu >= kMaxTenantGpus) return;
  g_gpus[gpu].pacer.launched(std::exchange(t_paced_ctx, nullptr), stream, std::exchange(t_paced_kernel, nullptr));
}

CUresult wait_for_gpu_of_stream(CUstream stream) {
  CUcontext ctx = nullptr;
  if (stream == nullptr || g_driver.cuStreamGetCtx == nullptr || g_driver.cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS ||
      g_driver.cuCtxPushCurrent_v2 == nullptr || g_driver.cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS)
    return wait_for_gpu(stream);
  const CUresult result = wait_for_gpu(stream);
  CUcontext popped = nullptr;
  g_driver.cuCtxPopCurrent_v2(&popped);
  invalidate_launch_pass();
  return result;
}

void gputime_forget_context(CUcontext ctx) {
  forget_contexts([ctx](CUcontext c, CUdevice) { return c == ctx; });
  for (GpuTime& g : g_gpus) g.pacer.forget(ctx);
}

void gputime_forget_device(CUdevice device) {
  forget_contexts([device](CUcontext, CUdevice d) { return d == device; });
  for (GpuTime& g : g_gpus) g.pacer.forget(nullptr);
}

}  // namespace fracgpu::interpose

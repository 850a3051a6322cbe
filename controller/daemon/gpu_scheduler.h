// fracgpud's GPU-time scheduler: one per managed GPU, the only writer of that
// GPU's arbiter file (include/fracgpu/gputime_layout.h; policy and protocol
// in docs/sm-time.md).
//
// Each pass it reads what the tenants sharing the GPU ask for (the
// GpuTimeRequest rows of their usage files, which their processes write and
// which are therefore claims: clamped, checked against the current grant,
// and bounded in effect to the tenant that wrote them), grants the GPU,
// charges tenants, and takes grants back with a drain handshake that has a
// deadline. Two modes (gputime::ChargeMode):
//  - measured (a UsageMeter is set and answers): tenants are charged the GPU
//    time the driver measured for their processes, or, while one holds the
//    GPU alone and another waits, the time nobody else used (whichever is
//    more); several tenants hold the GPU at once while the GPU has room
//    (measured busy below kRoomBusyPpm), and a tenant whose virtual time
//    runs more than lead() of GPU time ahead is revoked and benched; a
//    revoked tenant's successor is granted at once, without waiting for
//    its drain; limits and leads are no finer than the meter's sampling
//    period (burst(), lead());
//  - held (no meter): one holder at a time, charged the time it holds the
//    GPU, the next granted once the holder drained; where a meter audits
//    it, tenants whose turns leave room may hold it side by side
//    (step_side_by_side()). It runs on a
// thread of its own, asleep on the arbiter's doorbell futex between passes
// (1 ms while someone holds or waits, kIdlePassNs otherwise, kQuietPassNs
// once the GPU has gone unused for a second); tenant
// processes ring the doorbell, which can only make it run a pass sooner,
// never more than once per kMinPassIntervalNs.
//
// The daemon's main thread talks to it through configure() (after every
// config apply), sample_achieved() (every tick) and take_messages(): the
// scheduler thread never logs itself, so nothing it holds can be held in
// the metrics child the main thread forks.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bitset>
#include <map>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/types.h>

#include "daemon/gpu_meter.h"
#include "gputime.h"
#include "ledger.h"

namespace fracgpu::controller {

// A tenant with a share of this GPU, as the config and the daemon's open
// ledgers say.
struct SchedulerTenant {
  std::string name;
  uint32_t share_ppm = 0;
  uint32_t limit_ppm = 0;
  int usage_fd = -1;  // the tenant ledger's usage file; borrowed (the scheduler keeps a dup); -1: none
  int entry = -1;     // this GPU's entry in the tenant's policy; -1: none
  uint32_t priority = gputime::kPriorityNormal;  // gputime::TenantPriority
};

struct SchedulerMessage {
  bool warning = false;  // else info
  std::string text;
};

class GpuScheduler {
 public:
  static constexpr uint64_t kBusyPassNs = 1'000'000;         // between passes while someone holds or waits
  // ... but with one holder, uncapped, that nobody waits for (held
  // charging, no drain under way or overdue): what a pass must act on at
  // once then comes with a doorbell (another tenant asks, the holder gives
  // the GPU back), and the holder's idle limit is kLoneIdleNs. A GPU
  // running the work of one tenant that may use all of it (limit = 1.0)
  // then costs 200 wake-ups a second instead of 1,000.
  static constexpr uint64_t kLonePassNs = 5'000'000;
  static constexpr uint64_t kIdlePassNs = 20'000'000;        // ... otherwise
  // ... and once nobody has asked, held or (by the meter) used the GPU for
  // kQuietAfterNs: then only a doorbell can bring work, and the heartbeat
  // (kDaemonDownNs) is all a pass must keep fresh.
  static constexpr uint64_t kQuietPassNs = 100'000'000;
  static constexpr uint64_t kQuietAfterNs = 1'000'000'000;
  static constexpr uint64_t kMinPassIntervalNs = 100'000;    // doorbells cannot make passes more frequent
  // Measured mode.
  static constexpr uint64_t kMeterIntervalNs = 2'000'000;    // between meter readings
  static constexpr uint64_t kMeterStaleNs = 200'000'000;     // no good reading this long: held mode
  static constexpr uint64_t kRoomWindowNs = 10'000'000;      // busy measured over this long before sharing
  static constexpr uint32_t kRoomBusyPpm = 900'000;          // GPU busy below this: room for another tenant
  static constexpr uint64_t kLeadNs = 50'000'000;            // GPU time a tenant may run ahead of its share
  static constexpr uint64_t kBenchNs = 100'000'000;          // how long a tenant revoked for its lead stays off
  static constexpr uint64_t kUnattributedKeepNs = 1'000'000'000;  // usage of a PID not yet known to be a tenant's
  // Held mode's audit: a grant this close to a sample's instant counts as
  // held then; a meter sampling more often than this covers a period, not
  // an instant (real drivers sample every ~1/6 s to 1 s).
  static constexpr uint64_t kAuditMarginNs = 200'000;
  static constexpr uint64_t kAuditInstantPeriodNs = 20'000'000;
  // ... and audits nothing this soon after its start or a configuration
  // change: processes see a new daemon, or that their GPU became shared,
  // within a few pacer ticks, and until then run ungated in good faith.
  static constexpr uint64_t kAuditGraceNs = 200'000'000;
  // A tenant whose process outside the gate a sample found at work gives
  // way to every tenant that asks, for this many sampling periods after the
  // last such sample (at least kOutsideYieldMinNs): docs/sm-time.md, "A
  // process outside the gate costs its tenant its turns".
  static constexpr uint64_t kOutsideYieldPeriods = 8;
  static constexpr uint64_t kOutsideYieldMinNs = 500'000'000;
  // ... and is granted a free GPU only once no other tenant has held or
  // asked for this long: a holder between two of its launches hands the
  // GPU back for a moment, and a grant then would make it wait for the
  // yielding tenant's queued work.
  static constexpr uint64_t kYieldGapNs = 20'000'000;
  // A tenant the audit credited within this many sampling periods has its
  // limit's burst widened to kOutsideYieldPeriods periods (burst()). Longer
  // than the burst: credits come when a sample happens to name the other's
  // work, about every other sample beside a saturating bypass, so within 8
  // periods they can miss (1 in 256 windows), and the holder, ahead by the
  // wide burst, would be revoked at once.
  static constexpr uint64_t kCreditBurstPeriods = 32;
  // A tenant that missed a drain deadline pays for its late work's part of
  // the others' grants (charge()) until it reports the drain, for at most
  // this long, or two sampling periods where those are longer: work that
  // runs on longer than a period is found by the audit's samples, which
  // take over from then on.
  static constexpr uint64_t kOverdueChargeMaxNs = 1'000'000'000;
  // Other tenants are paced (gputime::DaemonSection::pace_inflight_ns) while
  // a latency tenant has a live process, or asked or held the GPU, this
  // recently ...
  static constexpr uint64_t kLatencyActiveNs = 2'000'000'000;
  // ... or was configured this recently (created, given the priority, or
  // found at the daemon's start) and has not yet had a process: in a
  // cluster its container starts seconds after its claim is prepared, and
  // by then the others' queues have drained, instead of standing ahead of
  // its first requests.
  static constexpr uint64_t kLatencyArrivalNs = 60'000'000'000;
  // ... to keep at most this much GPU time queued (one launch at least).
  static constexpr uint64_t kPaceInflightNs = 1'000'000;
  // Side by side: tenants taking turns whose GPU is busy below this over
  // whole sampling periods (the driver's own figure) leave room ...
  static constexpr uint32_t kSideRoomPpm = 900'000;
  // ... and hold it side by side for this many sampling periods (at least
  // kMinSidePhaseNs); then they take turns again for two whole periods
  // (after one that mixes in what went before), to see whether they still
  // leave room. Each phase that follows a measure finding room again, with
  // no tenant changing, is twice as long as the one before, up to four
  // times the first or kMaxSidePhaseNs, whichever is less (never less than
  // the first): the measuring turns cost a launch-bound pair a quarter of
  // its GPU time, and tenants that stay light need them less often.
  // A measure that finds no room still sends the tenants back side by side
  // unless their turns keep the GPU busier than the phase before did by
  // more than this (a light tenant beside one that floods: the driver gives
  // the light one's idle moments to the other at once, turns cannot; two
  // that fill their turns lose a few points to the driver's switches).
  static constexpr int64_t kSideGainPpm = 20'000;
  static constexpr uint64_t kSidePhasePeriods = 20;
  static constexpr uint64_t kMinSidePhaseNs = 4'000'000'000;
  static constexpr uint64_t kMaxSidePhaseNs = 16'000'000'000;
  // Side by side must leave each tenant no less of the GPU than it used in
  // the turns before (check_side_shares() says how that is bounded). A
  // tenant named by the driver's samples side by side in fewer than that
  // less kSideShortfallPpm (its idle moments inside its turns), beyond
  // kSideShortfallSigmas standard deviations over kSideShortfallMinSamples
  // samples at least, is kept off its turns by another (one that set its
  // own contexts' time slice longer than the driver's: docs/sm-time.md,
  // "A tenant that lengthens its own slice"); the tenants named more than
  // their part take turns for kSideBarNs. One barred again within
  // kSideBarMemoryNs of its last bar's end takes turns twice as long as it
  // did then, up to kSideBarMaxNs: each time it shares again it takes what
  // it takes until it is found (seconds to tens of seconds), so a tenant
  // that does it again and again must do it ever more seldom.
  static constexpr uint32_t kSideShortfallPpm = 100'000;
  static constexpr double kSideShortfallSigmas = 3.0;
  static constexpr uint32_t kSideShortfallMinSamples = 20;
  // The counts keep about this many samples (check_side_shares()): enough
  // to find a tenant kept 0.05 below its least share (three standard
  // deviations; a slice twice the driver's keeps the other 0.07 below),
  // few enough that a long fair record hides a flood for about half of them.
  static constexpr double kSideSamplesKept = 1000;
  static constexpr uint64_t kSideBarNs = 600'000'000'000;
  static constexpr uint64_t kSideBarMaxNs = 8 * kSideBarNs;
  static constexpr uint64_t kSideBarMemoryNs = 3'600'000'000'000;
  // A tenant so barred has this long to drain a revoked grant before the
  // next holder is granted beside its queue (drain_deadline()).
  static constexpr uint64_t kBarredDrainDeadlineNs = 1'000'000'000;
  // Turns are measured while at least two tenants ask; alone longer than
  // this, the measure starts afresh.
  static constexpr uint64_t kAloneResetNs = 100'000'000;

  // `seg`: the arbiter, mapped read-write, for the GPU with this UUID.
  GpuScheduler(gputime::GpuTimeSegment& seg, const uint8_t uuid[16], std::string label);
  ~GpuScheduler();
  GpuScheduler(const GpuScheduler&) = delete;
  GpuScheduler& operator=(const GpuScheduler&) = delete;

  // Takes over what the file holds from an earlier daemon (virtual times
  // and statistics, each validated: the file may be from an older run or
  // damaged), and starts with no holder under a grant number above every
  // earlier one. Call once, before anything else.
  void adopt(uint64_t now);
  // The tenants with a share of this GPU now; rows of others are retired,
  // and the rows of tenants that are gone (neither listed nor named in
  // `in_use`: the daemon's tenants that still have live processes) are
  // freed for new tenants, so tenants that come and go never exhaust the
  // file's kMaxTenants rows.
  void configure(const std::vector<SchedulerTenant>& tenants, uint64_t slice_ns,
                 const std::set<std::string>& in_use = {});
  // The meter that measured mode charges by (nullptr: held mode). The
  // scheduler owns it and calls it on its own thread.
  void set_meter(std::unique_ptr<UsageMeter> meter);
  bool has_meter();
  // How tenants are charged when the meter answers: the time they hold the
  // GPU, audited by the meter's samples (false, the default), or the GPU
  // time the meter attributes to them (true). docs/sm-time.md.
  void set_measured_charging(bool measured);
  // Side by side (held charging only; docs/sm-time.md, "Side by side"):
  // whether it is allowed (the `side_by_side` key), and whether this GPU's
  // driver time-slices contexts (compute preemption: compute capability 6.0
  // and later), which it needs. Both false until set.
  void set_side_by_side(bool allowed, bool driver_time_slices);
  // Tenants with a process the daemon found on a GPU outside the gate (no
  // interposer): such a tenant never holds the GPU side by side.
  void set_outside_tenants(const std::set<std::string>& tenants);
  // The processes outside the gate that NVML lists on this GPU now, by
  // tenant, in thousandths (a process of a container with several claims
  // on the GPU counts a part to each). While a tenant has such a process,
  // every other holder pays only its contexts' part of its grants, and that
  // tenant the rest (held charging; docs/sm-time.md, "A process outside the
  // gate pays for its turns").
  void set_listed_outside(const std::map<std::string, uint32_t>& milli_by_tenant);
  // PIDs the meter named that no tenant's list holds yet (at most 64): the
  // daemon finds out whose they are (a process without the interposer in a
  // tenant's container) and lists them in the next attribute().
  std::vector<uint32_t> unattributed_pids();
  // The host PIDs of every tenant's processes, by tenant name, as the daemon
  // verified them (never what a tenant wrote): whose measured GPU time is
  // whose. Replaces the earlier lists whole. `lifetimes`: for a PID that may
  // name another process at another time (a process outside the gate, kept
  // after it exited so that the samples naming it are still charged), the
  // span of sample instants that are its process's; a sample outside it is
  // nobody's known (a later process behind the reused PID, or an earlier one).
  struct PidLifetime {
    uint64_t from_ns = 0;   // CLOCK_MONOTONIC; the process's start, less a margin
    uint64_t until_ns = 0;  // when it was found gone, plus a margin; 0: alive
  };
  void attribute(const std::map<std::string, std::vector<uint32_t>>& pids_by_tenant,
                 const std::map<uint32_t, PidLifetime>& lifetimes = {});
  // The thread; stop() ends it and tells tenants the scheduler is gone
  // (heartbeat 0: their processes run unshared at once, not a second later).
  void start();
  void stop();

  // One scheduling pass at `now` (CLOCK_MONOTONIC). Returns how long the
  // thread may sleep before the next. Tests call it directly.
  uint64_t pass(uint64_t now);
  // True if some tenant asked, entered or reported a drain since the last
  // pass read its file: its doorbell may have rung while the pass ran (a
  // futex wake nobody waits for is lost), so the thread must not sleep
  // before the next pass.
  bool requests_changed();
  // Achieved shares over 1 s and 10 s from the GPU time charged, into the file.
  void sample_achieved(uint64_t now);
  std::vector<SchedulerMessage> take_messages();
  // Passes run so far (the thread's and pass()'s).
  uint64_t passes() const { return passes_.load(std::memory_order_relaxed); }
  // Record-lock probes (system calls) made so far.
  uint64_t probes() const { return probes_.load(std::memory_order_relaxed); }

 private:
  // What one slot of a tenant's usage file said at the last observation.
  struct SlotView {
    bool live = false;  // its state word says so (a claim; liveness is the record lock)
    uint64_t want = 0, poll = 0, active = 0, entered = 0, drained = 0, contexts = 0;
  };
  struct Row {
    bool bound = false;   // the file has this row (by name)
    bool active = false;  // configured with a share now
    std::string name;
    uint32_t share = 0, limit = gputime::kPpm;
    uint32_t priority = gputime::kPriorityNormal;
    // Its share as a rate (GCRA arrival time, like the limit's at the share):
    // within it, its priority counts (docs/sm-time.md, "Latency tenants").
    uint64_t share_tat = 0;
    // Latency tenants: their last kWaitWindow waits for a grant (a ring) and
    // how many in all; the percentiles are published by sample_achieved().
    std::vector<uint64_t> waits;
    uint64_t wait_count = 0;
    // The tenant's usage file: our own descriptor and read-only mapping.
    int fd = -1;
    dev_t dev = 0;
    ino_t ino = 0;
    const ledger::UsageSegment* usage = nullptr;
    int entry = -1;
    // Scheduling state (authoritative here; published to the file).
    uint64_t vtime = 0, used = 0, throttled = 0, cap_tat = 0, slices = 0;
    uint64_t measured = 0, held = 0;  // GPU time measured, time held (totals)
    // Its grant (per tenant): state, sequence number, since when.
    uint32_t gstate = gputime::kGrantIdle;
    uint64_t gseq = 0, grant_ns = 0, revoke_ns = 0;
    // The limit's allowance accrued while it was kept off the GPU by others'
    // grants stays usable through its next grant: held mode credits it from
    // credit_from (the start of that wait, else the grant) on; measured mode
    // from that wait's length (grant_ns - credit_from) before each charge, so
    // that time it holds the GPU and leaves unused is not banked beyond the
    // burst.
    uint64_t credit_from = 0;
    uint64_t bench_until = 0;    // revoked for running ahead: not granted before, while others want
    uint64_t pending_use = 0;    // measured since the last reading, not yet charged
    // A tenant whose processes run ungated here (file_use()): the GPU time
    // the samples named its processes for since the last reading, and what
    // it is to be charged for that reading (read_meter()).
    uint64_t named_ungated = 0;
    uint64_t pending_ungated = 0;
    // Held mode's audit. The grants it held lately ([from, to), to 0 while
    // it holds), to tell whether it held the GPU at a sample's instant;
    // GPU time found used outside them, to be charged; and GPU time others
    // were found using during its grants, taken off its next held charges.
    struct Hold {
      uint64_t from = 0, to = 0;
    };
    std::array<Hold, 32> holds{};
    uint32_t hold_next = 0;
    // The latest hold (nullptr: none yet), and ending it now if still open.
    Hold* last_hold() { return hold_next > 0 ? &holds[(hold_next - 1) % holds.size()] : nullptr; }
    void end_last_hold(uint64_t now) {
      if (Hold* h = last_hold(); h != nullptr && h->to == 0) h->to = std::max(now, h->from + 1);
    }
    uint64_t pending_out_of_grant = 0, credit = 0;
    uint64_t credited_ns = 0;  // when the audit last gave it such time back (our clock; 0: never)
    uint64_t out_of_grant = 0, out_of_grant_samples = 0;
    uint64_t alone_ns = 0;       // held alone while another waited, since the last reading
    uint32_t missed_deadlines = 0;
    // Side by side: the contexts of the tenant's live processes using this
    // GPU (its slots' requests say so; one at least for each), and whether
    // the daemon found a process of it outside the gate.
    uint32_t gpu_contexts = 0;
    bool outside = false;
    // Side by side, what the driver's samples said of it against what it
    // used in the turns before (check_side_shares()): its time held when
    // those turns' measure began; what it used in them, as a share of the
    // GPU (ppm; at most its part); and over the phases, the samples naming
    // it and those taken while it shared. Until when it takes turns for
    // having been named more than its part while another was kept short
    // (0: never), and how long that bar was.
    uint64_t turns_held0 = 0;
    uint32_t side_least_ppm = 0;
    double side_named = 0, side_samples = 0;
    uint64_t side_barred_until = 0, side_bar_ns = 0;
    uint32_t listed_outside_milli = 0;  // set_listed_outside()
    // When a sample last found a process of it outside the gate at work
    // (our clock; 0: never), and when a yield of it was last logged.
    uint64_t outside_named_ns = 0, outside_logged_ns = 0;
    uint64_t kept_off_since = 0;  // first pass that saw it wait while another held (our clock)
    bool blocked = false;         // missed a drain deadline; waits for progress
    // Since when it pays for work left running past that deadline (our
    // clock; 0: not paying): its last hold stays open meanwhile.
    uint64_t overdue_since = 0;
    bool pays_late() const { return active && overdue_since != 0; }
    uint64_t blocked_seq = 0;
    std::bitset<ledger::kMaxSlots> missed;  // slots that had not drained blocked_seq
    // Slots seen to have entered its current grant: only a drain of that
    // grant ends their part in it (pending_drains).
    std::bitset<ledger::kMaxSlots> entered_seen;
    // Who held each such slot's record lock when it was seen to enter (the
    // kernel's PID for the lock, 0 if not probed then): another holder later
    // is a new owner of the slot, the one seen having died, and has nothing
    // of this grant queued unless its own words say it entered.
    std::array<int32_t, ledger::kMaxSlots> entered_holder{};
    // The last observation.
    bool readable = false;
    bool unreadable_reported = false;
    uint32_t high = 0;
    // The highest slot high-water mark seen in this file: the tenant writes
    // the mark, and lowering it must not hide a slot already seen in use.
    uint32_t high_mark = 0;
    std::array<SlotView, ledger::kMaxSlots> slots{};
    // What its processes had asked for and reported (wants, entries,
    // drains), folded into one word: a change found after a pass is a
    // doorbell the pass may have missed (requests_changed).
    uint64_t requests_seen = 0;
    bool wants = false;
    bool has_live = false;    // latency tenants: a live process (record lock held)
    uint64_t want_since = 0;  // earliest of its live wanting slots, clamped to our clock
    uint32_t waiting = 0;
    uint64_t last_active = 0;
    // Record-lock probes, cached, and how many more this pass may make
    // (by the time since the last pass observed the row: observed_ns).
    std::array<uint64_t, ledger::kMaxSlots> probed_ns{};
    std::bitset<ledger::kMaxSlots> alive;
    std::array<int32_t, ledger::kMaxSlots> holder{};  // the lock's holder at the probe (0: none)
    uint32_t probe_budget = 0;
    uint64_t observed_ns = 0;
    // The first slot a pass had no probe left for: loops over the slots
    // start there, so the budget goes round them all instead of always to
    // the first few.
    uint32_t probe_from = 0;
    bool probe_refused = false;
  };

  void release_usage(Row& r);
  void free_row(uint32_t t);
  bool slot_alive(Row& r, uint32_t s, uint64_t now);
  // Probes slot s's record lock now (if the pass has a probe left): its
  // holder's PID, 0 when free or not probed.
  int32_t probe_holder(Row& r, uint32_t s, uint64_t now);
  void observe(Row& r, uint64_t now);
  // The fold of a tenant's requests (Row::requests_seen) as its file says
  // now; false if it cannot be read.
  bool fold_requests(const Row& r, uint64_t* fold) const;
  // Slots of the holder that entered the current grant and have neither
  // drained it nor died.
  std::bitset<ledger::kMaxSlots> pending_drains(Row& r, uint64_t now);
  uint64_t effective_vtime(const Row& r) const;
  // The tenant's priority rank as it counts now (gputime::priority_rank):
  // one lower while it is beyond its share (a latency tenant counts as
  // normal, a normal one as batch).
  int effective_rank(uint32_t t, uint64_t now) const;
  // The tenant the holder would give way to at the end of its slice or
  // when it idles: best_candidate(), unless that one yields and the holder
  // does not (then -1: the holder keeps the GPU as if alone).
  int contender(uint64_t now, uint32_t holder);
  // Records a latency tenant's wait from asking to its grant.
  void note_wait(Row& r, uint64_t now);
  // Among tenants that ask and hold no grant: the one to grant next, or -1.
  int best_candidate(uint64_t now, int exclude);
  bool eligible(const Row& r, uint64_t now) const;
  bool measuring(uint64_t now) const;
  // The burst of a GCRA at `rate_ppm` (a limit, a share's priority) and the
  // lead measured fairness allows: no finer than the meter can see. Where
  // charges come as a sampling driver's samples (measured mode), one sample
  // charges a whole period to the process it caught: two periods' worth at
  // the rate, two periods of lead, else kLimitBurstNs and kLeadNs. `r`: the
  // tenant whose limit it is, whose audit credits widen it; null for a
  // share's burst (the audit's credits do not change priorities).
  uint64_t burst(const Row* r, uint32_t rate_ppm, uint64_t now) const;
  uint64_t lead(uint64_t now) const;
  // The meter's sampling period, taken for at most 1 s; 0 without a meter.
  uint64_t sample_period() const;
  // The time one meter sample may charge at once: the sampling period in
  // measured mode (at most 1 s), else 0.
  uint64_t charged_period(uint64_t now) const;
  bool auditing(uint64_t now) const;
  // Whether the row held a grant at `t`; *known false when `t` is older
  // than the grants it remembers.
  bool held_at(const Row& r, uint64_t t, bool* known) const;
  // Whether a tenant other than `t` held a grant between the end of t's
  // last grant before `at` and `at`.
  bool others_held_since_grant(uint32_t t, uint64_t at) const;
  // How much of a sample's `busy` (at `at`, covering the sampling period
  // before it) no tenant's grant in that period can account for; 0 when the
  // record does not reach back over the whole period.
  uint64_t busy_beyond_grants(uint64_t busy, uint64_t at) const;
  // Time some tenant held a grant on this GPU, summed from the first pass
  // up to `t` (interpolated between the passes recorded); false before the
  // oldest record.
  bool granted_time_until(uint64_t t, uint64_t* out) const;
  // Adds the pass's `dt` when some tenant held a grant through it.
  void record_granted(uint64_t now, uint64_t dt);
  // Files GPU time the meter found process(es) of row `t` using at `at`;
  // `outside_gate`: a process the daemon found outside the gate.
  void file_use(uint32_t t, uint64_t busy, uint64_t at, uint64_t now, bool outside_gate);
  // Whether the tenant gives way to every other that asks: a process of it
  // outside the gate was found at work lately (kOutsideYieldPeriods).
  bool yields(const Row& r, uint64_t now) const;
  bool room(uint64_t now) const;
  // Side by side: may the tenants that ask or hold now share the GPU
  // through the driver's time slices (`starting`: at least two of them)?
  bool side_by_side_fits(uint64_t now, bool starting) const;
  // The GPU time the meter found used by all processes over the whole
  // sampling periods of a phase (side by side, or turns) from `from` on,
  // and in how many samples.
  struct PhaseBusy {
    uint64_t from = 0, busy = 0, first_at = 0, last_at = 0;
    uint32_t samples = 0;
    void restart(uint64_t start) { *this = PhaseBusy{.from = start}; }
    void add(uint64_t at, uint64_t used);
  };
  // The time the meter's samples cover since the phase began: two whole
  // periods at least, or 0 (not measured yet).
  uint64_t covered(const PhaseBusy& phase, uint64_t now) const;
  // The phase's busy share of the GPU in ppm, or -1 if not measured yet.
  int64_t busy_ppm(const PhaseBusy& phase, uint64_t now) const;
  // Turns left room over the periods measured since they began.
  bool turns_leave_room(uint64_t now) const;
  // The turns keep the GPU no busier than the last side-by-side phase of
  // the same tenants did (within kSideGainPpm).
  bool turns_no_busier(uint64_t now) const;
  // Side by side: the least share of the samples each tenant should have
  // in the phase starting now, from the turns just measured.
  void set_side_least_shares(uint64_t now);
  // Side by side: counts a sample (naming `named_rows`, empty: no member)
  // against each member's least share; bars the members named more than
  // their part where another was named too seldom.
  void check_side_shares(const std::vector<uint32_t>& named_rows, uint64_t now);
  // The least share of the samples side by side the row should have
  // (check_side_shares()); 0 or less: none.
  static double least_side_share(const Row& r);
  void step_side_by_side(uint64_t now);
  void read_meter(uint64_t now);
  void charge(uint64_t now);
  // Charges `ns` of GPU time to the row; `contended`: another tenant wanted
  // or held the GPU meanwhile (see contended()).
  void charge_row(Row& r, uint64_t ns, uint64_t now, bool contended);
  // A tenant alone on this GPU with no limit below a whole one: its
  // processes run ungated (they decide so from the same two figures) and
  // never ask for a grant.
  bool gated(const Row& r) const;
  // GPU time the meter measured of an ungated tenant (file_use()).
  void charge_ungated(Row& r, uint64_t ns);
  // The row asks for the GPU (and is not blocked) or holds it.
  static bool contends(const Row& r);
  // How many rows contend.
  uint32_t contenders() const;
  // True if a tenant other than `self` asks for the GPU (and may be
  // granted) or holds it, as this pass saw them.
  bool contended(uint32_t self) const;
  void account_waits(uint64_t now);
  void check_blocked(Row& r, uint64_t now);
  // How long the row's processes have to drain a revoked grant.
  uint64_t drain_deadline(const Row& r, uint64_t now) const;
  void end_overdue(Row& r, uint64_t now);
  void step(uint64_t now);
  void step_row(uint32_t t, uint64_t now);
  void grant(uint32_t t, uint64_t now);
  void start_revoke(uint32_t t, uint64_t now);
  void complete_revoke(uint32_t t, uint64_t now, bool missed, const std::bitset<ledger::kMaxSlots>& pending);
  void end_grant(uint32_t t, uint64_t now);
  uint32_t holders(uint32_t state) const;
  void publish_grant(uint32_t t, bool change = true);
  void publish(uint64_t now);
  void note(bool warning, std::string text);
  void run();

  gputime::GpuTimeSegment& seg_;
  uint8_t uuid_[16];
  std::string label_;

  std::mutex mutex_;  // everything below; passes and the main thread's calls
  std::array<Row, gputime::kMaxTenants> rows_;
  uint64_t slice_ns_ = gputime::kDefaultSliceNs;
  uint32_t active_count_ = 0;
  uint64_t generation_ = 0;
  uint64_t seq_ = 0;  // the last grant's sequence number (all tenants draw from it)
  uint64_t last_word_ = 0, last_grant_ns_ = 0, last_revoke_ns_ = 0;  // for GrantSection (display)
  uint64_t unyielding_seen_ns_ = 0;  // the last pass a tenant that does not yield held or asked
  uint64_t handovers_ = 0;
  // Measured mode: the meter, PID -> row, usage of PIDs not attributed yet,
  // and the GPU's busy time over the current room window.
  std::unique_ptr<UsageMeter> meter_;
  uint64_t last_meter_ns_ = 0, meter_ok_ns_ = 0;
  uint64_t meter_failing_since_ns_ = 0;  // the first failed read since the last good one; 0: none
  bool meter_down_ = false;              // its failure was said (read_meter())
  std::string meter_warning_;            // its warning(), as last said
  // PID -> the rows whose GPU time its use is: one, or the claims of one
  // container that share this GPU (its use is split between them).
  std::unordered_map<uint32_t, std::vector<uint32_t>> pid_rows_;
  std::unordered_map<uint32_t, PidLifetime> pid_lifetimes_;  // attribute()'s lifetimes
  // Whether a sample of `pid` at `at` is of the process attribute() named.
  bool names_then(uint32_t pid, uint64_t at) const;
  // Files `busy` used at `at` by `pid`, of these rows, in equal parts.
  void file_split_use(uint32_t pid, const std::vector<uint32_t>& rows, uint64_t busy, uint64_t at, uint64_t now);
  struct Unattributed {
    uint64_t busy_ns = 0, since = 0;
    std::vector<std::pair<uint64_t, uint64_t>> uses;  // (instant, busy), the first few (held mode's audit)
  };
  bool measured_charging_ = false;
  uint64_t audit_from_ns_ = 0;  // samples before this instant are not audited
  std::unordered_map<uint32_t, Unattributed> unattributed_;
  std::vector<ProcessUse> readings_;
  uint64_t pass_busy_ = 0;   // measured by this pass's reading, all processes
  bool fresh_reading_ = false;  // this pass read the meter
  uint64_t room_since_ = 0, room_busy_ = 0;
  // Side by side: allowed, the driver time-slices, in force now; when the
  // current phase (side by side, or turns) began; what the GPU did in it;
  // the busy share of the last side-by-side phase (-1: none since the
  // tenants last changed).
  bool outside_work_ = false;  // some tenant yields (step()): the audit's credits come by the sample
  bool side_allowed_ = false, driver_slices_ = false, side_ = false;
  uint64_t phase_since_ = 0;
  PhaseBusy turns_, side_phase_;
  int64_t side_busy_ppm_ = -1;
  bool turns_held_taken_ = false;  // the rows' turns_held0 are taken (at turns_.from)
  uint64_t turns_held_at_ = 0;
  uint64_t contended_ns_ = 0;  // the last pass that saw two tenants or more ask or hold
  // Side-by-side phases begun since the tenants last changed (one that did
  // not fit asked, one was alone too long) or a measure found no room.
  uint32_t side_rounds_ = 0;
  uint32_t busy_ppm_ = 0;
  uint64_t min_vtime_ = 0;
  uint64_t last_pass_ns_ = 0;
  // The time some tenant held a grant, summed over the passes, recorded at
  // most once per kGrantedMarkNs: the audit's measure of how much of a
  // sampling period the grants covered, whatever a tenant does to its own
  // grants (a tenant that ends them by the hundred a second cannot push its
  // work out of this record, as it could out of a list of grants).
  static constexpr uint64_t kGrantedMarkNs = 1'000'000;
  struct GrantedMark {
    uint64_t at = 0, granted = 0;
  };
  std::array<GrantedMark, 4096> granted_marks_{};  // 4 s at least
  uint32_t granted_next_ = 0;
  uint64_t granted_total_ = 0, granted_marked_at_ = 0;
  uint64_t latency_seen_ns_ = 0;  // a latency tenant last had a live process, asked or held the GPU (0: never)
  // A latency tenant was configured since the last pass (its arrival grace
  // starts at the next pass's clock), and when the last one's began (0: none).
  bool latency_configured_ = false;
  uint64_t latency_arrival_ns_ = 0;
  bool anyone_wants_ = false;
  uint64_t last_used_ns_ = 0;  // the last pass someone asked, held, or the meter found the GPU busy
  std::vector<std::pair<uint64_t, std::array<uint64_t, gputime::kMaxTenants>>> samples_;
  std::vector<SchedulerMessage> messages_;

  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> passes_{0};
  std::atomic<uint64_t> probes_{0};
};

}  // namespace fracgpu::controller

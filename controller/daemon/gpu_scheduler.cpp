#include "daemon/gpu_scheduler.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "sigbus_guard.h"

namespace fracgpu::controller {
namespace {

using gputime::kPpm;
using ledger::kMaxSlots;

constexpr uint64_t kSecond = 1'000'000'000ull;
// How long a record-lock probe of a slot stays good: a live answer for a
// millisecond (deciding that a holder's process died a millisecond late is
// harmless), a dead one for ten (a dead owner comes back only as a new
// process, which must ask anew). And at most this many probes per tenant
// per pass: a tenant that marks all 256 of its slots live and asking costs
// the daemon a few system calls a pass, not 256; slots left unprobed keep
// their last answer (alive if never probed), which can only delay that
// tenant's own revocations or count its own wants.
constexpr uint64_t kProbeAliveValidNs = 1'000'000;
constexpr uint64_t kProbeDeadValidNs = 10'000'000;
constexpr uint32_t kProbesPerPass = 8;
// What a restarted daemon keeps of an earlier run's virtual times: none
// more than this (of real time, at its share) ahead of the least.
constexpr uint64_t kAdoptVtimeSpreadNs = 10 * kSecond;

template <typename T>
bool store_if_changed(std::atomic<T>& field, T value) {
  if (field.load(std::memory_order_relaxed) == value) return false;
  field.store(value, std::memory_order_release);
  return true;
}

}  // namespace

GpuScheduler::GpuScheduler(gputime::GpuTimeSegment& seg, const uint8_t uuid[16], std::string label)
    : seg_(seg), label_(std::move(label)) {
  memcpy(uuid_, uuid, sizeof uuid_);
}

GpuScheduler::~GpuScheduler() {
  stop();
  for (Row& r : rows_) release_usage(r);
}

void GpuScheduler::note(bool warning, std::string text) {
  // Bounded: a tenant that makes us complain every pass cannot grow this.
  if (messages_.size() < 64) messages_.push_back({warning, std::move(text)});
}

std::vector<SchedulerMessage> GpuScheduler::take_messages() {
  std::lock_guard lock(mutex_);
  return std::exchange(messages_, {});
}

// ---- Adopting the file ----

void GpuScheduler::adopt(uint64_t now) {
  std::lock_guard lock(mutex_);
  if (!gputime::header_valid(seg_.header, uuid_)) gputime::stamp_header(seg_.header, uuid_);
  // Only plausible figures survive: GPU time held (or waited) on this GPU
  // since boot cannot exceed the time since boot, and a limit's arrival
  // time cannot lie far in the future.
  uint64_t least = UINT64_MAX;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    gputime::TenantTime& f = seg_.tenants[t];
    const uint32_t state = f.state.load(std::memory_order_acquire);
    Row& r = rows_[t];
    if (state == gputime::kTenantUnused || state > gputime::kTenantRetired ||
        strnlen(f.name, sizeof f.name) == sizeof f.name || f.name[0] == '\0')
      continue;  // unused, or damaged beyond naming: left for bind_tenant to skip
    r.bound = true;
    r.name = std::string(f.name);
    r.used = f.used_ns.load(std::memory_order_relaxed);
    r.throttled = f.throttled_ns.load(std::memory_order_relaxed);
    r.slices = f.slices.load(std::memory_order_relaxed);
    r.missed_deadlines = f.missed_deadlines.load(std::memory_order_relaxed);
    r.vtime = f.vtime.load(std::memory_order_relaxed);
    r.cap_tat = f.cap_tat_ns.load(std::memory_order_relaxed);
    r.share = std::min(f.share_ppm.load(std::memory_order_relaxed), kPpm);  // until configure() says
    if (r.used > now || r.throttled > now) {
      r.used = r.throttled = r.slices = 0;
      r.missed_deadlines = 0;
    }
    if (r.cap_tat > now + 60 * kSecond) r.cap_tat = now;
    least = std::min(least, r.vtime);
  }
  // Virtual times only matter relative to each other: a damaged one far
  // ahead would starve its tenant, so none stays more than the spread
  // ahead of the least.
  for (Row& r : rows_) {
    if (!r.bound) continue;
    r.vtime = std::min(r.vtime, gputime::saturating_add(least, gputime::scale(kAdoptVtimeSpreadNs, r.share)));
  }
  min_vtime_ = least == UINT64_MAX ? 0 : least;
  handovers_ = seg_.grant.handovers.load(std::memory_order_relaxed);
  // A grant number above the last run's and above the clock in
  // microseconds (which a damaged or missing number cannot be, and which
  // grows faster than grants are made): processes that entered an old
  // grant see it is over, whatever the file said.
  const uint64_t old_word = seg_.grant.word.load(std::memory_order_acquire);
  const uint64_t old_seq = gputime::grant_valid(old_word) ? gputime::grant_seq(old_word) : 0;
  seq_ = std::min(std::max(old_seq, now / 1000) + 1, gputime::kMaxGrantSeq);
  state_ = gputime::kGrantIdle;
  holder_ = 0;
  last_pass_ns_ = now;
  seg_.grant.revoke_ns.store(0, std::memory_order_relaxed);
  publish_grant();
}

// ---- Configuration (main thread) ----

void GpuScheduler::release_usage(Row& r) {
  if (r.usage != nullptr) munmap(const_cast<ledger::UsageSegment*>(r.usage), sizeof(ledger::UsageSegment));
  // Closing a descriptor of the usage file drops every record lock this
  // process holds on it: only the main thread calls this, never while it
  // reaps (the only time the daemon holds such locks).
  if (r.fd >= 0) ::close(r.fd);
  r.usage = nullptr;
  r.fd = -1;
  r.dev = 0;
  r.ino = 0;
  r.high = 0;
  r.readable = false;
  r.probed_ns.fill(0);
  r.alive.reset();
}

void GpuScheduler::configure(const std::vector<SchedulerTenant>& tenants, uint64_t slice_ns) {
  std::lock_guard lock(mutex_);
  bool changed = false;
  std::array<bool, gputime::kMaxTenants> listed{};
  for (const SchedulerTenant& t : tenants) {
    const int index = gputime::bind_tenant(seg_, t.name.c_str());
    if (index < 0) {
      note(true, fmt::format("{}: more than {} tenants: tenant \"{}\" gets no GPU time there", label_,
                             gputime::kMaxTenants, t.name));
      continue;
    }
    Row& r = rows_[index];
    listed[index] = true;
    changed |= !r.active || r.share != t.share_ppm || r.limit != t.limit_ppm;
    r.bound = true;
    r.active = true;
    r.name = t.name;
    r.share = t.share_ppm;
    r.limit = t.limit_ppm == 0 ? kPpm : t.limit_ppm;
    r.entry = t.entry;
    struct stat st {};
    if (t.usage_fd < 0 || t.entry < 0 || t.entry >= static_cast<int>(ledger::kMaxGpus) || fstat(t.usage_fd, &st) != 0) {
      release_usage(r);
      continue;
    }
    if (r.fd >= 0 && r.dev == st.st_dev && r.ino == st.st_ino) continue;  // the same file as before
    release_usage(r);
    r.fd = fcntl(t.usage_fd, F_DUPFD_CLOEXEC, 0);
    if (r.fd < 0) continue;
    void* map = mmap(nullptr, sizeof(ledger::UsageSegment), PROT_READ, MAP_SHARED, r.fd, 0);
    if (map == MAP_FAILED) {
      note(true, fmt::format("{}: tenant \"{}\": cannot map its usage file: {}; it gets no GPU time here", label_,
                             t.name, strerror(errno)));
      release_usage(r);
      continue;
    }
    r.usage = static_cast<const ledger::UsageSegment*>(map);
    r.dev = st.st_dev;
    r.ino = st.st_ino;
  }
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    if (listed[t] || !r.active) continue;
    r.active = false;
    changed = true;
    release_usage(r);
    note(false, fmt::format("{}: tenant \"{}\" no longer has a share of its time", label_, r.name));
  }
  changed |= slice_ns_ != (slice_ns != 0 ? slice_ns : gputime::kDefaultSliceNs);
  slice_ns_ = slice_ns != 0 ? slice_ns : gputime::kDefaultSliceNs;
  active_count_ = static_cast<uint32_t>(std::count(listed.begin(), listed.end(), true));
  if (changed) ++generation_;
  publish(last_pass_ns_);
}

// ---- Observing the tenants ----

bool GpuScheduler::slot_alive(Row& r, uint32_t s, uint64_t now) {
  if (r.probed_ns[s] != 0 && now - r.probed_ns[s] < (r.alive[s] ? kProbeAliveValidNs : kProbeDeadValidNs))
    return r.alive[s];
  if (r.probe_budget == 0) return r.probed_ns[s] == 0 || r.alive[s];
  --r.probe_budget;
  probes_.fetch_add(1, std::memory_order_relaxed);
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = ledger::slot_lock_offset(s);
  fl.l_len = 1;
  // Cannot tell: take it for alive. It then only delays this tenant's own
  // revocation to the deadline, or lets its want count.
  const bool alive = fcntl(r.fd, F_GETLK, &fl) != 0 || fl.l_type != F_UNLCK;
  r.probed_ns[s] = now == 0 ? 1 : now;
  r.alive[s] = alive;
  return alive;
}

void GpuScheduler::observe(Row& r, uint64_t now) {
  r.probe_budget = kProbesPerPass;
  r.wants = false;
  r.waiting = 0;
  r.want_since = 0;
  r.last_active = 0;
  if (r.usage == nullptr || r.entry < 0) {
    r.readable = false;
    r.high = 0;
    return;
  }
  const ledger::UsageSegment& u = *r.usage;
  const uint32_t entry = static_cast<uint32_t>(r.entry);
  uint32_t high = 0;
  // A tenant may truncate its usage file: every touch of the mapping is
  // guarded, and a failed one makes the tenant one that does not want.
  const bool ok = shm::sigbus_guarded([&] {
    high = std::min(u.slot_high_water.load(std::memory_order_acquire), kMaxSlots);
    for (uint32_t s = 0; s < high; ++s) {
      const ledger::GpuTimeRequest& q = u.gputime[entry][s];
      SlotView& v = r.slots[s];
      v.live = u.slots[s].state.load(std::memory_order_acquire) == ledger::kSlotLive;
      // Read in the order processes write them backwards: a process stores
      // entered_grant before it clears want_since, so a reader that finds
      // want_since cleared then finds entered_grant set.
      v.want = q.want_since_ns.load(std::memory_order_seq_cst);
      v.poll = q.poll_ns.load(std::memory_order_relaxed);
      v.active = q.last_active_ns.load(std::memory_order_relaxed);
      v.entered = q.entered_grant.load(std::memory_order_seq_cst);
      v.drained = q.drained_grant.load(std::memory_order_seq_cst);
    }
  });
  if (!ok) {
    r.readable = false;
    r.high = 0;
    if (!r.unreadable_reported)
      note(true, fmt::format("{}: tenant \"{}\": its usage file cannot be read (truncated?); it is treated as not "
                             "asking for the GPU until it can",
                             label_, r.name));
    r.unreadable_reported = true;
    return;
  }
  if (r.unreadable_reported) note(false, fmt::format("{}: tenant \"{}\": its usage file is readable again", label_, r.name));
  r.unreadable_reported = false;
  r.readable = true;
  r.high = high;
  for (uint32_t s = 0; s < high; ++s) {
    SlotView& v = r.slots[s];
    if (!v.live) continue;
    // Claims: no time after ours counts.
    v.want = std::min(v.want, now);
    v.poll = std::min(v.poll, now);
    v.active = std::min(v.active, now);
    r.last_active = std::max(r.last_active, v.active);
    // A want counts while its process renews it: a stopped process's does
    // not keep its tenant asking for grants it cannot take up.
    if (v.want == 0 || now - v.poll >= gputime::kWantFreshNs || !slot_alive(r, s, now)) continue;
    ++r.waiting;
    r.wants = true;
    r.want_since = r.want_since == 0 ? v.want : std::min(r.want_since, v.want);
  }
}

std::bitset<kMaxSlots> GpuScheduler::pending_drains(Row& r, uint64_t now) {
  std::bitset<kMaxSlots> pending;
  for (uint32_t s = 0; s < r.high; ++s) {
    const SlotView& v = r.slots[s];
    if (v.entered != seq_ || v.drained == seq_) continue;
    if (slot_alive(r, s, now)) pending.set(s);
  }
  return pending;
}

// ---- Policy ----

uint64_t GpuScheduler::effective_vtime(const Row& r) const {
  const uint64_t credit = gputime::scale(gputime::kReturnCreditNs, r.share);
  return std::max(r.vtime, min_vtime_ > credit ? min_vtime_ - credit : 0);
}

int GpuScheduler::best_candidate(uint64_t now, int exclude) {
  int best = -1;
  uint64_t best_vtime = 0, best_since = 0;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    if (static_cast<int>(t) == exclude || !r.active || !r.readable || !r.wants || r.blocked) continue;
    if (!gputime::within_limit(r.cap_tat, r.limit, now, nullptr)) continue;
    const uint64_t vt = effective_vtime(r);
    // Ties go to the longest wait: a tenant claiming an ancient want wins
    // ties only, which virtual times make rare.
    if (best >= 0 && (vt > best_vtime || (vt == best_vtime && r.want_since >= best_since))) continue;
    best = static_cast<int>(t);
    best_vtime = vt;
    best_since = r.want_since;
  }
  return best;
}

void GpuScheduler::charge_holder(uint64_t now) {
  if (state_ == gputime::kGrantIdle || now <= charged_ns_) return;
  Row& h = rows_[holder_];
  const uint64_t ns = now - charged_ns_;
  h.used += ns;
  h.vtime = gputime::saturating_add(h.vtime, gputime::scale(ns, h.share));
  h.cap_tat = gputime::advance_limit(h.cap_tat, ns, h.limit, std::min(credit_from_, now));
  charged_ns_ = now;
}

// Throttled time: a tenant wanted the GPU and did not hold it (another
// did, or its limit kept it off). Its claimed want time counts from the
// last pass at the earliest, so a claim cannot add more than we saw.
void GpuScheduler::account_waits(uint64_t now) {
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    const bool holds = state_ != gputime::kGrantIdle && holder_ == t;
    if (!r.active || !r.wants || holds) {
      if (!r.wants) r.kept_off_since = 0;
      continue;
    }
    const uint64_t from = std::max(last_pass_ns_, r.want_since);
    if (now > from) r.throttled += now - from;
    // Kept off by another tenant's grant, not by its own limit: the limit's
    // allowance keeps accruing meanwhile (see gputime::advance_limit).
    if (state_ != gputime::kGrantIdle && r.kept_off_since == 0 &&
        gputime::within_limit(r.cap_tat, r.limit, now, nullptr))
      r.kept_off_since = from;
  }
}

// A tenant that missed a drain deadline is granted again only once one of
// the processes that missed it reports the drain, or all of them are gone
// (dead, or their slot taken by a new process, which clears its requests).
void GpuScheduler::check_blocked(Row& r, uint64_t now) {
  if (!r.blocked || !r.readable) return;
  bool progress = false;
  for (uint32_t s = 0; s < kMaxSlots; ++s) {
    if (!r.missed[s]) continue;
    const SlotView& v = r.slots[s];
    if (s >= r.high || v.entered != r.blocked_seq || !slot_alive(r, s, now)) {
      r.missed.reset(s);
    } else if (v.drained == r.blocked_seq) {
      progress = true;
    }
  }
  if (!progress && r.missed.any()) return;
  r.blocked = false;
  r.missed.reset();
  note(false, fmt::format("{}: tenant \"{}\" {}: it may be granted the GPU again", label_, r.name,
                          progress ? "reported its late drain" : "has none of the processes that missed the deadline left"));
}

void GpuScheduler::publish_grant() {
  const uint64_t word = gputime::grant_word(seq_, holder_, state_);
  // seq_cst: the daemon's half of the drain handshake (gputime.h).
  seg_.grant.word.store(word, std::memory_order_seq_cst);
  seg_.grant.turn.fetch_add(1, std::memory_order_seq_cst);
  gputime::wake_turn(seg_);
}

void GpuScheduler::grant_next(uint64_t now) {
  const int best = best_candidate(now, -1);
  if (best < 0) return;
  Row& r = rows_[best];
  r.vtime = effective_vtime(r);  // lifted, if it comes back from idle
  r.slices += 1;
  credit_from_ = r.kept_off_since != 0 ? r.kept_off_since : now;
  r.kept_off_since = 0;
  seq_ = std::min(seq_ + 1, gputime::kMaxGrantSeq);
  state_ = gputime::kGranted;
  holder_ = static_cast<uint32_t>(best);
  grant_ns_ = charged_ns_ = now;
  revoke_ns_ = 0;
  ++handovers_;
  seg_.grant.grant_ns.store(now, std::memory_order_relaxed);
  seg_.grant.revoke_ns.store(0, std::memory_order_relaxed);
  publish_grant();
}

void GpuScheduler::end_grant(uint64_t now) {
  state_ = gputime::kGrantIdle;
  revoke_ns_ = 0;
  seg_.grant.revoke_ns.store(0, std::memory_order_relaxed);
  publish_grant();
  grant_next(now);
}

void GpuScheduler::start_revoke(uint64_t now, const char*) {
  state_ = gputime::kGrantRevoking;
  revoke_ns_ = now;
  seg_.grant.revoke_ns.store(now, std::memory_order_relaxed);
  publish_grant();
  // Read the holder's entered_grant again *after* that store: a process
  // that entered before it is seen now (gputime.h), and its drain awaited.
  Row& h = rows_[holder_];
  observe(h, now);
  const std::bitset<kMaxSlots> pending = pending_drains(h, now);
  if (pending.none()) complete_revoke(now, false, pending);
}

void GpuScheduler::complete_revoke(uint64_t now, bool missed, const std::bitset<kMaxSlots>& pending) {
  Row& h = rows_[holder_];
  if (missed) {
    // Charged through the deadline (charge_holder ran this pass); not
    // granted again until it shows progress.
    h.blocked = true;
    h.blocked_seq = seq_;
    h.missed = pending;
    h.missed_deadlines += 1;
    note(true, fmt::format("{}: tenant \"{}\": {} process(es) did not drain grant {} within {} ms; the GPU goes on "
                           "without them, and the tenant waits until they report it",
                           label_, h.name, pending.count(), seq_, gputime::kDrainDeadlineNs / 1'000'000));
  }
  end_grant(now);
}

void GpuScheduler::step(uint64_t now) {
  switch (state_) {
    case gputime::kGrantIdle:
      grant_next(now);
      return;
    case gputime::kGranted: {
      Row& h = rows_[holder_];
      if (!h.active || !h.readable) {
        start_revoke(now, "no longer configured or readable");
        return;
      }
      if (!gputime::within_limit(h.cap_tat, h.limit, now, nullptr)) {
        start_revoke(now, "limit");
        return;
      }
      // Nothing left to wait for: every process that entered the grant has
      // drained it or died (an exit reports its drain), and none asks.
      // The grant ends now, with no handshake.
      if (!h.wants && pending_drains(h, now).none()) {
        end_grant(now);
        return;
      }
      const int other = best_candidate(now, static_cast<int>(holder_));
      const uint64_t idle_for = now - std::max(grant_ns_, h.last_active);
      if (!h.wants && idle_for >= gputime::kIdleNs && (other >= 0 || idle_for >= gputime::kLoneIdleNs)) {
        start_revoke(now, "idle");
        return;
      }
      if (other >= 0 && now - grant_ns_ >= slice_ns_ && effective_vtime(rows_[other]) < effective_vtime(h))
        start_revoke(now, "slice");
      return;
    }
    case gputime::kGrantRevoking: {
      Row& h = rows_[holder_];
      const std::bitset<kMaxSlots> pending = pending_drains(h, now);
      if (pending.none()) {
        complete_revoke(now, false, pending);
      } else if (now - revoke_ns_ >= gputime::kDrainDeadlineNs) {
        complete_revoke(now, true, pending);
      }
      return;
    }
    default:
      state_ = gputime::kGrantIdle;
      return;
  }
}

// ---- Publishing ----

void GpuScheduler::publish(uint64_t now) {
  // The file is ours alone, but root can still write it: every pass puts
  // back what we know, so damage lasts one pass at most.
  if (!gputime::header_valid(seg_.header, uuid_)) gputime::stamp_header(seg_.header, uuid_);
  store_if_changed(seg_.daemon.doorbell, 0u);
  const uint64_t word = gputime::grant_word(seq_, holder_, state_);
  if (seg_.grant.word.load(std::memory_order_acquire) != word) publish_grant();
  store_if_changed(seg_.grant.grant_ns, grant_ns_);
  store_if_changed(seg_.grant.revoke_ns, revoke_ns_);
  store_if_changed(seg_.grant.handovers, handovers_);
  store_if_changed(seg_.min_vtime, min_vtime_);
  store_if_changed(seg_.daemon.slice_ns, slice_ns_);
  store_if_changed(seg_.daemon.drain_deadline_ns, gputime::kDrainDeadlineNs);
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    gputime::TenantTime& f = seg_.tenants[t];
    if (!r.bound) {
      store_if_changed(f.state, uint32_t{gputime::kTenantUnused});
      continue;
    }
    if (strncmp(f.name, r.name.c_str(), sizeof f.name) != 0) snprintf(f.name, sizeof f.name, "%s", r.name.c_str());
    store_if_changed(f.share_ppm, r.share);
    store_if_changed(f.limit_ppm, r.limit);
    store_if_changed(f.vtime, r.vtime);
    store_if_changed(f.used_ns, r.used);
    store_if_changed(f.throttled_ns, r.throttled);
    store_if_changed(f.cap_tat_ns, r.cap_tat);
    store_if_changed(f.slices, r.slices);
    store_if_changed(f.waiting_processes, r.active ? r.waiting : 0u);
    store_if_changed(f.missed_deadlines, r.missed_deadlines);
    store_if_changed(f.flags, (r.active && r.wants ? uint32_t{gputime::kTenantWants} : 0u) |
                                  (r.blocked ? uint32_t{gputime::kTenantBlocked} : 0u));
    // The state last (release): a reader that sees the row active sees its configuration.
    store_if_changed(f.state, uint32_t{r.active ? gputime::kTenantActive : gputime::kTenantRetired});
  }
  store_if_changed(seg_.daemon.active_tenants, active_count_);
  store_if_changed(seg_.generation, generation_);
  seg_.daemon.daemon_heartbeat_ns.store(now, std::memory_order_release);
}

// ---- The pass ----

uint64_t GpuScheduler::pass(uint64_t now) {
  std::lock_guard lock(mutex_);
  passes_.fetch_add(1, std::memory_order_relaxed);
  now = std::max(now, last_pass_ns_);
  anyone_wants_ = false;
  for (Row& r : rows_) {
    if (!r.active) continue;
    observe(r, now);
    check_blocked(r, now);
    anyone_wants_ |= r.wants;
  }
  // The floor for tenants coming back from idle: the least virtual time
  // among those that want the GPU and the holder (it only rises).
  uint64_t lowest = UINT64_MAX;
  // (A blocked tenant is not among them: it cannot be granted, and its
  // virtual time standing still must not hold the others' back.)
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t)
    if (rows_[t].active && ((rows_[t].wants && !rows_[t].blocked) || (state_ != gputime::kGrantIdle && holder_ == t)))
      lowest = std::min(lowest, rows_[t].vtime);
  if (lowest != UINT64_MAX && lowest > min_vtime_) min_vtime_ = lowest;
  account_waits(now);
  charge_holder(now);
  step(now);
  publish(now);
  last_pass_ns_ = now;
  if (state_ == gputime::kGrantRevoking)
    return std::min(kBusyPassNs, std::max<uint64_t>(revoke_ns_ + gputime::kDrainDeadlineNs - now, kMinPassIntervalNs));
  return state_ != gputime::kGrantIdle || anyone_wants_ ? kBusyPassNs : kIdlePassNs;
}

void GpuScheduler::sample_achieved(uint64_t now) {
  std::lock_guard lock(mutex_);
  std::array<uint64_t, gputime::kMaxTenants> used{};
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) used[t] = rows_[t].used;
  samples_.emplace_back(now, used);
  // Keep just over 10 s: the oldest sample at least 10 s old stays.
  while (samples_.size() > 2 && now - samples_[1].first >= 10 * kSecond) samples_.erase(samples_.begin());
  // The achieved share over a window: GPU time held since the newest
  // sample at least that old, over the time since it.
  auto achieved = [&](uint32_t t, uint64_t window) -> uint32_t {
    const auto* base = &samples_.front();
    for (const auto& sample : samples_)
      if (now - sample.first >= window) base = &sample;
    if (now <= base->first) return 0;
    const uint64_t delta = used[t] >= base->second[t] ? used[t] - base->second[t] : 0;
    const auto ppm = static_cast<unsigned __int128>(delta) * kPpm / (now - base->first);
    return static_cast<uint32_t>(std::min<unsigned __int128>(ppm, kPpm));
  };
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    if (!rows_[t].bound) continue;
    store_if_changed(seg_.tenants[t].achieved_1s_ppm, achieved(t, kSecond));
    store_if_changed(seg_.tenants[t].achieved_10s_ppm, achieved(t, 10 * kSecond));
  }
}

// ---- The thread ----

// A hand-over is two wake-ups: the holder's drain report wakes this
// thread, whose grant wakes the next tenant's waiters; the GPU idles for
// both. So this thread asks to run before ordinary work when woken: the
// lowest real-time priority (its passes take microseconds and it sleeps at
// least kMinPassIntervalNs between them, so it cannot hog a CPU), else a
// raised nice value; without the privilege for either, it runs as it is.
// Returns what it got, for the log.
std::string raise_priority() {
  struct sched_param param {};
  param.sched_priority = sched_get_priority_min(SCHED_FIFO);
  if (pthread_setschedparam(pthread_self(), SCHED_FIFO, &param) == 0) return "real-time (SCHED_FIFO 1)";
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), -10) == 0) return "nice -10";
  return fmt::format("normal ({})", strerror(errno));
}

void GpuScheduler::run() {
  const std::string priority = raise_priority();
  {
    std::lock_guard lock(mutex_);
    note(false, fmt::format("{}: GPU-time scheduler running, priority {}", label_, priority));
  }
  while (!stop_.load(std::memory_order_acquire)) {
    const uint64_t start = gputime::monotonic_ns();
    const uint64_t sleep = pass(start);
    if (stop_.load(std::memory_order_acquire)) break;
    gputime::wait_for_doorbell(seg_, sleep);
    // However often tenants ring, a pass at most every kMinPassIntervalNs.
    const uint64_t spent = gputime::monotonic_ns() - start;
    if (spent < kMinPassIntervalNs) {
      struct timespec ts {0, static_cast<long>(kMinPassIntervalNs - spent)};
      nanosleep(&ts, nullptr);
    }
  }
}

void GpuScheduler::start() {
  if (thread_.joinable()) return;
  stop_.store(false, std::memory_order_release);
  thread_ = std::thread([this] { run(); });
}

void GpuScheduler::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true, std::memory_order_release);
  gputime::ring_doorbell(seg_);
  thread_.join();
  std::lock_guard lock(mutex_);
  // A clean stop says so at once: no holder, no heartbeat. Tenant
  // processes run unshared until a daemon schedules again.
  seq_ = std::min(seq_ + 1, gputime::kMaxGrantSeq);
  state_ = gputime::kGrantIdle;
  holder_ = 0;
  seg_.daemon.daemon_heartbeat_ns.store(0, std::memory_order_release);
  publish_grant();
}

}  // namespace fracgpu::controller

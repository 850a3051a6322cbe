#include "daemon/gpu_scheduler.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <climits>
#include <cstring>
#include <ctime>
#include <utility>

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "config/tenant_rules.h"
#include "sigbus_guard.h"

namespace fracgpu::controller {

static_assert(kMaxTenantsPerGpu == gputime::kMaxTenants, "admission and the arbiter's table must agree");

namespace {

using gputime::kPpm;
using ledger::kMaxSlots;

constexpr uint64_t kSecond = 1'000'000'000ull;
// How long a record-lock probe of a slot stays good: a live answer for a
// millisecond (deciding that a holder's process died a millisecond late is
// harmless), a dead one for ten (a dead owner comes back only as a new
// process, which must ask anew, or enter a grant its tenant holds, which
// changes the slot's words and so sends it to be probed again).
// And at most this many probes per tenant per millisecond since its last
// pass (at least a millisecond's worth, at most one per slot): a tenant
// that marks all 256 of its slots live and asking costs the daemon a few
// system calls a millisecond, not 256 a pass; and a pass that comes after a
// long sleep (a drain deadline) can still probe every slot it waits for.
// Slots left unprobed keep their last answer (alive if never probed),
// which can only delay that tenant's own revocations or count its own wants.
constexpr uint64_t kProbeAliveValidNs = 1'000'000;
constexpr uint64_t kProbeDeadValidNs = 10'000'000;
constexpr uint32_t kProbesPerMs = 8;
// What a restarted daemon keeps of an earlier run's virtual times: none
// more than this (of real time, at its share) ahead of the least.
constexpr uint64_t kAdoptVtimeSpreadNs = 10 * kSecond;
// A real NVML samples every ~1/6 s to 1 s: a longer period from the meter
// is taken for 1 s (it would leave limits unenforced for that long).
constexpr uint64_t kMaxMeterPeriodNs = 1'000'000'000;

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
    r.measured = f.measured_ns.load(std::memory_order_relaxed);
    r.held = f.held_ns.load(std::memory_order_relaxed);
    r.throttled = f.throttled_ns.load(std::memory_order_relaxed);
    r.slices = f.slices.load(std::memory_order_relaxed);
    r.missed_deadlines = f.missed_deadlines.load(std::memory_order_relaxed);
    r.vtime = f.vtime.load(std::memory_order_relaxed);
    r.cap_tat = f.cap_tat_ns.load(std::memory_order_relaxed);
    r.share = std::min(f.share_ppm.load(std::memory_order_relaxed), kPpm);  // until configure() says
    if (r.used > now || r.throttled > now || r.measured > now || r.held > now) {
      r.used = r.throttled = r.slices = r.measured = r.held = 0;
      r.missed_deadlines = 0;
    }
    if (r.cap_tat > now + 60 * kSecond) r.cap_tat = now;
    // A bar from side by side (check_side_shares()) outlives a restart: the
    // file keeps the flag, not the bar's end nor its length, so it runs the
    // first bar's length again from here.
    if ((f.flags.load(std::memory_order_relaxed) & gputime::kTenantTakesTurns) != 0) {
      r.side_bar_ns = kSideBarNs;
      r.side_barred_until = now + kSideBarNs;
    }
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
  audit_from_ns_ = now + kAuditGraceNs;
  handovers_ = seg_.grant.handovers.load(std::memory_order_relaxed);
  // A grant number above the last run's and above the clock in
  // microseconds (which a damaged or missing number cannot be, and which
  // grows faster than grants are made): processes that entered an old
  // grant see it is over, whatever the file said.
  uint64_t old_seq = 0;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const uint64_t old_word = seg_.tenants[t].grant.load(std::memory_order_acquire);
    if (gputime::grant_valid(old_word)) old_seq = std::max(old_seq, gputime::grant_seq(old_word));
  }
  seq_ = std::min(std::max(old_seq, now / 1000) + 1, gputime::kMaxGrantSeq);
  last_pass_ns_ = now;
  seg_.grant.revoke_ns.store(0, std::memory_order_relaxed);
  // Nobody holds the GPU: every tenant's word idle, under the new number.
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    rows_[t].gstate = gputime::kGrantIdle;
    rows_[t].gseq = seq_;
    publish_grant(t);
  }
}

void GpuScheduler::set_meter(std::unique_ptr<UsageMeter> meter) {
  std::lock_guard lock(mutex_);
  meter_ = std::move(meter);
  meter_ok_ns_ = 0;
  last_meter_ns_ = 0;
  meter_failing_since_ns_ = 0;
  meter_down_ = false;
  meter_warning_.clear();
}

bool GpuScheduler::has_meter() {
  std::lock_guard lock(mutex_);
  return meter_ != nullptr;
}

void GpuScheduler::set_measured_charging(bool measured) {
  std::lock_guard lock(mutex_);
  if (measured_charging_ != measured) ++generation_;
  measured_charging_ = measured;
}

void GpuScheduler::set_side_by_side(bool allowed, bool driver_time_slices) {
  std::lock_guard lock(mutex_);
  side_allowed_ = allowed;
  driver_slices_ = driver_time_slices;
}

void GpuScheduler::set_outside_tenants(const std::set<std::string>& tenants) {
  std::lock_guard lock(mutex_);
  for (Row& r : rows_) r.outside = r.bound && tenants.contains(r.name);
}

void GpuScheduler::set_listed_outside(const std::map<std::string, uint32_t>& milli_by_tenant) {
  std::lock_guard lock(mutex_);
  for (Row& r : rows_) {
    const auto it = milli_by_tenant.find(r.name);
    r.listed_outside_milli = r.bound && it != milli_by_tenant.end() ? it->second : 0;
  }
}

std::vector<uint32_t> GpuScheduler::unattributed_pids() {
  std::lock_guard lock(mutex_);
  std::vector<uint32_t> pids;
  for (const auto& [pid, un] : unattributed_) {
    if (pids.size() >= 64) break;
    pids.push_back(pid);
  }
  return pids;
}

bool GpuScheduler::names_then(uint32_t pid, uint64_t at) const {
  const auto it = pid_lifetimes_.find(pid);
  if (it == pid_lifetimes_.end()) return true;
  return at >= it->second.from_ns && (it->second.until_ns == 0 || at < it->second.until_ns);
}

void GpuScheduler::attribute(const std::map<std::string, std::vector<uint32_t>>& pids_by_tenant,
                             const std::map<uint32_t, PidLifetime>& lifetimes) {
  std::lock_guard lock(mutex_);
  pid_rows_.clear();
  pid_lifetimes_.clear();
  for (const auto& [tenant, pids] : pids_by_tenant) {
    const int index = gputime::find_tenant(seg_, tenant.c_str());
    if (index < 0 || !rows_[index].active) continue;  // no share of this GPU
    for (const uint32_t pid : pids) {
      std::vector<uint32_t>& rows = pid_rows_[pid];
      if (pid != 0 && std::find(rows.begin(), rows.end(), static_cast<uint32_t>(index)) == rows.end())
        rows.push_back(static_cast<uint32_t>(index));
    }
  }
  pid_rows_.erase(0);
  for (const auto& [pid, life] : lifetimes)
    if (pid_rows_.contains(pid)) pid_lifetimes_[pid] = life;
  // Usage measured before the daemon knew whose the process is: the samples
  // of the named process's lifetime. Others stay unattributed (a process
  // behind the reused PID, found or not by the daemon's next tick).
  for (const auto& [pid, rows] : pid_rows_) {
    auto it = unattributed_.find(pid);
    if (it == unattributed_.end()) continue;
    Unattributed& un = it->second;
    // (instant, busy) of the samples of another process, kept.
    std::vector<std::pair<uint64_t, uint64_t>> others;
    uint64_t others_busy = 0;
    for (const auto& [at, busy] : un.uses) {
      if (names_then(pid, at)) {
        if (!measured_charging_) file_split_use(pid, rows, busy, at, last_pass_ns_);
      } else {
        others.emplace_back(at, busy);
        others_busy = gputime::saturating_add(others_busy, busy);
      }
    }
    if (measured_charging_) {
      // busy_ns holds the uses past the first few too: those are taken to be
      // the named process's (their instants are not kept).
      const uint64_t mine = un.busy_ns - std::min(un.busy_ns, others_busy);
      const uint64_t part = mine / rows.size();
      for (const uint32_t t : rows) {
        Row& r = rows_[t];
        uint64_t& to = gated(r) ? r.pending_use : r.named_ungated;  // as file_use() files it
        to = gputime::saturating_add(to, part);
      }
    }
    if (others.empty()) {
      unattributed_.erase(it);
    } else {
      un.uses = std::move(others);
      un.busy_ns = others_busy;
    }
  }
}

void GpuScheduler::file_split_use(uint32_t pid, const std::vector<uint32_t>& rows, uint64_t busy, uint64_t at,
                                  uint64_t now) {
  // Only the daemon's watch of the GPUs' process lists gives lifetimes: to
  // processes it found outside the gate.
  const bool outside_gate = pid_lifetimes_.contains(pid);
  // Equal parts; the remainder of the division to the first, so that the
  // parts add up to what the driver saw.
  const uint64_t part = busy / rows.size();
  for (size_t i = 0; i < rows.size(); ++i)
    file_use(rows[i], i == 0 ? busy - part * (rows.size() - 1) : part, at, now, outside_gate);
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
  r.high_mark = 0;
  r.readable = false;
  r.probed_ns.fill(0);
  r.alive.reset();
  r.probe_from = 0;
  r.entered_seen.reset();
}

// A row whose tenant is gone, back to unused: the scheduler's state and the
// file's (name, figures, grant) cleared, so the next tenant bound to it
// starts from nothing. Only rows nobody can still act on are freed: no
// process of the tenant is alive (the daemon's count, by record locks) and
// its grant is idle.
void GpuScheduler::free_row(uint32_t t) {
  Row& r = rows_[t];
  release_usage(r);
  r = Row{};
  r.gseq = seq_;
  gputime::TenantTime& f = seg_.tenants[t];
  f.state.store(gputime::kTenantUnused, std::memory_order_release);
  memset(f.name, 0, sizeof f.name);
  for (std::atomic<uint32_t>* field : {&f.share_ppm, &f.limit_ppm, &f.achieved_1s_ppm, &f.achieved_10s_ppm, &f.flags,
                                       &f.waiting_processes, &f.missed_deadlines, &f.priority})
    field->store(0, std::memory_order_relaxed);
  for (std::atomic<uint64_t>* field : {&f.vtime, &f.used_ns, &f.throttled_ns, &f.cap_tat_ns, &f.slices, &f.measured_ns,
                                       &f.held_ns, &f.out_of_grant_ns, &f.out_of_grant_samples, &f.wait_p50_ns,
                                       &f.wait_p99_ns, &f.wait_p999_ns, &f.waits})
    field->store(0, std::memory_order_relaxed);
  publish_grant(t, false);
  for (auto& [at, used] : samples_) used[t] = 0;
}

void GpuScheduler::configure(const std::vector<SchedulerTenant>& tenants, uint64_t slice_ns,
                             const std::set<std::string>& in_use) {
  std::lock_guard lock(mutex_);
  bool changed = false;
  // First free the rows of tenants that are gone, so the new ones find room.
  std::set<std::string> listed_names;
  for (const SchedulerTenant& t : tenants) listed_names.insert(t.name);
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    if (!r.bound || listed_names.contains(r.name) || in_use.contains(r.name) || r.gstate != gputime::kGrantIdle)
      continue;
    note(false, fmt::format("{}: tenant \"{}\" is gone: its row of the GPU-time table is free again", label_, r.name));
    free_row(t);
    changed = true;
  }
  std::array<bool, gputime::kMaxTenants> listed{};
  for (const SchedulerTenant& t : tenants) {
    const int index = gputime::bind_tenant(seg_, t.name.c_str());
    if (index < 0) {
      // Admission keeps configured tenants within the table; what is left
      // are tenants gone from the config whose processes still run.
      note(true, fmt::format("{}: all {} rows of its GPU-time table are taken (by tenants configured here, or gone "
                             "with processes still running): tenant \"{}\" is not scheduled there, and its "
                             "processes' kernel launches there are refused until a row is free",
                             label_, gputime::kMaxTenants, t.name));
      continue;
    }
    Row& r = rows_[index];
    listed[index] = true;
    changed |= !r.active || r.share != t.share_ppm || r.limit != t.limit_ppm || r.priority != t.priority;
    if (t.priority == gputime::kPriorityLatency && (!r.active || r.priority != t.priority)) latency_configured_ = true;
    if (r.priority != t.priority) {
      r.waits.clear();
      r.wait_count = 0;
    }
    r.priority = t.priority;
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
    end_overdue(r, last_pass_ns_);
    release_usage(r);
    note(false, fmt::format("{}: tenant \"{}\" no longer has a share of its time", label_, r.name));
  }
  changed |= slice_ns_ != (slice_ns != 0 ? slice_ns : gputime::kDefaultSliceNs);
  slice_ns_ = slice_ns != 0 ? slice_ns : gputime::kDefaultSliceNs;
  active_count_ = static_cast<uint32_t>(std::count(listed.begin(), listed.end(), true));
  if (changed) {
    ++generation_;
    audit_from_ns_ = last_pass_ns_ + kAuditGraceNs;
  }
  publish(last_pass_ns_);
}

// ---- Observing the tenants ----

bool GpuScheduler::slot_alive(Row& r, uint32_t s, uint64_t now) {
  if (r.probed_ns[s] != 0 && now - r.probed_ns[s] < (r.alive[s] ? kProbeAliveValidNs : kProbeDeadValidNs))
    return r.alive[s];
  if (r.probe_budget == 0) {
    // The first slot this pass could not probe: where the next pass's loops
    // over the slots begin.
    if (!r.probe_refused) r.probe_from = s;
    r.probe_refused = true;
    return r.probed_ns[s] == 0 || r.alive[s];
  }
  probe_holder(r, s, now);
  return r.alive[s];
}

int32_t GpuScheduler::probe_holder(Row& r, uint32_t s, uint64_t now) {
  if (r.probe_budget == 0) return 0;
  --r.probe_budget;
  probes_.fetch_add(1, std::memory_order_relaxed);
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = ledger::slot_lock_offset(s);
  fl.l_len = 1;
  // Cannot tell: take it for alive. It then only delays this tenant's own
  // revocation to the deadline, or lets its want count.
  const bool failed = fcntl(r.fd, F_GETLK, &fl) != 0;
  const bool alive = failed || fl.l_type != F_UNLCK;
  r.probed_ns[s] = now == 0 ? 1 : now;
  r.alive[s] = alive;
  r.holder[s] = !failed && alive ? fl.l_pid : 0;
  return r.holder[s];
}

namespace {

// One slot's requests folded into a tenant's (Row::requests_seen). Not
// poll_ns or last_active_ns: waiting and running processes renew those
// every few ms, which needs no pass of its own.
uint64_t fold_request(uint64_t fold, uint32_t slot, uint64_t want, uint64_t entered, uint64_t drained) {
  for (uint64_t word : {uint64_t{slot}, want, entered, drained}) fold = (fold ^ word) * 0x100000001b3ull;
  return fold;
}

}  // namespace

void GpuScheduler::observe(Row& r, uint64_t now) {
  const uint64_t since_ms = r.observed_ns == 0 || now < r.observed_ns ? 1 : (now - r.observed_ns) / 1'000'000;
  r.probe_budget = static_cast<uint32_t>(std::clamp<uint64_t>(since_ms * kProbesPerMs, kProbesPerMs, kMaxSlots));
  r.observed_ns = now;
  r.probe_refused = false;
  r.wants = false;
  r.has_live = false;
  r.waiting = 0;
  r.want_since = 0;
  r.last_active = 0;
  r.gpu_contexts = 0;
  if (r.usage == nullptr || r.entry < 0) {
    r.readable = false;
    r.high = 0;
    return;
  }
  const ledger::UsageSegment& u = *r.usage;
  const uint32_t entry = static_cast<uint32_t>(r.entry);
  uint32_t high = 0;
  uint64_t fold = 0;
  // A tenant may truncate its usage file: every touch of the mapping is
  // guarded, and a failed one makes the tenant one that does not want.
  const bool ok = shm::sigbus_guarded([&] {
    high = std::max(r.high_mark, std::min(u.slot_high_water.load(std::memory_order_acquire), kMaxSlots));
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
      const uint64_t entered_before = v.entered;
      v.entered = q.entered_grant.load(std::memory_order_seq_cst);
      v.drained = q.drained_grant.load(std::memory_order_seq_cst);
      // A slot found dead a moment ago may have a new owner that entered
      // the grant since: its liveness is looked at again, not remembered.
      if (v.entered != entered_before) r.probed_ns[s] = 0;
      v.contexts = q.contexts.load(std::memory_order_relaxed);
      fold = fold_request(fold, s, v.want, v.entered, v.drained);
    }
  });
  r.requests_seen = fold;
  if (!ok) {
    // The slots as last read stay (r.high too): a holder's process seen
    // entered and not drained is still waited for, to the deadline, rather
    // than the truncation ending its grant with its work still queued.
    r.readable = false;
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
  r.high_mark = high;
  for (uint32_t s = 0; s < high; ++s) {
    SlotView& v = r.slots[s];
    if (r.gstate != gputime::kGrantIdle && r.gseq != 0 && v.entered == r.gseq && !r.entered_seen[s]) {
      r.entered_seen.set(s);
      r.entered_holder[s] = probe_holder(r, s, now);
    }
    if (!v.live) continue;
    // Claims: no time after ours counts.
    v.want = std::min(v.want, now);
    v.poll = std::min(v.poll, now);
    v.active = std::min(v.active, now);
    r.last_active = std::max(r.last_active, v.active);
    // A process that ever asked for this GPU or entered a grant on it, and
    // its contexts there (claims: a process that hides is found outside the
    // gate; one that claims more sends every tenant back to turns, which
    // costs nobody a promise).
    if (v.poll != 0 || v.entered != 0)
      r.gpu_contexts += static_cast<uint32_t>(std::clamp<uint64_t>(v.contexts, 1, ledger::kMaxSlots));
    // A latency tenant with a live process keeps the others paced, asking
    // or not: an inference server's first request after a quiet spell must
    // not find a training queue of seconds ahead of it.
    if (!r.has_live && r.priority == gputime::kPriorityLatency && slot_alive(r, s, now)) r.has_live = true;
    // A want counts while its process renews it: a stopped process's does
    // not keep its tenant asking for grants it cannot take up.
    if (v.want == 0 || now - v.poll >= gputime::kWantFreshNs || !slot_alive(r, s, now)) continue;
    ++r.waiting;
    r.wants = true;
    r.want_since = r.want_since == 0 ? v.want : std::min(r.want_since, v.want);
  }
}

// A live process is done with the grant only when its words say so
// consistently: once seen to have entered this grant, when it reports this
// grant drained; otherwise when it drained what it entered last, and that
// is this grant or an earlier one (a process that has not entered this
// grant). Anything else (entered and not drained, a grant number from the
// future, a drain of a grant other than the one entered, an entry rewritten
// after it was seen) is waited for until the deadline: garbage in those
// words makes its own tenant hold the GPU longer and pay for it, where
// taking them for "not entered" would let its work run on into the next
// tenant's grant.
std::bitset<kMaxSlots> GpuScheduler::pending_drains(Row& r, uint64_t now) {
  std::bitset<kMaxSlots> pending;
  if (r.gseq == 0) return pending;
  // From where the last pass ran out of probes: a tenant whose garbage
  // marks every slot undone must not have its last slots never probed (taken
  // for alive) while the first ones take the whole budget, or its grants end
  // at the deadline long after its garbage is gone.
  const uint32_t from = r.probe_from;
  for (uint32_t i = 0; i < r.high; ++i) {
    const uint32_t s = (from + i) % r.high;
    const SlotView& v = r.slots[s];
    const bool not_entered = v.drained == v.entered && v.entered <= r.gseq;
    if (r.entered_seen[s] ? v.drained == r.gseq : not_entered) continue;
    if (!slot_alive(r, s, now)) continue;
    // The process seen to enter is gone and another owns its slot (the
    // kernel names another holder of its lock): the new one is judged by
    // its own words.
    if (r.entered_seen[s] && r.entered_holder[s] != 0 && r.holder[s] != 0 && r.holder[s] != r.entered_holder[s] &&
        not_entered)
      continue;
    pending.set(s);
  }
  return pending;
}

// ---- Policy ----

uint64_t GpuScheduler::effective_vtime(const Row& r) const {
  const uint64_t credit = gputime::scale(gputime::kReturnCreditNs, r.share);
  return std::max(r.vtime, min_vtime_ > credit ? min_vtime_ - credit : 0);
}

// Asks, may be granted (not blocked, within its limit) and holds no grant.
// A benched tenant (revoked for running ahead) counts only once its bench
// is over.
bool GpuScheduler::eligible(const Row& r, uint64_t now) const {
  return r.active && r.readable && r.wants && !r.blocked && r.gstate == gputime::kGrantIdle &&
         now >= r.bench_until && gputime::within_limit(r.cap_tat, r.limit, now, nullptr, burst(&r, r.limit, now));
}

// The charge for a sample naming a process outside the gate comes after
// the fact, one sample's worth at a time, and only by luck of the draw: a
// tenant charged so stays about level with the holder whose grants its
// process shares, and keeps winning turns for its gated processes while
// that process takes half of every other grant (on a driver that
// time-slices: honest 0.37 of the GPU against 0.5). What the gate cannot
// stop it can take its tenant's turns from: while a sample found such a
// process at work lately, its tenant's gated processes get the GPU only
// when nobody else asks, so the process itself is what the tenant's share
// pays for.
bool GpuScheduler::yields(const Row& r, uint64_t now) const {
  if (r.outside_named_ns == 0 || now < r.outside_named_ns) return false;
  const uint64_t period = sample_period();
  return now - r.outside_named_ns < std::max(kOutsideYieldPeriods * period, kOutsideYieldMinNs);
}

// Priority buys latency, not time: a tenant's priority counts only while
// it uses no more than its share of the GPU's time, measured as a rate with
// the limit's burst (gputime::within_limit at the share). Beyond it, it
// counts one lower, and virtual times decide as for everyone.
// A tenant that yields ranks below every priority.
int GpuScheduler::effective_rank(uint32_t t, uint64_t now) const {
  const Row& r = rows_[t];
  if (yields(r, now)) return -1;
  const int rank = gputime::priority_rank(r.priority);
  const bool within =
      r.share > 0 && gputime::within_limit(r.share_tat, r.share, now, nullptr, burst(nullptr, r.share, now));
  return within ? rank : std::max(rank - 1, 0);
}

int GpuScheduler::best_candidate(uint64_t now, int exclude) {
  int best = -1, best_rank = 0;
  uint64_t best_vtime = 0, best_since = 0;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    if (static_cast<int>(t) == exclude || !eligible(r, now)) continue;
    const int rank = effective_rank(t, now);
    const uint64_t vt = effective_vtime(r);
    // The highest priority first (as it counts now), then the least virtual
    // time; ties go to the longest wait: a tenant claiming an ancient want
    // wins ties only, which virtual times make rare.
    if (best >= 0 && (rank < best_rank ||
                      (rank == best_rank && (vt > best_vtime || (vt == best_vtime && r.want_since >= best_since)))))
      continue;
    best = static_cast<int>(t);
    best_rank = rank;
    best_vtime = vt;
    best_since = r.want_since;
  }
  return best;
}

int GpuScheduler::contender(uint64_t now, uint32_t holder) {
  const int other = best_candidate(now, static_cast<int>(holder));
  if (other >= 0 && yields(rows_[other], now) && !yields(rows_[holder], now)) return -1;
  return other;
}

uint32_t GpuScheduler::holders(uint32_t state) const {
  uint32_t n = 0;
  for (const Row& r : rows_) n += r.gstate == state ? 1 : 0;
  return n;
}

bool GpuScheduler::measuring(uint64_t now) const {
  return measured_charging_ && meter_ != nullptr && meter_ok_ns_ != 0 && now - meter_ok_ns_ < kMeterStaleNs;
}

uint64_t GpuScheduler::sample_period() const {
  return meter_ != nullptr ? std::min(meter_->sample_period_ns(), kMaxMeterPeriodNs) : 0;
}

uint64_t GpuScheduler::charged_period(uint64_t now) const {
  return measuring(now) ? sample_period() : 0;
}

uint64_t GpuScheduler::burst(const Row* r, uint32_t rate_ppm, uint64_t now) const {
  // Held mode charges by the pass, except where the audit's credits decide a
  // holder's standing: GPU time another tenant's work took from its grants
  // (a process outside the gate, a drain reported and not done) comes back
  // a sample's worth at a time, when a sample happens to name that work,
  // and a limit as tight as the passes' revokes an honest holder between two
  // credits (a 0.5 tenant capped at 0.5 beside a process outside the gate
  // lost about a sixth of its grants that way). So while some tenant yields
  // (a process outside the gate is at work: every holder may be owed such
  // credits, from the first sample that finds it), and for a tenant credited
  // within the last kCreditBurstPeriods sampling periods (a drain reported
  // and not done, too), the burst spans kOutsideYieldPeriods periods: the
  // limit holds on average over them, not sample by sample. The others keep
  // the tight one.
  const uint64_t period = sample_period();
  const bool credited = r != nullptr && r->credited_ns != 0 && now - r->credited_ns < kCreditBurstPeriods * period;
  if ((outside_work_ || credited) && auditing(now))
    return std::max(gputime::kLimitBurstNs, gputime::scale(kOutsideYieldPeriods * period, rate_ppm));
  return std::max(gputime::kLimitBurstNs, gputime::scale(2 * charged_period(now), rate_ppm));
}

uint64_t GpuScheduler::lead(uint64_t now) const { return std::max(kLeadNs, 2 * charged_period(now)); }

bool GpuScheduler::auditing(uint64_t now) const {
  return !measured_charging_ && meter_ != nullptr && meter_ok_ns_ != 0 && now - meter_ok_ns_ < kMeterStaleNs;
}

bool GpuScheduler::held_at(const Row& r, uint64_t t, bool* known) const {
  *known = true;
  // A sample's instant comes from another clock (NVML's CPU time stamps):
  // a grant within kAuditMarginNs of it counts. (Not more: a tenant whose
  // short grants come often would otherwise cover the time between them.)
  // A meter whose samples come far more often than any real driver's (a
  // test's exact stand-in, every few ms) reports use over the time since its
  // previous sample: a grant within that period counts too.
  const uint64_t period = meter_ != nullptr ? meter_->sample_period_ns() : 0;
  const uint64_t lookback = kAuditMarginNs + (period < kAuditInstantPeriodNs ? period + period / 2 : 0);
  const uint64_t lo = t > lookback ? t - lookback : 0, hi = t + kAuditMarginNs;
  uint64_t oldest = UINT64_MAX;
  for (const Row::Hold& h : r.holds) {
    if (h.from == 0) continue;
    oldest = std::min(oldest, h.from);
    if (h.from <= hi && (h.to == 0 || h.to > lo)) return true;
  }
  // Older than every grant it remembers, all of them in use: cannot tell.
  if (r.hold_next >= r.holds.size() && t < oldest) *known = false;
  return false;
}

bool GpuScheduler::others_held_since_grant(uint32_t t, uint64_t at) const {
  // The end of t's last grant before `at` (0: none it remembers).
  uint64_t since = 0;
  for (const Row::Hold& h : rows_[t].holds)
    if (h.from != 0 && h.to != 0 && h.to <= at) since = std::max(since, h.to);
  for (uint32_t o = 0; o < gputime::kMaxTenants; ++o) {
    if (o == t || !rows_[o].active) continue;
    for (const Row::Hold& h : rows_[o].holds)
      if (h.from != 0 && h.from <= at && (h.to == 0 || h.to > since)) return true;
  }
  return false;
}

void GpuScheduler::record_granted(uint64_t now, uint64_t dt) {
  granted_total_ += dt;
  const GrantedMark mark{now, granted_total_};
  if (granted_next_ == 0 || now >= granted_marked_at_ + kGrantedMarkNs) {
    granted_marks_[granted_next_ % granted_marks_.size()] = mark;
    granted_next_ += 1;
    granted_marked_at_ = now;
  } else {
    granted_marks_[(granted_next_ - 1) % granted_marks_.size()] = mark;  // the newest, brought up to now
  }
}

bool GpuScheduler::granted_time_until(uint64_t t, uint64_t* out) const {
  const uint32_t n = std::min<uint32_t>(granted_next_, granted_marks_.size());
  if (n == 0) return false;
  const auto mark = [&](uint32_t i) -> const GrantedMark& {  // i-th oldest
    return granted_marks_[(granted_next_ - n + i) % granted_marks_.size()];
  };
  if (t < mark(0).at) return false;
  if (t >= mark(n - 1).at) {
    *out = mark(n - 1).granted;
    return true;
  }
  uint32_t lo = 0, hi = n - 1;  // mark(lo).at <= t < mark(hi).at
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    (mark(mid).at <= t ? lo : hi) = mid;
  }
  const GrantedMark &a = mark(lo), &b = mark(hi);
  const uint64_t span = b.at - a.at, part = t - a.at;
  *out = a.granted + static_cast<uint64_t>(static_cast<unsigned __int128>(b.granted - a.granted) * part / span);
  return true;
}

uint64_t GpuScheduler::busy_beyond_grants(uint64_t busy, uint64_t at) const {
  const uint64_t period = sample_period();
  if (period == 0 || at <= period + kAuditMarginNs) return 0;
  uint64_t from = 0, to = 0;
  // A record that does not reach back over the period tells nothing.
  if (!granted_time_until(at - period - kAuditMarginNs, &from) || !granted_time_until(at + kAuditMarginNs, &to))
    return 0;
  // The driver's figure is a percentage of a period whose ends this clock
  // knows only roughly: a tenth of the period is left to that.
  const uint64_t allowed = (to - from) + period / 10;
  return busy > allowed ? busy - allowed : 0;
}

// Held mode's audit. A sample of the driver names the process that was on
// the GPU at its instant. A tenant's process named while its tenant held no
// grant ran outside the gate (a process without the interposer, or work a
// process let run past a drain it claimed): its tenant pays the sample's
// worth of GPU time (busy share x period: right on average over many
// samples), and the tenants that held the GPU at that instant, who paid
// for that time as held, get it back from their next charges. Each side's
// figure moves only by what the driver saw the other tenant's process do.
void GpuScheduler::file_use(uint32_t t, uint64_t busy, uint64_t at, uint64_t now, bool outside_gate) {
  Row& r = rows_[t];
  // A tenant alone on this GPU with no limit below a whole one: its
  // processes run ungated (as they decide it themselves) and never hold a
  // grant, so held time would charge it nothing and `fracgpu status` would
  // show an idle tenant on a busy GPU. It is charged the GPU time it used,
  // in either mode (read_meter() says how that is told): nobody else is
  // here to pay for or be credited with anything, so there is nothing to
  // audit either.
  if (!gated(r)) {
    r.named_ungated = gputime::saturating_add(r.named_ungated, busy);
    return;
  }
  if (measured_charging_) {
    r.pending_use = gputime::saturating_add(r.pending_use, busy);
    return;
  }
  r.measured = gputime::saturating_add(r.measured, busy);
  // Not in the moments after a restart or a change, before the tenant's
  // processes have noticed and asked.
  if (at < audit_from_ns_) return;
  // A process outside the gate found at work, whoever held the GPU then:
  // its tenant yields (yields()).
  if (outside_gate && busy > 0) {
    if (!yields(r, now) && (r.outside_logged_ns == 0 || now - r.outside_logged_ns > 60 * kSecond)) {
      r.outside_logged_ns = now;
      note(true, fmt::format("{}: tenant \"{}\" runs work on the GPU outside the gate: it gives way to every tenant "
                             "that asks until {} sampling periods pass without a sample finding that",
                             label_, r.name, kOutsideYieldPeriods));
    }
    r.outside_named_ns = now;
  }
  bool known = true;
  if (held_at(r, at, &known) || !known || at > now) return;
  // Named after its grant ended, with nobody else granted the GPU since:
  // a driver that names the process that ran last in the period (not the
  // one resident at the instant) names a tenant whose work ended with its
  // grant, so the name alone is no evidence. But the sample's busy share
  // covers its whole period, and the tenant's work can have kept the GPU
  // busy in it no longer than the tenant held grants there: what the GPU
  // was busy beyond that ran outside every grant, whichever process the
  // driver names. It took no other tenant's turn, so nobody is credited;
  // it is charged, so that work left running past a grant (a drain
  // reported and not done, long kernels queued to run on between grants)
  // counts against the tenant's share and limit.
  if (!others_held_since_grant(t, at)) {
    const uint64_t beyond = busy_beyond_grants(busy, at);
    if (beyond == 0) return;
    r.pending_out_of_grant = gputime::saturating_add(r.pending_out_of_grant, beyond);
    r.out_of_grant = gputime::saturating_add(r.out_of_grant, beyond);
    r.out_of_grant_samples += 1;
    return;
  }
  // A process outside the gate that NVML lists pays for its part of the
  // holders' grants as they are charged (charge()): the sample is counted,
  // not charged again.
  if (outside_gate && r.listed_outside_milli > 0) {
    r.out_of_grant_samples += 1;
    return;
  }
  r.pending_out_of_grant = gputime::saturating_add(r.pending_out_of_grant, busy);
  r.out_of_grant = gputime::saturating_add(r.out_of_grant, busy);
  r.out_of_grant_samples += 1;
  std::bitset<gputime::kMaxTenants> holders_then;
  for (uint32_t h = 0; h < gputime::kMaxTenants; ++h)
    holders_then[h] = h != t && rows_[h].active && held_at(rows_[h], at, &known) && known;
  for (uint32_t h = 0; h < gputime::kMaxTenants; ++h)
    if (holders_then[h]) {
      rows_[h].credit = std::min(rows_[h].credit + busy / holders_then.count(), kSecond);
      rows_[h].credited_ns = now;
    }
}

// Reads the meter (every kMeterIntervalNs) and files each process's GPU
// time under its tenant (pending_use, charged by charge()). A PID the
// daemon has not attributed yet (a process that started since its last
// tick) keeps its usage for kUnattributedKeepNs, so a process cannot run
// uncharged by being new; a sample of a known PID outside the lifetime of
// the process attribute() named is kept so too (another process behind the
// PID); usage of a PID that is nobody's (a process
// outside fracgpu: the bypass audit's business) counts only towards how
// busy the GPU is.
void GpuScheduler::read_meter(uint64_t now) {
  pass_busy_ = 0;
  fresh_reading_ = false;
  if (meter_ == nullptr || now - last_meter_ns_ < kMeterIntervalNs) return;
  last_meter_ns_ = now;
  readings_.clear();
  if (!meter_->read(now, &readings_)) {
    // Said once the failure has cost the audit (no good reading for
    // kMeterStaleNs), not at each failed read: a driver that misses one
    // answer now and then changes nothing.
    if (meter_failing_since_ns_ == 0) meter_failing_since_ns_ = now;
    if (!meter_down_ && now - meter_failing_since_ns_ >= kMeterStaleNs) {
      meter_down_ = true;
      const std::string why = meter_->problem();
      note(true, fmt::format("{}: NVML's per-process samples cannot be used ({}): GPU time is charged as held and "
                             "not audited until they can", label_, why.empty() ? "no answer" : why));
    }
    return;
  }
  meter_failing_since_ns_ = 0;
  if (std::exchange(meter_down_, false))
    note(false, fmt::format("{}: NVML's per-process samples can be used again", label_));
  if (std::string w = meter_->warning(); w != meter_warning_) {
    if (!w.empty()) note(true, fmt::format("{}: {}", label_, w));
    meter_warning_ = std::move(w);
  }
  meter_ok_ns_ = now;
  fresh_reading_ = true;
  // What was filed for ungated tenants since the last reading came from
  // attribute(): samples of a process of theirs from before the daemon knew
  // it, counted then as another's (below). Added back as they are.
  for (Row& r : rows_) {
    r.pending_ungated = gputime::saturating_add(r.pending_ungated, r.named_ungated);
    r.named_ungated = 0;
  }
  for (const ProcessUse& u : readings_) {
    // One reading cannot hold more than the time since the previous one
    // could: a driver figure out of range is clamped, not trusted.
    const uint64_t busy = std::min<uint64_t>(u.busy_ns, kSecond);
    const uint64_t at = u.at_ns != 0 ? std::min(u.at_ns, now) : now;
    pass_busy_ += busy;
    // What the GPU did over whole periods of this phase (side by side).
    (side_ ? side_phase_ : turns_).add(at, busy);
    if (auto it = pid_rows_.find(u.pid); it != pid_rows_.end() && names_then(u.pid, at)) {
      file_split_use(u.pid, it->second, busy, at, now);
      if (side_ && at >= side_phase_.from) check_side_shares(it->second, now);
    } else if (unattributed_.size() < 4096 || unattributed_.count(u.pid) != 0) {
      Unattributed& un = unattributed_[u.pid];
      if (un.since == 0) un.since = now;
      un.busy_ns = gputime::saturating_add(un.busy_ns, busy);
      if (un.uses.size() < 32) un.uses.emplace_back(at, busy);
    }
  }
  std::erase_if(unattributed_, [&](const auto& kv) { return now - kv.second.since > kUnattributedKeepNs; });
  room_busy_ += pass_busy_;
  // An ungated tenant (file_use()) is charged the GPU's busy time less what
  // the samples named other processes for (the device's figure counts the
  // periods whose instant found the GPU idle, which name nobody: the
  // per-process figure of a lone process busy 0.5 of the time reads 0.25).
  // A process of its own not yet attributed counts as another's until the
  // daemon attributes it (its first tens of ms), and is added back then
  // (attribute() files the samples kept for it). Without the device's
  // figure, what the samples named its processes for.
  // The device's figure is asked for only while such a tenant is here
  // (another NVML call every reading: on most GPUs nobody needs it).
  uint64_t device = 0;
  bool device_known = false, asked = false;
  for (Row& r : rows_) {
    if (r.active && !gated(r)) {
      if (!std::exchange(asked, true)) device_known = meter_->device_busy(&device);
      const uint64_t others = pass_busy_ > r.named_ungated ? pass_busy_ - r.named_ungated : 0;
      const uint64_t used = !device_known ? r.named_ungated : device > others ? device - others : 0;
      r.pending_ungated = gputime::saturating_add(r.pending_ungated, used);
    }
    r.named_ungated = 0;
  }
}

// What each tenant pays for the interval since the last pass.
//  - held mode: every holder (granted or revoking) the whole interval;
//  - measured mode: its measured GPU time; and a tenant that held the GPU
//    alone while another eligible tenant waited pays at least the time the
//    others did not use: the GPU was its to use, and it kept the waiting
//    tenant off it (max(measured, denied)).
void GpuScheduler::charge(uint64_t now) {
  const uint64_t dt = now > last_pass_ns_ ? now - last_pass_ns_ : 0;
  const bool measured = measuring(now);
  int alone = -1;
  bool someone_waits = false, someone_held = false;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    if (r.gstate != gputime::kGrantIdle) r.held += dt;
    someone_held |= r.gstate != gputime::kGrantIdle;
    if (r.gstate == gputime::kGranted) alone = alone == -1 ? static_cast<int>(t) : -2;
    if (eligible(r, now)) someone_waits = true;
  }
  record_granted(now, someone_held ? dt : 0);
  // Time held alone while another waited, since the last reading: settled
  // against the GPU time the next reading says the others used meanwhile
  // (a reading covers the time since the previous one, so the two line up).
  if (alone >= 0 && someone_waits) rows_[alone].alone_ns += dt;
  // Held mode has a holder granted beside one revoking only when a latency
  // tenant took the GPU (step()). Until the revoked holder has drained, the
  // GPU runs its work: on a driver without compute preemption all of it
  // first, so it pays alone and the latency tenant pays from then on. A
  // driver that time-slices contexts runs both by turns meanwhile, so they
  // split the time in equal parts (the driver's turns are per context, not
  // per share). Charged to the drainer alone there, the overlap was the
  // latency tenant's for free, and the more often it took the GPU and the
  // slower the drains (a loaded host), the more it got beyond its share.
  // A tenant that missed its drain deadline (complete_revoke) is in the
  // same place until it reports the drain: its late work runs beside the
  // holders' by turns, or ahead of theirs on a driver without compute
  // preemption. Charged to the holders, that work took their time for free:
  // a tenant whose one long kernel ran on past each grant, timed to end
  // before the next sampling instant, kept 0.98 of the GPU on the queue
  // model, the honest holder 0.01.
  uint64_t overdue = 0;
  if (!measured && !side_)
    for (const Row& r : rows_) overdue += r.pays_late() ? 1 : 0;
  const uint64_t drainers = holders(gputime::kGrantRevoking) + overdue;
  const bool draining = !measured && !side_ && drainers > 0;
  const uint64_t overlap_payers = draining && driver_slices_ ? drainers + holders(gputime::kGranted) : 0;
  // Side by side, the holders share each interval in proportion to their
  // shares (equal parts: side_by_side_fits()), which is how the driver's
  // time slices divide it between them when each has work.
  uint64_t side_shares = 0;
  if (side_ && !measured)
    for (const Row& r : rows_) side_shares += r.gstate == gputime::kGranted ? r.share : 0;
  // Processes outside the gate that NVML lists on this GPU take the
  // driver's turns in every holder's grant, whatever their timing: no
  // sample need name them. A holder pays its contexts' part of the time
  // (c / (c + k), c its contexts, k those processes of other tenants), and
  // the tenants of those processes the rest, in proportion.
  uint64_t listed_outside = 0;
  if (!measured)
    for (const Row& r : rows_) listed_outside += r.active ? r.listed_outside_milli : 0;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    // An ungated tenant's GPU time (read_meter()). One that holds a grant
    // (a limit or a neighbour came meanwhile and its processes now ask)
    // pays the time it holds, or measured mode's figure, instead: this
    // would be paid twice.
    if (const uint64_t ungated = std::exchange(r.pending_ungated, 0); ungated > 0 && r.gstate == gputime::kGrantIdle)
      charge_ungated(r, ungated);
    if (!measured) {
      r.pending_use = 0;
      r.alone_ns = 0;
      const bool drains = r.gstate == gputime::kGrantRevoking || (overdue > 0 && r.pays_late());
      uint64_t ns = drains ? dt / drainers : r.gstate == gputime::kGranted && !draining ? dt : 0;
      if (overlap_payers > 0 && (drains || r.gstate == gputime::kGranted)) ns = dt / overlap_payers;
      if (side_shares > 0 && r.gstate == gputime::kGranted)
        ns = static_cast<uint64_t>(static_cast<unsigned __int128>(dt) * r.share / side_shares);
      const uint64_t others = listed_outside - (r.active ? r.listed_outside_milli : 0);
      if (ns > 0 && others > 0) {
        const uint64_t contexts = uint64_t{std::max<uint32_t>(r.gpu_contexts, 1)} * 1000;
        const uint64_t theirs = static_cast<uint64_t>(static_cast<unsigned __int128>(ns) * others / (contexts + others));
        ns -= theirs;
        for (uint32_t u = 0; u < gputime::kMaxTenants; ++u) {
          Row& o = rows_[u];
          if (u == t || !o.active || o.listed_outside_milli == 0) continue;
          const uint64_t part = static_cast<uint64_t>(static_cast<unsigned __int128>(theirs) * o.listed_outside_milli / others);
          o.pending_out_of_grant = gputime::saturating_add(o.pending_out_of_grant, part);
          o.out_of_grant = gputime::saturating_add(o.out_of_grant, part);
        }
      }
      const uint64_t credit = std::min(ns, r.credit);
      r.credit -= credit;
      ns = gputime::saturating_add(ns - credit, std::exchange(r.pending_out_of_grant, 0));
      if (ns > 0) charge_row(r, ns, now, contended(t));
      continue;
    }
    if (!fresh_reading_) continue;
    uint64_t ns = r.pending_use;
    r.measured += r.pending_use;
    if (r.alone_ns > 0) {
      const uint64_t others = pass_busy_ > r.pending_use ? pass_busy_ - r.pending_use : 0;
      ns = std::max(ns, r.alone_ns > others ? r.alone_ns - others : 0);
    }
    r.pending_use = 0;
    r.alone_ns = 0;
    if (ns > 0) charge_row(r, ns, now, contended(t));
  }
}

// Used and measured (the figures either mode shows), and nothing else: the
// virtual time and the allowances order tenants that take turns, and this
// one takes none. Charged there, its time alone would be a debt once a
// neighbour comes (it never contends, so the floor for tenants coming back
// never rose with it): after 1.6 s alone at a whole GPU's share it would
// wait while a newcomer at half caught up for 0.8 s.
void GpuScheduler::charge_ungated(Row& r, uint64_t ns) {
  r.used = gputime::saturating_add(r.used, ns);
  r.measured = gputime::saturating_add(r.measured, ns);
}

bool GpuScheduler::gated(const Row& r) const { return gputime::gated(active_count_, r.limit); }

uint32_t GpuScheduler::contenders() const {
  return static_cast<uint32_t>(std::count_if(rows_.begin(), rows_.end(), [](const Row& r) { return contends(r); }));
}

void GpuScheduler::charge_row(Row& r, uint64_t ns, uint64_t now, bool contended) {
  r.used += ns;
  r.vtime = gputime::saturating_add(r.vtime, gputime::scale(ns, r.share));
  // Held mode charges a holder all the time it holds the GPU, so it cannot
  // fall behind its limit while it holds: the credit counts from its grant
  // (or the wait before it). Measured mode charges what the holder used:
  // there the floor moves with the clock, from the start of the time charged
  // now (`ns` before now) and further back by its wait before the grant, so
  // a holder using less than its limit banks no more than the burst however
  // long its grant (from the grant's start, a tenant capped at 0.3 that used
  // 0.2 for 10 s within one grant could then take the whole GPU for seconds).
  uint64_t credit = r.credit_from != 0 ? std::min(r.credit_from, now) : now;
  if (measuring(now)) {
    const uint64_t kept_off = r.grant_ns - std::min(r.credit_from, r.grant_ns);  // the wait before its grant
    const uint64_t back = gputime::saturating_add(ns, kept_off);
    credit = now > back ? now - back : 0;
  }
  r.cap_tat = gputime::advance_limit(r.cap_tat, ns, r.limit, credit, burst(&r, r.limit, now));
  // GPU time used while nobody else wanted the GPU took nothing from anyone:
  // it does not count against the share's rate, which decides whether the
  // tenant's priority counts (a training tenant that had the GPU to itself
  // is not beyond its share once an inference tenant comes).
  if (contended) r.share_tat = gputime::advance_limit(r.share_tat, ns, r.share, now, burst(nullptr, r.share, now));
}

bool GpuScheduler::contends(const Row& r) {
  return r.active && ((r.wants && !r.blocked) || r.gstate != gputime::kGrantIdle);
}

bool GpuScheduler::contended(uint32_t self) const {
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    if (t != self && contends(r)) return true;
  }
  return false;
}

// Throttled time: a tenant wanted the GPU and did not hold it (another
// did, or its limit kept it off). Its claimed want time counts from the
// last pass at the earliest, so a claim cannot add more than we saw.
void GpuScheduler::account_waits(uint64_t now) {
  const bool someone_holds = holders(gputime::kGranted) + holders(gputime::kGrantRevoking) > 0;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    const bool holds = r.gstate != gputime::kGrantIdle;
    if (!r.active || !r.wants || holds) {
      if (!r.wants) r.kept_off_since = 0;
      continue;
    }
    const uint64_t from = std::max(last_pass_ns_, r.want_since);
    if (now > from) r.throttled += now - from;
    // Kept off by another tenant's grant, not by its own limit: the limit's
    // allowance keeps accruing meanwhile (see gputime::advance_limit).
    if (someone_holds && r.kept_off_since == 0 &&
        gputime::within_limit(r.cap_tat, r.limit, now, nullptr, burst(&r, r.limit, now)))
      r.kept_off_since = from;
  }
}

// A tenant taking turns for having taken more than its part of the
// driver's turns side by side (check_side_shares(): a process of it set its
// own contexts' slice longer) would take more than the equal half of the
// GPU while its late work ran beside the next holder's grant, and pay half.
// So the next holder waits for its drain longer, while it pays alone. Only
// its own drain waits: a tenant barred unjustly (a neighbour that dodged
// the sampling instants made it look greedy) pays for no more than the
// GPU time its queue takes, alone on the GPU.
uint64_t GpuScheduler::drain_deadline(const Row& r, uint64_t now) const {
  return r.side_barred_until > now ? kBarredDrainDeadlineNs : gputime::kDrainDeadlineNs;
}

// A tenant that missed a drain deadline is granted again only once one of
// the processes that missed it reports the drain, or all of them are gone
// (dead, or their slot taken by a new process, which clears its requests).
void GpuScheduler::check_blocked(Row& r, uint64_t now) {
  if (r.overdue_since != 0 && (!r.blocked || now - r.overdue_since >= std::max(kOverdueChargeMaxNs, 2 * sample_period())))
    end_overdue(r, now);
  if (!r.blocked || !r.readable) return;
  bool progress = false;
  const uint32_t from = r.probe_from;  // round the slots, as pending_drains
  for (uint32_t i = 0; i < kMaxSlots; ++i) {
    const uint32_t s = (from + i) % kMaxSlots;
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
  end_overdue(r, now);
  note(false, fmt::format("{}: tenant \"{}\" {}: it may be granted the GPU again", label_, r.name,
                          progress ? "reported its late drain" : "has none of the processes that missed the deadline left"));
}

// The late work is done (or no longer charged as such): the hold that
// stayed open for it ends, and samples naming the tenant from now on are
// the audit's business again.
void GpuScheduler::end_overdue(Row& r, uint64_t now) {
  if (r.overdue_since == 0) return;
  r.overdue_since = 0;
  if (r.gstate == gputime::kGrantIdle) r.end_last_hold(now);
}

void GpuScheduler::publish_grant(uint32_t t, bool change) {
  Row& r = rows_[t];
  const uint64_t word = gputime::grant_word(r.gseq, t, r.gstate);
  // seq_cst: the daemon's half of the drain handshake (gputime.h).
  seg_.tenants[t].grant.store(word, std::memory_order_seq_cst);
  seg_.grant.turn.fetch_add(1, std::memory_order_seq_cst);
  gputime::wake_turn(seg_);
  if (!change) return;  // a repair of a damaged word
  last_word_ = word;
  seg_.grant.word.store(word, std::memory_order_relaxed);
  // A change of who holds the GPU starts a new room window.
  room_since_ = last_pass_ns_;
  room_busy_ = 0;
}

void GpuScheduler::note_wait(Row& r, uint64_t now) {
  if (r.priority != gputime::kPriorityLatency || r.want_since == 0) return;
  // A claimed want time: clamped (it only ever skews this tenant's figures).
  const uint64_t wait = std::min(now - std::min(r.want_since, now), 10 * kSecond);
  if (r.waits.size() < gputime::kWaitWindow)
    r.waits.push_back(wait);
  else
    r.waits[r.wait_count % gputime::kWaitWindow] = wait;
  r.wait_count += 1;
}

void GpuScheduler::grant(uint32_t t, uint64_t now) {
  Row& r = rows_[t];
  note_wait(r, now);
  r.vtime = effective_vtime(r);  // lifted, if it comes back from idle
  r.slices += 1;
  r.credit_from = r.kept_off_since != 0 ? r.kept_off_since : now;
  r.kept_off_since = 0;
  seq_ = std::min(seq_ + 1, gputime::kMaxGrantSeq);
  r.gseq = seq_;
  r.gstate = gputime::kGranted;
  r.grant_ns = now;
  r.revoke_ns = 0;
  r.entered_seen.reset();
  r.holds[r.hold_next % r.holds.size()] = {now == 0 ? 1 : now, 0};
  r.hold_next += 1;
  ++handovers_;
  last_grant_ns_ = now;
  publish_grant(t);
  room_since_ = now;
}

void GpuScheduler::end_grant(uint32_t t, uint64_t now) {
  Row& r = rows_[t];
  r.end_last_hold(now);
  r.gstate = gputime::kGrantIdle;
  r.revoke_ns = 0;
  publish_grant(t);
}

void GpuScheduler::start_revoke(uint32_t t, uint64_t now) {
  Row& r = rows_[t];
  r.gstate = gputime::kGrantRevoking;
  r.revoke_ns = now;
  last_revoke_ns_ = now;
  publish_grant(t);
  room_since_ = now;
  // Read the holder's entered_grant again *after* that store: a process
  // that entered before it is seen now (gputime.h), and its drain awaited.
  observe(r, now);
  const std::bitset<kMaxSlots> pending = pending_drains(r, now);
  if (pending.none()) complete_revoke(t, now, false, pending);
}

void GpuScheduler::complete_revoke(uint32_t t, uint64_t now, bool missed, const std::bitset<kMaxSlots>& pending) {
  Row& h = rows_[t];
  // Measured mode: a drain that outlasts the deadline (typically one queued
  // behind the other holders' work) is no loss to anyone: whatever its work
  // does on the GPU is measured and charged to it. The revocation just ends.
  if (missed && measuring(now)) missed = false;
  if (missed) {
    // Charged through the deadline (held mode; measured mode charges what
    // its work used); not granted again until it shows progress.
    h.blocked = true;
    h.blocked_seq = h.gseq;
    h.missed = pending;
    h.missed_deadlines += 1;
    h.overdue_since = now;
    note(true, fmt::format("{}: tenant \"{}\": {} process(es) did not drain grant {} within {} ms; the GPU goes on "
                           "without them, and the tenant waits until they report it",
                           label_, h.name, pending.count(), h.gseq, drain_deadline(h, now) / 1'000'000));
  }
  end_grant(t, now);
  // Its work still runs: it pays for it from here (charge()), and the hold
  // stays open, so that the audit charges the same work no second time.
  if (Row::Hold* last = h.last_hold(); h.overdue_since != 0 && last != nullptr) last->to = 0;
}

// The checks on one tenant's grant: configuration, limit, idleness, drains.
void GpuScheduler::step_row(uint32_t t, uint64_t now) {
  Row& h = rows_[t];
  if (h.gstate == gputime::kGranted) {
    if (!h.active || !h.readable || !gputime::within_limit(h.cap_tat, h.limit, now, nullptr, burst(&h, h.limit, now))) {
      start_revoke(t, now);
      return;
    }
    // Nothing left to wait for: every process that entered the grant has
    // drained it or died (an exit reports its drain), and none asks. The
    // grant ends now, still through the handshake: what this pass read came
    // before the word changes, and a process of the tenant may enter the
    // grant in between (a granted word needs no asking); start_revoke reads
    // the slots again after its store and ends at once if none did.
    if (!h.wants && pending_drains(h, now).none()) {
      // A grant given up before kIdleNs costs kIdleNs: every hand-over
      // leaves the GPU idle while the next holder's processes wake, and a
      // tenant that gives its grants up at once (reporting drains it has
      // not done: the false drain) would otherwise make that idle time
      // everybody's, as often as it likes.
      if (now - h.grant_ns < gputime::kIdleNs) charge_row(h, gputime::kIdleNs - (now - h.grant_ns), now, true);
      start_revoke(t, now);
      return;
    }
    const int other = contender(now, t);
    const uint64_t idle_for = now - std::max(h.grant_ns, h.last_active);
    if (!h.wants && idle_for >= gputime::kIdleNs && (other >= 0 || idle_for >= gputime::kLoneIdleNs))
      start_revoke(t, now);
    return;
  }
  if (h.gstate == gputime::kGrantRevoking) {
    const std::bitset<kMaxSlots> pending = pending_drains(h, now);
    if (pending.none()) {
      complete_revoke(t, now, false, pending);
    } else if (now - h.revoke_ns >= drain_deadline(h, now)) {
      complete_revoke(t, now, true, pending);
    }
  }
}

void GpuScheduler::step(uint64_t now) {
  outside_work_ = std::any_of(rows_.begin(), rows_.end(), [&](const Row& r) { return r.active && yields(r, now); });
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t)
    if (rows_[t].gstate != gputime::kGrantIdle) step_row(t, now);
  const bool measured = measuring(now);
  // Side by side begins or ends first: the priorities below see its holders.
  if (!measured) step_side_by_side(now);
  // The least virtual time among the others that ask or hold: what a
  // tenant's lead and a slice's end are measured against.
  auto least_other = [&](uint32_t self) {
    uint64_t least = UINT64_MAX;
    for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
      const Row& r = rows_[t];
      if (t == self || !r.active || r.blocked) continue;
      if (r.gstate == gputime::kGranted || eligible(r, now)) least = std::min(least, effective_vtime(r));
    }
    return least;
  };
  if (measured) {
    // Fairness on measured time: a holder more than kLeadNs (of GPU time,
    // at its share) ahead of another that asks or holds is revoked and
    // benched for kBenchNs, or until the others caught up.
    for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
      Row& r = rows_[t];
      if (r.bench_until != 0 && (now >= r.bench_until || least_other(t) == UINT64_MAX || r.vtime <= least_other(t)))
        r.bench_until = 0;
      if (r.gstate != gputime::kGranted) continue;
      const uint64_t least = least_other(t);
      if (least != UINT64_MAX && r.vtime > gputime::saturating_add(least, gputime::scale(lead(now), r.share))) {
        r.bench_until = now + kBenchNs;
        start_revoke(t, now);
      }
    }
  }
  // Priorities: a waiting tenant that ranks above the lone holder (as
  // ranks count now: within its share) takes the GPU at once. A latency
  // tenant is granted without waiting for the holder's drain: the holder's
  // gate is closed, so what the GPU still has to run is its queued work
  // (kept short by pacing, below), which it pays for until it has drained;
  // the latency tenant's kernels queue behind it (on a real GPU the driver
  // time-slices the two contexts meanwhile). A normal tenant taking the GPU
  // from a batch one waits for the drain, as at a slice's end (in held
  // mode; measured mode grants the next at once, below, and charges the
  // revoked holder's tail by measurement).
  if (holders(gputime::kGranted) == 1 && holders(gputime::kGrantRevoking) == 0) {
    for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
      if (rows_[t].gstate != gputime::kGranted) continue;
      const int other = best_candidate(now, static_cast<int>(t));
      const int other_rank = other >= 0 ? effective_rank(static_cast<uint32_t>(other), now) : -1;
      if (other_rank <= effective_rank(t, now)) break;
      start_revoke(t, now);
      if (other_rank == gputime::kLatencyRank && rows_[t].gstate == gputime::kGrantRevoking)
        grant(static_cast<uint32_t>(other), now);
      break;
    }
  } else if (measured && holders(gputime::kGranted) > 0) {
    // Measured mode with holders beside each other (the GPU had room), or
    // one beside a holder still leaving: a latency tenant within its share
    // takes the GPU from every holder ranked below it, at once, as it does
    // from a lone one (each pays for its measured tail).
    const int other = best_candidate(now, -1);
    if (other >= 0 && effective_rank(static_cast<uint32_t>(other), now) == gputime::kLatencyRank) {
      for (uint32_t t = 0; t < gputime::kMaxTenants; ++t)
        if (rows_[t].gstate == gputime::kGranted && effective_rank(t, now) < gputime::kLatencyRank)
          start_revoke(t, now);
      if (holders(gputime::kGranted) == 0) grant(static_cast<uint32_t>(other), now);
    }
  } else if (!measured && holders(gputime::kGranted) == 0 && holders(gputime::kGrantRevoking) >= 1) {
    // The holder is leaving already (its slice ended, its limit was
    // reached; or the holders side by side are): a latency tenant does not
    // wait for its drain either.
    for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
      if (rows_[t].gstate != gputime::kGrantRevoking) continue;
      const int other = best_candidate(now, static_cast<int>(t));
      if (other >= 0 && effective_rank(static_cast<uint32_t>(other), now) == gputime::kLatencyRank &&
          effective_rank(t, now) < gputime::kLatencyRank)
        grant(static_cast<uint32_t>(other), now);
      break;
    }
  }
  // A slice's end: a lone holder gives way to a tenant with a smaller
  // virtual time that waits.
  const uint32_t granted = holders(gputime::kGranted);
  if (granted == 1 && !side_) {
    for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
      Row& h = rows_[t];
      if (h.gstate != gputime::kGranted) continue;
      const int other = contender(now, t);
      if (other >= 0 && now - h.grant_ns >= slice_ns_ && effective_vtime(rows_[other]) < effective_vtime(h) &&
          !(measured && room(now)) && holders(gputime::kGrantRevoking) == 0)
        start_revoke(t, now);
    }
  }
  // Grants. Held mode: one holder at a time, the next once the last drained.
  // Measured mode: the next at once, and more while the GPU has room.
  // Side by side: every tenant that asks, at once.
  const uint32_t busy = holders(gputime::kGranted) + (measured ? 0 : holders(gputime::kGrantRevoking));
  for (const Row& r : rows_)
    if (r.active && !yields(r, now) && (r.gstate != gputime::kGrantIdle || eligible(r, now))) unyielding_seen_ns_ = now;
  if (side_ && !measured) {
    for (int best = best_candidate(now, -1); best >= 0; best = best_candidate(now, -1))
      grant(static_cast<uint32_t>(best), now);
  } else if (busy == 0 || (measured && room(now))) {
    const int best = best_candidate(now, -1);
    if (best >= 0 && !(yields(rows_[best], now) && now - unyielding_seen_ns_ < kYieldGapNs))
      grant(static_cast<uint32_t>(best), now);
  }
}

// ---- Side by side (docs/sm-time.md, "Side by side") ----
//
// Without MPS the driver gives the GPU to one context at a time and switches
// to another as soon as the resident one runs out of work, or at the end of
// its time slice (1024 us) while another has work; a kernel is cut there and
// resumed later (compute preemption, since Pascal). So tenants that each
// have one process on the GPU and equal shares, holding the GPU together,
// get equal turns of it whenever both have work, and a light one's idle
// moments go to the other at once: what turns through the daemon (one
// holder, a host round trip per hand-over) cannot give. Nothing a tenant
// writes decides it beyond its own standing: the choice rests on the
// driver's own busy figure over whole sampling periods (which a process
// cannot time its work around), the daemon's count of each tenant's
// processes there, and the configuration.

bool GpuScheduler::side_by_side_fits(uint64_t now, bool starting) const {
  if (!side_allowed_ || !driver_slices_ || !auditing(now)) return false;
  uint32_t members = 0, share = 0;
  for (const Row& r : rows_) {
    if (!contends(r)) continue;
    // One context each (a tenant with two gets two turns of the driver's),
    // none outside the gate, ordinary priority (latency and batch tenants
    // are served by turns), and equal shares (the driver's turns are equal).
    if (r.gpu_contexts > 1 || r.outside || r.priority != gputime::kPriorityNormal || r.blocked) return false;
    // Named more than its part while another was kept short (check_side_shares()).
    if (r.side_barred_until > now) return false;
    if (share == 0) share = r.share;
    if (r.share > share + share / 200 || r.share + share / 200 < share) return false;
    ++members;
  }
  // Each pays its part of the time they hold together (charge()): the
  // limits must allow it (two tenants of 0.25 capped there take turns).
  for (const Row& r : rows_)
    if (contends(r) &&
        static_cast<uint64_t>(r.limit) * members + r.limit / 200 * members < r.share)
      return false;
  return !starting || members >= 2;
}

void GpuScheduler::PhaseBusy::add(uint64_t at, uint64_t used) {
  if (at < from) return;  // the period mixes in what went before
  busy = gputime::saturating_add(busy, used);
  samples += 1;
  first_at = first_at == 0 ? at : std::min(first_at, at);
  last_at = std::max(last_at, at);
}

uint64_t GpuScheduler::covered(const PhaseBusy& phase, uint64_t now) const {
  const uint64_t period = meter_ != nullptr ? meter_->sample_period_ns() : 0;
  if (period == 0 || phase.samples < 2 || now < phase.from) return 0;
  // A driver's sample is the busy share of the period before its instant:
  // n samples cover n periods. Samples that named nobody (the GPU idle at
  // their instant) do not come: the periods from the first sample's to the
  // last's are then more, and count. A meter that reads far more often than
  // any driver samples (an exact one) gives each process's time since its
  // last reading: together they cover the time from the first to the last.
  const uint64_t span = phase.last_at - phase.first_at + period;
  // Two whole periods at least, so that one sample's luck does not decide.
  if (span < 2 * period) return 0;
  return period < kAuditInstantPeriodNs ? span
                                        : std::max<uint64_t>(span, static_cast<uint64_t>(phase.samples) * period);
}

int64_t GpuScheduler::busy_ppm(const PhaseBusy& phase, uint64_t now) const {
  const uint64_t span = covered(phase, now);
  if (span == 0) return -1;
  return static_cast<int64_t>(static_cast<unsigned __int128>(phase.busy) * kPpm / span);
}

bool GpuScheduler::turns_leave_room(uint64_t now) const {
  const int64_t busy = busy_ppm(turns_, now);
  return busy >= 0 && busy < kSideRoomPpm;
}

// Tenants that fill their turns gain by taking them: side by side, the
// driver's switches cost them a few points of the GPU. But a light tenant
// beside one that floods fills the turns only on the flooder's side, and
// side by side the driver gives the flooder the light one's idle moments at
// once (and the light one the driver's equal split, no less than without
// fracgpu). Either way each gets its share, so the pair takes turns only
// where they keep the GPU busier than the last side-by-side phase did, by
// more than kSideGainPpm (the measures' own spread). Both
// figures are the driver's period averages, which no tenant can time its
// work around.
bool GpuScheduler::turns_no_busier(uint64_t now) const {
  const int64_t turns = busy_ppm(turns_, now);
  return turns >= 0 && side_busy_ppm_ >= 0 && turns <= side_busy_ppm_ + kSideGainPpm;
}

void GpuScheduler::step_side_by_side(uint64_t now) {
  const uint64_t period = sample_period();
  // The first period of a phase mixes in what went before.
  auto start_turns = [&] {
    side_ = false;
    phase_since_ = now;
    turns_.restart(now + period);
    turns_held_taken_ = false;
  };
  // The tenants changed: what they did before says nothing.
  auto forget = [&] {
    side_rounds_ = 0;
    side_busy_ppm_ = -1;
  };
  if (side_) {
    const uint64_t first = std::max(kMinSidePhaseNs, kSidePhasePeriods * period);
    const uint64_t phase =
        std::min(first << std::min<uint32_t>(side_rounds_ > 0 ? side_rounds_ - 1 : 0, 2), std::max(first, kMaxSidePhaseNs));
    const bool fits = side_by_side_fits(now, false);
    if (!fits) forget();
    if (fits && now - phase_since_ < phase) return;
    if (fits) side_busy_ppm_ = busy_ppm(side_phase_, now);
    // Back to turns. At the phase's end the holder with the least virtual
    // time keeps the GPU and the others leave it (drain handshake); for a
    // tenant that does not fit, all leave, so that a latency tenant is
    // granted at once (step()) and any other in virtual-time order.
    start_turns();
    contended_ns_ = now;  // they were together until now: a moment alone in the hand-over is no change
    int keep = -1;
    for (uint32_t t = 0; t < gputime::kMaxTenants && fits; ++t)
      if (rows_[t].gstate == gputime::kGranted &&
          (keep < 0 || effective_vtime(rows_[t]) < effective_vtime(rows_[static_cast<uint32_t>(keep)])))
        keep = static_cast<int>(t);
    for (uint32_t t = 0; t < gputime::kMaxTenants; ++t)
      if (rows_[t].gstate == gputime::kGranted && static_cast<int>(t) != keep) start_revoke(t, now);
    return;
  }
  if (!turns_held_taken_ && now >= turns_.from) {
    // What each holds from here on is measured with the GPU's busy share.
    turns_held_taken_ = true;
    turns_held_at_ = now;
    for (Row& r : rows_) r.turns_held0 = r.held;
  }
  if (phase_since_ == 0 || !side_by_side_fits(now, false)) {
    // A tenant that must not share: turns, measured afresh once it is gone.
    start_turns();
    forget();
    return;
  }
  // A tenant that missed a drain deadline is still there: it asks, and its
  // work is still running down (a flooder's 100 ms queue at each hand-over).
  uint32_t present = 0;
  for (const Row& r : rows_)
    if (r.active && (r.wants || r.gstate != gputime::kGrantIdle)) ++present;
  if (present >= 2) contended_ns_ = now;
  if (!side_by_side_fits(now, true)) {
    // One tenant, or none, asks: what the GPU does now says nothing about
    // turns between several. A moment alone (a hand-over, a pause between
    // two steps) keeps what was measured; a longer one starts afresh.
    if (now - contended_ns_ > kAloneResetNs) {
      start_turns();
      forget();
    }
    return;
  }
  contended_ns_ = now;
  if (!turns_leave_room(now) && !turns_no_busier(now)) {
    // Measured: no room, and turns keep the GPU busier than side by side
    // did (the tenants have changed, or fill their turns); phases start short.
    if (covered(turns_, now) > 0) side_rounds_ = 0;
    return;
  }
  set_side_least_shares(now);
  side_ = true;
  phase_since_ = now;
  side_phase_.restart(now + period);
  side_rounds_ = std::min<uint32_t>(side_rounds_ + 1, 3);
}

// Side by side the driver shares the GPU by its own turns, which are equal
// only while every context keeps the driver's slice: a process may set its
// own contexts' slice (the channel-group control needs no privilege), and
// one ten times longer takes ten turns' worth of the GPU to another's one,
// while both pay equal parts. Turns through the daemon do not depend on it.
// So each tenant should be named by the driver's samples side by side at
// least as often as it used the GPU in the turns before: at most the time
// it held them, and at most the GPU's busy share over them (its own and
// the others' work: a neighbour idling in its own turns cannot hide what
// this one used), and no more than its part (the driver's equal turns give
// each that much while all have work; one that had the GPU to itself in
// turns while the others were idle cannot expect that beside them).
void GpuScheduler::set_side_least_shares(uint64_t now) {
  const int64_t busy = busy_ppm(turns_, now);
  const uint64_t span = turns_held_taken_ && now > turns_held_at_ ? now - turns_held_at_ : 0;
  const uint64_t members = contenders();
  for (Row& r : rows_) {
    r.side_least_ppm = 0;
    if (!contends(r) || busy < 0 || span == 0) continue;
    const uint64_t held = r.held > r.turns_held0 ? r.held - r.turns_held0 : 0;
    const uint64_t held_ppm = std::min<uint64_t>(static_cast<unsigned __int128>(held) * kPpm / span, kPpm);
    r.side_least_ppm = static_cast<uint32_t>(std::min({held_ppm, static_cast<uint64_t>(busy), kPpm / members}));
  }
}

// Each sample side by side names one process; over many, a tenant kept to
// a shorter share of the driver's turns than its least share is named
// fewer times than that share expects, well beyond chance (a binomial
// count, kSideShortfallSigmas standard deviations). Its least share: what
// it used in the last turns measured (set_side_least_shares()), less
// kSideShortfallPpm for the idle moments inside its turns that side by
// side gives the others. The counts run over the phases since the last
// bar (the last kSideSamplesKept samples or so), so that a tenant cannot
// wipe them by changing what it asks for. The
// tenants named more than their part take turns for kSideBarNs (twice the
// last bar for one found again within kSideBarMemoryNs); the others may
// still share.
// Nothing here bounds the least share by how often the samples in turns
// named a tenant: a flooder's queue, running on past its revocations beside
// the next holder's grant, keeps the samples in turns off its light
// neighbour, and the check then missed it in one run of two or three. So a
// tenant that keeps off the GPU at the instants side by side (by its own
// doing) gets its neighbour barred: that costs the neighbour side by side,
// which any tenant can take from all by reporting a second context.
double GpuScheduler::least_side_share(const Row& r) {
  return r.side_least_ppm / static_cast<double>(kPpm) - kSideShortfallPpm / static_cast<double>(kPpm);
}

void GpuScheduler::check_side_shares(const std::vector<uint32_t>& named_rows, uint64_t now) {
  const uint32_t members = contenders();
  // Only samples that name one of them: another tenant's process at work
  // (outside its grant) is the audit's business, not evidence of the turns.
  const bool names_member =
      std::any_of(named_rows.begin(), named_rows.end(), [&](uint32_t t) { return t < rows_.size() && contends(rows_[t]); });
  if (members < 2 || !names_member) return;
  double most = 0;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    if (!contends(r)) continue;
    const bool named = std::find(named_rows.begin(), named_rows.end(), t) != named_rows.end();
    r.side_named += named ? 1 : 0;
    r.side_samples += 1;
    most = std::max(most, r.side_samples);
  }
  // Beyond kSideSamplesKept the counts forget at the rate they grow, all by
  // the same factor: a tenant that shared fairly for hours has no credit of
  // samples to spend unseen on taking more, as it would with counts that
  // only grow (on the scheduler's fixture, an hour's record hid thirty
  // minutes of it).
  if (most > kSideSamplesKept)
    for (Row& r : rows_) {
      r.side_named *= kSideSamplesKept / most;
      r.side_samples *= kSideSamplesKept / most;
    }
  std::vector<uint32_t> short_of;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    if (!contends(r)) continue;
    const double least = least_side_share(r);
    if (least <= 0 || r.side_samples < kSideShortfallMinSamples) continue;
    const double shortfall = r.side_samples * least - r.side_named;
    if (shortfall > kSideShortfallSigmas * std::sqrt(r.side_samples * least * (1 - least))) short_of.push_back(t);
  }
  if (short_of.empty()) return;
  // Those named more often than their part of the samples the members had.
  double all_named = 0;
  for (const Row& r : rows_)
    if (contends(r)) all_named += r.side_named;
  std::string barred;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    Row& r = rows_[t];
    if (!contends(r) || std::find(short_of.begin(), short_of.end(), t) != short_of.end()) continue;
    if (r.side_named * members <= all_named) continue;
    const bool again = r.side_bar_ns != 0 && now < r.side_barred_until + kSideBarMemoryNs;
    r.side_bar_ns = again ? std::min(2 * r.side_bar_ns, kSideBarMaxNs) : kSideBarNs;
    r.side_barred_until = now + r.side_bar_ns;
    barred += fmt::format("{}\"{}\" for {} s", barred.empty() ? "" : ", ", r.name, r.side_bar_ns / kSecond);
    if (again) barred += fmt::format(" (found again within {} s of its last bar)", kSideBarMemoryNs / kSecond);
  }
  const Row& kept = rows_[short_of.front()];
  if (!barred.empty())
    note(true, fmt::format("{}: side by side, the driver's samples named tenant \"{}\" {:.0f} times where what it "
                           "used in turns called for {:.0f} at least: the driver's turns kept it short; "
                           "taking turns: {}",
                           label_, kept.name, kept.side_named, kept.side_samples * least_side_share(kept), barred));
  for (Row& r : rows_) r.side_named = r.side_samples = 0;
}

// The GPU has room for another tenant: measured busy (every process on it)
// below kRoomBusyPpm over a full window since the holders last changed.
bool GpuScheduler::room(uint64_t now) const {
  if (now < room_since_ + kRoomWindowNs || now <= room_since_) return false;
  return static_cast<unsigned __int128>(room_busy_) * kPpm <
         static_cast<unsigned __int128>(now - room_since_) * kRoomBusyPpm;
}

// ---- Publishing ----

void GpuScheduler::publish(uint64_t now) {
  // The file is ours alone, but root can still write it: every pass puts
  // back what we know, so damage lasts one pass at most.
  if (!gputime::header_valid(seg_.header, uuid_)) gputime::stamp_header(seg_.header, uuid_);
  store_if_changed(seg_.daemon.doorbell, 0u);
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    if (seg_.tenants[t].grant.load(std::memory_order_acquire) != gputime::grant_word(r.gseq, t, r.gstate))
      publish_grant(t, false);
  }
  store_if_changed(seg_.grant.word, last_word_);
  store_if_changed(seg_.grant.grant_ns, last_grant_ns_);
  store_if_changed(seg_.grant.revoke_ns, holders(gputime::kGrantRevoking) > 0 ? last_revoke_ns_ : uint64_t{0});
  const bool measured = measuring(now);
  store_if_changed(seg_.daemon.charging, measured ? uint32_t{gputime::kChargeMeasured} : uint32_t{gputime::kChargeHeld});
  store_if_changed(seg_.daemon.sample_period_ns,
                   measured || auditing(now) ? std::max<uint64_t>(meter_->sample_period_ns(), 1) : uint64_t{0});
  if (measured && now > room_since_ + kRoomWindowNs)
    busy_ppm_ = static_cast<uint32_t>(std::min<unsigned __int128>(
        static_cast<unsigned __int128>(room_busy_) * kPpm / (now - room_since_), kPpm));
  store_if_changed(seg_.daemon.busy_ppm, measured ? busy_ppm_ : 0u);
  store_if_changed(seg_.grant.handovers, handovers_);
  store_if_changed(seg_.min_vtime, min_vtime_);
  store_if_changed(seg_.daemon.slice_ns, slice_ns_);
  store_if_changed(seg_.daemon.drain_deadline_ns, gputime::kDrainDeadlineNs);
  // A latency tenant still configured, in its arrival grace, counts as
  // active (kLatencyArrivalNs).
  bool latency_configured = false;
  for (const Row& r : rows_) latency_configured |= r.active && r.priority == gputime::kPriorityLatency;
  const bool pacing = (latency_seen_ns_ != 0 && now - latency_seen_ns_ < kLatencyActiveNs) ||
                      (latency_configured && latency_arrival_ns_ != 0 && now < latency_arrival_ns_ + kLatencyArrivalNs);
  store_if_changed(seg_.daemon.pace_inflight_ns, pacing ? kPaceInflightNs : uint64_t{0});
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
    store_if_changed(f.priority, r.priority);
    store_if_changed(f.vtime, r.vtime);
    store_if_changed(f.used_ns, r.used);
    store_if_changed(f.measured_ns, r.measured);
    store_if_changed(f.held_ns, r.held);
    store_if_changed(f.out_of_grant_ns, r.out_of_grant);
    store_if_changed(f.out_of_grant_samples, r.out_of_grant_samples);
    store_if_changed(f.throttled_ns, r.throttled);
    store_if_changed(f.cap_tat_ns, r.cap_tat);
    store_if_changed(f.slices, r.slices);
    store_if_changed(f.waiting_processes, r.active ? r.waiting : 0u);
    store_if_changed(f.missed_deadlines, r.missed_deadlines);
    store_if_changed(f.flags, (r.active && r.wants ? uint32_t{gputime::kTenantWants} : 0u) |
                                  (r.blocked ? uint32_t{gputime::kTenantBlocked} : 0u) |
                                  (side_ && r.gstate == gputime::kGranted ? uint32_t{gputime::kTenantSideBySide} : 0u) |
                                  (r.active && yields(r, now) ? uint32_t{gputime::kTenantYields} : 0u) |
                                  (r.active && r.side_barred_until > now ? uint32_t{gputime::kTenantTakesTurns} : 0u));
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
  if (std::exchange(latency_configured_, false)) latency_arrival_ns_ = now;
  for (Row& r : rows_) {
    if (!r.active) continue;
    observe(r, now);
    check_blocked(r, now);
    anyone_wants_ |= r.wants;
    if (r.priority == gputime::kPriorityLatency && (r.has_live || r.wants || r.gstate != gputime::kGrantIdle))
      latency_seen_ns_ = now;
  }
  // The floor for tenants coming back from idle: the least virtual time
  // among those that want the GPU and the holder (it only rises).
  uint64_t lowest = UINT64_MAX;
  // (A blocked tenant is not among them: it cannot be granted, and its
  // virtual time standing still must not hold the others' back. Nor is one
  // that yields: it is served only when nobody else asks, so its virtual
  // time falls behind while it yields, and that lag is no debt the others
  // owe it once it stops: it comes back as from idle.)
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t)
    if (contends(rows_[t]) && !yields(rows_[t], now))
      lowest = std::min(lowest, rows_[t].vtime);
  if (lowest != UINT64_MAX && lowest > min_vtime_) min_vtime_ = lowest;
  read_meter(now);
  account_waits(now);
  charge(now);
  step(now);
  publish(now);
  last_pass_ns_ = now;
  const uint32_t granted = holders(gputime::kGranted), revoking = holders(gputime::kGrantRevoking);
  if (anyone_wants_ || granted + revoking != 0 || pass_busy_ != 0 || last_used_ns_ == 0) last_used_ns_ = now;
  uint64_t sleep = anyone_wants_ ? kBusyPassNs : now - last_used_ns_ >= kQuietAfterNs ? kQuietPassNs : kIdlePassNs;
  const bool lone = !anyone_wants_ && !side_ && !measuring(now) && granted == 1 && revoking == 0 &&
                    std::none_of(rows_.begin(), rows_.end(), [](const Row& r) {
                      return r.pays_late() || (r.gstate == gputime::kGranted && r.limit < kPpm);
                    });
  for (const Row& r : rows_) {
    if (r.gstate == gputime::kGranted) sleep = std::min(sleep, lone ? kLonePassNs : kBusyPassNs);
    if (r.gstate == gputime::kGrantRevoking)
      sleep = std::min(sleep, std::min(kBusyPassNs, std::max<uint64_t>(r.revoke_ns + drain_deadline(r, now) - now,
                                                                      kMinPassIntervalNs)));
  }
  return sleep;
}

void GpuScheduler::sample_achieved(uint64_t now) {
  std::lock_guard lock(mutex_);
  std::array<uint64_t, gputime::kMaxTenants> used{};
  // Achieved: GPU time used, as measured, where there is a meter; else the
  // time held (all there is to know without one).
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t)
    used[t] = meter_ != nullptr && measured_charging_ ? rows_[t].measured : rows_[t].used;
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
  std::vector<uint64_t> sorted;
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    const Row& r = rows_[t];
    if (!r.bound) continue;
    gputime::TenantTime& f = seg_.tenants[t];
    store_if_changed(f.achieved_1s_ppm, achieved(t, kSecond));
    store_if_changed(f.achieved_10s_ppm, achieved(t, 10 * kSecond));
    // A latency tenant's waits for the GPU: percentiles of the last few.
    sorted.assign(r.waits.begin(), r.waits.end());
    std::sort(sorted.begin(), sorted.end());
    auto percentile = [&](double p) -> uint64_t {
      if (sorted.empty()) return 0;
      return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * static_cast<double>(sorted.size())))];
    };
    store_if_changed(f.wait_p50_ns, percentile(0.50));
    store_if_changed(f.wait_p99_ns, percentile(0.99));
    store_if_changed(f.wait_p999_ns, percentile(0.999));
    store_if_changed(f.waits, r.wait_count);
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

bool GpuScheduler::fold_requests(const Row& r, uint64_t* fold) const {
  if (r.usage == nullptr || r.entry < 0) return false;
  const ledger::UsageSegment& u = *r.usage;
  const uint32_t entry = static_cast<uint32_t>(r.entry);
  uint64_t h = 0;
  const bool ok = shm::sigbus_guarded([&] {
    const uint32_t high = std::max(r.high_mark, std::min(u.slot_high_water.load(std::memory_order_acquire), kMaxSlots));
    for (uint32_t s = 0; s < high; ++s) {
      const ledger::GpuTimeRequest& q = u.gputime[entry][s];
      h = fold_request(h, s, q.want_since_ns.load(std::memory_order_seq_cst), q.entered_grant.load(std::memory_order_seq_cst),
                       q.drained_grant.load(std::memory_order_seq_cst));
    }
  });
  *fold = h;
  return ok;
}

bool GpuScheduler::requests_changed() {
  std::lock_guard lock(mutex_);
  for (const Row& r : rows_) {
    if (!r.active || !r.readable) continue;
    uint64_t now_fold = 0;
    if (fold_requests(r, &now_fold) && now_fold != r.requests_seen) return true;
  }
  return false;
}

void GpuScheduler::run() {
  const std::string priority = raise_priority();
  // Hand-overs wait on this thread's wake-ups: no timer slack on them.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  {
    std::lock_guard lock(mutex_);
    note(false, fmt::format("{}: GPU-time scheduler running, priority {}", label_, priority));
  }
  while (!stop_.load(std::memory_order_acquire)) {
    const uint64_t start = gputime::monotonic_ns();
    const uint64_t sleep = pass(start);
    if (stop_.load(std::memory_order_acquire)) break;
    if (!requests_changed()) gputime::wait_for_doorbell(seg_, sleep);
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
  seg_.daemon.daemon_heartbeat_ns.store(0, std::memory_order_release);
  for (uint32_t t = 0; t < gputime::kMaxTenants; ++t) {
    rows_[t].gstate = gputime::kGrantIdle;
    rows_[t].gseq = seq_;
    publish_grant(t);
  }
}

}  // namespace fracgpu::controller

#include "gputime.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace fracgpu::gputime {
namespace {

using ledger::set_error;

void stamp_arbiter(void* map, const void* arg) {
  auto* seg = static_cast<GpuTimeSegment*>(map);
  seg->header.magic = kGpuTimeMagic;
  seg->header.layout_version = kGpuTimeLayoutVersion;
  seg->header.header_bytes = sizeof(GpuTimeHeader);
  seg->header.segment_bytes = sizeof(GpuTimeSegment);
  if (arg != nullptr) memcpy(seg->header.uuid, arg, 16);
}

bool all_zero(const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  return std::all_of(b, b + n, [](unsigned char c) { return c == 0; });
}

int set_process_lock(int fd, uint32_t process, short type) {
  return ledger::set_byte_lock(fd, process_lock_offset(process), type);
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word lives in a file mapped by many processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

uint64_t saturating_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

// ns * kPpm / ppm without overflow for any ns below ~5 hours; ppm 0 (no
// share: best effort) weighs like the smallest share there is.
uint64_t scale(uint64_t ns, uint32_t ppm) {
  const auto v = static_cast<unsigned __int128>(ns) * kPpm / std::max<uint32_t>(ppm, 1);
  return v > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(v);
}

}  // namespace

LedgerError open_arbiter(const char* path, bool create, bool read_only, const uint8_t* uuid, Arbiter* out, char* err,
                         size_t err_len) {
  void* map = nullptr;
  int fd = -1;
  LedgerError e = ledger::map_shared_file(path, !read_only, create ? 0666 : 0, sizeof(GpuTimeSegment),
                                          stamp_arbiter, uuid, &map, &fd, err, err_len);
  if (e != LedgerError::kOk) return e;
  const auto* seg = static_cast<const GpuTimeSegment*>(map);
  const GpuTimeHeader& h = seg->header;
  LedgerError check = LedgerError::kOk;
  if (all_zero(&h, sizeof h)) {
    // Fresh: valid and empty, but it governs no GPU we could check.
  } else if (h.magic != kGpuTimeMagic) {
    check = LedgerError::kForeign;
    set_error(err, err_len, "%s: not a fracgpu GPU-time arbiter (bad magic)", path);
  } else if (h.layout_version != kGpuTimeLayoutVersion) {
    check = LedgerError::kWrongVersion;
    set_error(err, err_len, "%s: GPU-time layout version %u, this fracgpu speaks version %u", path, h.layout_version,
              kGpuTimeLayoutVersion);
  } else if (h.header_bytes != sizeof(GpuTimeHeader) || h.segment_bytes != sizeof(GpuTimeSegment)) {
    check = LedgerError::kCorrupt;
    set_error(err, err_len, "%s: corrupt header", path);
  } else if (uuid != nullptr && memcmp(h.uuid, uuid, 16) != 0) {
    check = LedgerError::kForeign;
    set_error(err, err_len, "%s: governs another GPU", path);
  }
  // Indices read from the file must never send a reader out of bounds.
  if (check == LedgerError::kOk) {
    const uint32_t holder = seg->arbiter.holder.load(std::memory_order_relaxed);
    bool bad = holder > kMaxProcesses || seg->process_high_water.load(std::memory_order_relaxed) > kMaxProcesses;
    for (const ProcessTime& p : seg->processes)
      bad |= p.state.load(std::memory_order_relaxed) == kProcessLive && p.tenant.load(std::memory_order_relaxed) >= kMaxTenants;
    if (bad) {
      check = LedgerError::kCorrupt;
      set_error(err, err_len, "%s: corrupt: an index is out of range", path);
    }
  }
  if (check != LedgerError::kOk) {
    munmap(map, sizeof(GpuTimeSegment));
    ::close(fd);
    return check;
  }
  out->seg = static_cast<GpuTimeSegment*>(map);
  out->fd = fd;
  return LedgerError::kOk;
}

void close_arbiter(Arbiter* arbiter) {
  if (arbiter->seg != nullptr) munmap(arbiter->seg, sizeof(GpuTimeSegment));
  if (arbiter->fd >= 0) ::close(arbiter->fd);
  *arbiter = Arbiter{};
}

// ---- Tenants ----

int find_tenant(const GpuTimeSegment& seg, const char* name) {
  for (uint32_t t = 0; t < kMaxTenants; ++t) {
    const TenantTime& entry = seg.tenants[t];
    if (entry.state.load(std::memory_order_acquire) == kTenantUnused) continue;
    if (strncmp(entry.name, name, kTenantNameBytes) == 0) return static_cast<int>(t);
  }
  return -1;
}

int bind_tenant(GpuTimeSegment& seg, const char* name) {
  const int found = find_tenant(seg, name);
  if (found >= 0) return found;
  for (uint32_t t = 0; t < kMaxTenants; ++t) {
    TenantTime& entry = seg.tenants[t];
    if (entry.state.load(std::memory_order_acquire) != kTenantUnused) continue;
    snprintf(entry.name, sizeof entry.name, "%s", name);
    // Bound but not yet configured here: the daemon sets the share next.
    entry.state.store(kTenantRetired, std::memory_order_release);
    return static_cast<int>(t);
  }
  return -1;
}

// ---- Process entries ----

int claim_process(Arbiter& arbiter, uint32_t tenant, int32_t pid, uint64_t start_time) {
  GpuTimeSegment& seg = *arbiter.seg;
  for (uint32_t p = 0; p < kMaxProcesses; ++p) {
    ProcessTime& entry = seg.processes[p];
    // Our own lock would look free to us: an entry this process already
    // owns (another GPU entry of the same tenant, say) is told by identity.
    if (entry.state.load(std::memory_order_acquire) == kProcessLive && entry.pid.load(std::memory_order_relaxed) == pid &&
        entry.start_time.load(std::memory_order_relaxed) == start_time)
      continue;
    // The entry of a holder that died holding the GPU stays its own until
    // someone takes the GPU over (try_take_over charges its last stretch to
    // its tenant). Reused now, the newcomer would find itself the holder and
    // pay for the dead process's time, under its own tenant.
    if (seg.arbiter.holder.load(std::memory_order_acquire) == p + 1) continue;
    if (set_process_lock(arbiter.fd, p, F_WRLCK) != 0) continue;  // a live owner
    if (seg.arbiter.holder.load(std::memory_order_acquire) == p + 1) {
      // Handed to the dead owner between the two checks: leave it to the takeover.
      set_process_lock(arbiter.fd, p, F_UNLCK);
      continue;
    }
    entry.want_since_ns.store(0, std::memory_order_relaxed);
    entry.used_ns.store(0, std::memory_order_relaxed);
    entry.waited_ns.store(0, std::memory_order_relaxed);
    entry.tenant.store(tenant, std::memory_order_relaxed);
    entry.pid.store(pid, std::memory_order_relaxed);
    entry.start_time.store(start_time, std::memory_order_relaxed);
    entry.state.store(kProcessLive, std::memory_order_release);
    uint32_t high = seg.process_high_water.load(std::memory_order_relaxed);
    while (high < p + 1 && !seg.process_high_water.compare_exchange_weak(high, p + 1, std::memory_order_seq_cst)) {
    }
    return static_cast<int>(p);
  }
  return -1;
}

void release_process(Arbiter& arbiter, uint32_t process) {
  ProcessTime& entry = arbiter.seg->processes[process];
  entry.want_since_ns.store(0, std::memory_order_relaxed);
  entry.state.store(kProcessFree, std::memory_order_release);
  set_process_lock(arbiter.fd, process, F_UNLCK);
}

bool process_alive(const Arbiter& arbiter, uint32_t process) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = process_lock_offset(process);
  fl.l_len = 1;
  if (fcntl(arbiter.fd, F_GETLK, &fl) != 0) return true;  // cannot tell: assume alive, never steal wrongly
  return fl.l_type != F_UNLCK;
}

int reclaim_dead_processes(Arbiter& arbiter, int own) {
  GpuTimeSegment& seg = *arbiter.seg;
  const uint32_t high = std::min(seg.process_high_water.load(std::memory_order_acquire), kMaxProcesses);
  int reclaimed = 0;
  for (uint32_t p = 0; p < high; ++p) {
    if (static_cast<int>(p) == own) continue;
    ProcessTime& entry = seg.processes[p];
    if (entry.state.load(std::memory_order_acquire) != kProcessLive) continue;
    if (set_process_lock(arbiter.fd, p, F_WRLCK) != 0) continue;  // owner alive
    entry.want_since_ns.store(0, std::memory_order_relaxed);
    entry.state.store(kProcessFree, std::memory_order_release);
    set_process_lock(arbiter.fd, p, F_UNLCK);
    ++reclaimed;
  }
  return reclaimed;
}

// ---- Scheduling ----

bool within_limit(const TenantTime& tenant, uint32_t limit_ppm, uint64_t now, uint64_t* eligible_at) {
  if (eligible_at != nullptr) *eligible_at = 0;
  if (limit_ppm >= kPpm) return true;
  const uint64_t tat = tenant.cap_tat_ns.load(std::memory_order_acquire);
  if (tat <= now + kLimitBurstNs) return true;
  if (eligible_at != nullptr) *eligible_at = tat - kLimitBurstNs;
  return false;
}

void charge(GpuTimeSegment& seg, uint32_t tenant, uint32_t process, uint64_t ns, uint32_t share_ppm,
            uint32_t limit_ppm, uint64_t credit_from) {
  if (ns == 0) return;
  TenantTime& t = seg.tenants[tenant];
  t.used_ns.fetch_add(ns, std::memory_order_relaxed);
  seg.processes[process].used_ns.fetch_add(ns, std::memory_order_relaxed);
  t.vtime.store(saturating_add(t.vtime.load(std::memory_order_relaxed), scale(ns, share_ppm)),
                std::memory_order_release);
  // GCRA for the limit: using ns of GPU time at a rate of limit_ppm costs
  // ns / limit of wall time; time left unused is credited only up to the
  // burst (the arrival time never falls behind credit_from - burst).
  if (limit_ppm < kPpm) {
    const uint64_t floor = credit_from > kLimitBurstNs ? credit_from - kLimitBurstNs : 0;
    const uint64_t tat = std::max(t.cap_tat_ns.load(std::memory_order_relaxed), floor);
    t.cap_tat_ns.store(saturating_add(tat, scale(ns, limit_ppm)), std::memory_order_release);
  }
}

uint64_t effective_vtime(const GpuTimeSegment& seg, uint32_t tenant) {
  const TenantTime& t = seg.tenants[tenant];
  const uint64_t vt = t.vtime.load(std::memory_order_acquire);
  const uint64_t floor = seg.arbiter.min_vtime.load(std::memory_order_acquire);
  const uint64_t credit = scale(kReturnCreditNs, t.share_ppm.load(std::memory_order_relaxed));
  return std::max(vt, floor > credit ? floor - credit : 0);
}

Candidate pick_next(Arbiter& arbiter, int self, uint32_t self_tenant, uint64_t now) {
  GpuTimeSegment& seg = *arbiter.seg;
  const uint32_t high = std::min(seg.process_high_water.load(std::memory_order_acquire), kMaxProcesses);
  // The floor: the least virtual time among tenants that want the GPU now.
  uint64_t lowest = self_tenant < kMaxTenants ? seg.tenants[self_tenant].vtime.load(std::memory_order_acquire) : UINT64_MAX;
  for (uint32_t p = 0; p < high; ++p) {
    const ProcessTime& entry = seg.processes[p];
    if (static_cast<int>(p) == self || entry.state.load(std::memory_order_acquire) != kProcessLive ||
        entry.want_since_ns.load(std::memory_order_acquire) == 0)
      continue;
    const uint32_t tenant = entry.tenant.load(std::memory_order_relaxed);
    if (tenant < kMaxTenants) lowest = std::min(lowest, seg.tenants[tenant].vtime.load(std::memory_order_acquire));
  }
  if (lowest != UINT64_MAX && lowest > seg.arbiter.min_vtime.load(std::memory_order_relaxed))
    seg.arbiter.min_vtime.store(lowest, std::memory_order_release);

  Candidate best;
  uint64_t best_since = 0;
  for (uint32_t p = 0; p < high; ++p) {
    if (static_cast<int>(p) == self) continue;
    const ProcessTime& entry = seg.processes[p];
    if (entry.state.load(std::memory_order_acquire) != kProcessLive) continue;
    const uint64_t since = entry.want_since_ns.load(std::memory_order_acquire);
    if (since == 0) continue;
    const uint32_t tenant = entry.tenant.load(std::memory_order_relaxed);
    if (tenant >= kMaxTenants) continue;
    const TenantTime& t = seg.tenants[tenant];
    if (!within_limit(t, t.limit_ppm.load(std::memory_order_relaxed), now, nullptr)) continue;
    const uint64_t vt = effective_vtime(seg, tenant);
    if (best.process >= 0 && (vt > best.vtime || (vt == best.vtime && since >= best_since))) continue;
    if (!process_alive(arbiter, p)) continue;
    best = Candidate{static_cast<int>(p), tenant, vt};
    best_since = since;
  }
  return best;
}

namespace {

// Raises a tenant about to get the GPU to its effective virtual time (see
// effective_vtime). Only while the caller is the one writer.
void lift_vtime(GpuTimeSegment& seg, uint32_t process) {
  const uint32_t tenant = seg.processes[process].tenant.load(std::memory_order_relaxed);
  if (tenant < kMaxTenants) seg.tenants[tenant].vtime.store(effective_vtime(seg, tenant), std::memory_order_release);
}

// The new holder's bookkeeping.
void start_hold(GpuTimeSegment& seg, uint32_t process, uint64_t now) {
  HolderState& a = seg.arbiter;
  a.grant_ns.store(now, std::memory_order_relaxed);
  a.charged_ns.store(now, std::memory_order_relaxed);
  a.heartbeat_ns.store(now, std::memory_order_relaxed);
  a.idle_since_ns.store(0, std::memory_order_relaxed);
  a.handovers.fetch_add(1, std::memory_order_relaxed);
  const uint32_t tenant = seg.processes[process].tenant.load(std::memory_order_relaxed);
  if (tenant < kMaxTenants) seg.tenants[tenant].slices.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

bool try_claim(GpuTimeSegment& seg, uint32_t process, uint64_t now) {
  HolderState& a = seg.arbiter;
  if (a.holder.load(std::memory_order_acquire) != 0) return false;
  // The hold's times are written before it is taken, as hand_over does: once
  // `holder` names us, a waiter may look at them at once. Left to after the
  // claim, they would still be the last holder's (possibly from long ago, or
  // 0 on a new GPU): a fresh holder that looks stale, taken over and charged
  // for all the time since (seen: 13,000 s charged to one tenant, which its
  // limit then locked out of the GPU). Claimers that lose the race below
  // wrote the same `now`, give or take their own clock reads.
  a.grant_ns.store(now, std::memory_order_relaxed);
  a.charged_ns.store(now, std::memory_order_relaxed);
  a.heartbeat_ns.store(now, std::memory_order_release);
  uint32_t expected = 0;
  if (!a.holder.compare_exchange_strong(expected, process + 1, std::memory_order_acq_rel)) return false;
  lift_vtime(seg, process);
  start_hold(seg, process, now);
  seg.arbiter.turn.fetch_add(1, std::memory_order_release);
  return true;
}

bool hand_over(GpuTimeSegment& seg, uint32_t from, int to, uint64_t now) {
  HolderState& a = seg.arbiter;
  if (to >= 0) {
    // Written before the holder changes: the new holder's pacer must find
    // its grant time, and nobody else writes these while `from` holds.
    a.grant_ns.store(now, std::memory_order_relaxed);
    a.charged_ns.store(now, std::memory_order_relaxed);
    a.heartbeat_ns.store(now, std::memory_order_relaxed);
    lift_vtime(seg, static_cast<uint32_t>(to));
  }
  uint32_t expected = from + 1;
  const uint32_t next = to >= 0 ? static_cast<uint32_t>(to) + 1 : 0;
  if (!a.holder.compare_exchange_strong(expected, next, std::memory_order_acq_rel)) return false;
  if (to >= 0) {
    start_hold(seg, static_cast<uint32_t>(to), now);
  } else {
    a.idle_since_ns.store(now, std::memory_order_relaxed);
  }
  a.turn.fetch_add(1, std::memory_order_release);
  wake_waiters(seg);
  return true;
}

bool try_take_over(Arbiter& arbiter, uint32_t process, uint64_t now) {
  GpuTimeSegment& seg = *arbiter.seg;
  HolderState& a = seg.arbiter;
  uint32_t holder = a.holder.load(std::memory_order_acquire);
  if (holder == 0 || holder == process + 1) return false;
  const uint32_t victim = holder - 1;
  // The file is writable by every tenant: a holder that names no entry was
  // written by a misbehaving process. It holds nothing; take the GPU back.
  const bool no_entry = victim >= kMaxProcesses;
  const uint64_t beat = a.heartbeat_ns.load(std::memory_order_acquire);
  const bool stale = now > beat && now - beat > kStaleHolderNs;
  if (!no_entry && !stale && process_alive(arbiter, victim)) return false;
  // The victim's last stretch starts at its last charge; never before its
  // last sign of life (a bound should the two disagree).
  const uint64_t charged = std::max(a.charged_ns.load(std::memory_order_acquire), beat);
  if (!a.holder.compare_exchange_strong(holder, process + 1, std::memory_order_acq_rel)) return false;
  // The dead (or stuck) holder never charged its last stretch: do it for
  // it, so its tenant pays for the GPU time its work took. Its share is not
  // known here; the virtual time moves at the tenant's recorded share.
  const uint32_t tenant = no_entry ? kMaxTenants : seg.processes[victim].tenant.load(std::memory_order_relaxed);
  if (tenant < kMaxTenants && now > charged) {
    const TenantTime& t = seg.tenants[tenant];
    charge(seg, tenant, victim, now - charged, t.share_ppm.load(std::memory_order_relaxed),
           t.limit_ppm.load(std::memory_order_relaxed), now);
  }
  lift_vtime(seg, process);
  start_hold(seg, process, now);
  a.turn.fetch_add(1, std::memory_order_release);
  wake_waiters(seg);
  return true;
}

void wait_for_turn(GpuTimeSegment& seg, uint32_t seen, uint64_t timeout_ns) {
  struct timespec timeout {};
  timeout.tv_sec = static_cast<time_t>(timeout_ns / 1'000'000'000ull);
  timeout.tv_nsec = static_cast<long>(timeout_ns % 1'000'000'000ull);
  futex(&seg.arbiter.turn, FUTEX_WAIT, seen, &timeout);
}

void wake_waiters(GpuTimeSegment& seg) { futex(&seg.arbiter.turn, FUTEX_WAKE, INT_MAX, nullptr); }

void add_throttled(TenantTime& tenant, uint64_t from, uint64_t to) {
  uint64_t mark = tenant.throttled_mark_ns.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t start = std::max(from, mark);
    if (to <= start) return;
    if (tenant.throttled_mark_ns.compare_exchange_weak(mark, to, std::memory_order_acq_rel)) {
      tenant.throttled_ns.fetch_add(to - start, std::memory_order_relaxed);
      return;
    }
  }
}

}  // namespace fracgpu::gputime

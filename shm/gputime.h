// Operations on a GPU's time arbiter (layout and rules in
// include/fracgpu/gputime_layout.h; the policy in docs/sm-time.md).
//
// Callers: the interposer (claims a process entry, takes and hands on the GPU,
// charges its own tenant), the daemon (creates the file, writes the tenant
// table, reaps dead entries, computes achieved shares) and the CLI (reads).
// Like the ledger: nothing here allocates, throws or logs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fracgpu/gputime_layout.h"
#include "ledger.h"

namespace fracgpu::gputime {

using ledger::LedgerError;

struct Arbiter {
  GpuTimeSegment* seg = nullptr;
  int fd = -1;  // record locks on process entries are taken on this descriptor

  bool is_open() const { return seg != nullptr; }
};

// Maps an arbiter file read-write (read-only if `read_only`). With `create`,
// a missing file is created complete (temporary name, then link) with mode
// 0666 and stamped with `uuid`. An existing file is validated: magic,
// version, size, and, when `uuid` is given, that it governs that GPU.
LedgerError open_arbiter(const char* path, bool create, bool read_only, const uint8_t* uuid, Arbiter* out, char* err,
                         size_t err_len);
void close_arbiter(Arbiter* arbiter);

using ledger::monotonic_ns;

// ---- Tenants ----

// Index of the entry named `name` (any state but unused), or -1.
int find_tenant(const GpuTimeSegment& seg, const char* name);
// Daemon: the entry for `name`, appending one if needed; -1 if full.
int bind_tenant(GpuTimeSegment& seg, const char* name);

// ---- Process entries ----

// Claims a free entry for the calling process (record lock held until exit
// or release_process) on behalf of tenant entry `tenant`. -1 if none is free.
int claim_process(Arbiter& arbiter, uint32_t tenant, int32_t pid, uint64_t start_time);
void release_process(Arbiter& arbiter, uint32_t process);
// True while some process holds the entry's record lock. A process cannot
// see its own locks: never ask about your own entry.
bool process_alive(const Arbiter& arbiter, uint32_t process);
// Frees entries whose owner is gone (not `own`). Returns how many.
int reclaim_dead_processes(Arbiter& arbiter, int own);

// ---- Scheduling (see the rules in gputime_layout.h) ----

// The limit: a tenant may run when its GCRA arrival time is at most this far
// ahead of now, i.e. it may burst this long above its limit after idling.
inline constexpr uint64_t kLimitBurstNs = 50'000'000;

// True if a tenant with this limit may use the GPU at `now`; a limit of a
// whole GPU never stops it. *eligible_at (if given) is when it may, else 0.
bool within_limit(const TenantTime& tenant, uint32_t limit_ppm, uint64_t now, uint64_t* eligible_at);

// Charges `ns` of GPU time used by `process` to its tenant `tenant`: virtual
// time (weighted by `share_ppm`), totals, and the limit's arrival time.
// The limit's allowance accrues from `credit_from - kLimitBurstNs` at the
// earliest: pass `now`, or when the tenant started waiting for other
// tenants' slices (time it was kept off the GPU is not time it chose to
// leave idle, so it does not forfeit its allowance). Holder only.
void charge(GpuTimeSegment& seg, uint32_t tenant, uint32_t process, uint64_t ns, uint32_t share_ppm,
            uint32_t limit_ppm, uint64_t credit_from);

// A tenant's virtual time as the scheduler compares it: never more than
// kReturnCreditNs (of real time, at the tenant's share) below the floor, so a
// tenant that was idle cannot bank the time it did not use and then lock the
// others out, yet a newcomer is served first. A tenant's stored virtual time
// is raised to this when it is given the GPU.
inline constexpr uint64_t kReturnCreditNs = 20'000'000;
uint64_t effective_vtime(const GpuTimeSegment& seg, uint32_t tenant);

// The waiting process that should get the GPU next, or -1: among live
// entries other than `self` with want_since_ns != 0 whose tenant is within
// its limit, the tenant with the smallest effective virtual time, then the
// longest-waiting process. Also raises the floor to the smallest virtual
// time among those tenants and `self_tenant`. Probes liveness with a record
// lock query per candidate (a system call): the holder's pacer calls it.
struct Candidate {
  int process = -1;
  uint32_t tenant = 0;
  uint64_t vtime = 0;
};
Candidate pick_next(Arbiter& arbiter, int self, uint32_t self_tenant, uint64_t now);

// Takes a free GPU (holder 0) for `process`. True on success.
bool try_claim(GpuTimeSegment& seg, uint32_t process, uint64_t now);
// Holder `from` gives the GPU to `to` (-1: to nobody) and wakes waiters.
// False if `from` no longer held it.
bool hand_over(GpuTimeSegment& seg, uint32_t from, int to, uint64_t now);
// Takes the GPU from a holder that is dead (its record lock is free) or whose
// heartbeat is older than kStaleHolderNs. Charges the time since the holder's
// last charge to its tenant, at the share and limit the daemon recorded in
// the tenant table. True if `process` now holds the GPU.
inline constexpr uint64_t kStaleHolderNs = 1'000'000'000;
bool try_take_over(Arbiter& arbiter, uint32_t process, uint64_t now);

// Futex on arbiter.turn: sleeps until it differs from `seen` or `timeout_ns`
// passes. wake_waiters wakes every sleeper.
void wait_for_turn(GpuTimeSegment& seg, uint32_t seen, uint64_t timeout_ns);
void wake_waiters(GpuTimeSegment& seg);

// Adds [from, to) to the tenant's throttled time, counting only what lies
// past its mark, so that overlapping waits of several threads or processes
// count once.
void add_throttled(TenantTime& tenant, uint64_t from, uint64_t to);

}  // namespace fracgpu::gputime

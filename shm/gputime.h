// Operations on a GPU's time arbiter (layout and rules in
// include/fracgpu/gputime_layout.h; the policy in docs/sm-time.md).
//
// Callers: the daemon's scheduler (controller/daemon/gpu_scheduler.*: creates the
// file, the only writer), the interposer (maps it read-only, reads the
// grant, asks and reports through its own usage file's GpuTimeRequest) and
// the CLI (reads). Like the ledger: nothing here allocates, throws or logs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fracgpu/gputime_layout.h"
#include "ledger.h"

namespace fracgpu::gputime {

using ledger::GpuTimeRequest;
using ledger::LedgerError;

struct Arbiter {
  GpuTimeSegment* seg = nullptr;  // read-only mapping unless opened for writing
  int fd = -1;

  bool is_open() const { return seg != nullptr; }
};

// Maps an arbiter file, read-write (the daemon) or read-only (everyone else).
// With `create`, a missing file is created complete (temporary name, then
// link) with mode 0644 and stamped with `uuid`. An existing file's header is
// validated: magic, version, size, and, when `uuid` is given, that it
// governs that GPU. The rest is validated by readers as they read it.
LedgerError open_arbiter(const char* path, bool create, bool read_only, const uint8_t* uuid, Arbiter* out, char* err,
                         size_t err_len);
void close_arbiter(Arbiter* arbiter);

// True if the header is what open_arbiter accepted (the daemon re-checks its
// own file, which root may have overwritten).
bool header_valid(const GpuTimeHeader& header, const uint8_t* uuid);
// Writes a valid header (daemon).
void stamp_header(GpuTimeHeader& header, const uint8_t* uuid);

using ledger::monotonic_ns;

// ---- Tenants ----

// Index of the row named `name` (any state but unused), or -1.
int find_tenant(const GpuTimeSegment& seg, const char* name);
// Daemon: the row for `name`, appending one if needed; -1 if full.
int bind_tenant(GpuTimeSegment& seg, const char* name);

// ---- Policy arithmetic (the daemon's scheduler; here so tests and docs share it) ----

// Whether a tenant's processes ask for grants of a GPU: when another tenant
// has a share of it too (`active_tenants`, DaemonSection), or the tenant's
// limit is below a whole GPU. Alone there with no limit, they run unshared.
// The interposer decides by it; the daemon and `fracgpu status` follow it.
constexpr bool gated(uint32_t active_tenants, uint32_t limit_ppm) { return active_tenants > 1 || limit_ppm < kPpm; }

// The limit: a tenant may be granted the GPU while its GCRA arrival time is
// at most this far ahead of now, i.e. it may burst this long above its
// limit after idling.
inline constexpr uint64_t kLimitBurstNs = 50'000'000;
// A tenant returning from idle is lifted to the others' virtual time minus
// this much real time at its share: it cannot bank idle time, yet a
// newcomer is served first.
inline constexpr uint64_t kReturnCreditNs = 20'000'000;

// ns * kPpm / ppm, saturating; ppm 0 (no share: best effort) weighs like the
// smallest share there is.
uint64_t scale(uint64_t ns, uint32_t ppm);
uint64_t saturating_add(uint64_t a, uint64_t b);

// True if a tenant whose GCRA arrival time is `tat` may use the GPU at `now`
// under `limit_ppm`, with a burst of `burst_ns`; a limit of a whole GPU never
// stops it. *eligible_at (if given) is when it may, else 0.
bool within_limit(uint64_t tat, uint32_t limit_ppm, uint64_t now, uint64_t* eligible_at,
                  uint64_t burst_ns = kLimitBurstNs);
// The arrival time after using `ns` of GPU time at `limit_ppm`: time left
// unused is credited only up to the burst (it never falls behind
// credit_from - burst_ns).
uint64_t advance_limit(uint64_t tat, uint64_t ns, uint32_t limit_ppm, uint64_t credit_from,
                       uint64_t burst_ns = kLimitBurstNs);

// ---- Timing constants of the protocol ----

// A revocation waits this long for the holder's processes to drain; past it
// the GPU goes on (their work's tail then shares the GPU through the
// driver's own time-slicing) and the tenant is not granted again until one
// of those processes reports its drain (or all of them die).
inline constexpr uint64_t kDrainDeadlineNs = 100'000'000;
// A holder that has not launched for this long while another tenant wants
// the GPU is revoked; with nobody else wanting, after kLoneIdleNs.
inline constexpr uint64_t kIdleNs = 2'000'000;
inline constexpr uint64_t kLoneIdleNs = 20'000'000;
// A process's want counts only while it renews it (GpuTimeRequest::poll_ns)
// at least this often; its waiting threads and pacer do every few ms.
inline constexpr uint64_t kWantFreshNs = 50'000'000;
// Tenant processes run unshared while the daemon's heartbeat is older than
// this (or absent, or in the future): "the daemon is down".
inline constexpr uint64_t kDaemonDownNs = 1'000'000'000;

// True while the daemon's scheduler heartbeats (see kDaemonDownNs).
bool daemon_alive(const GpuTimeSegment& seg, uint64_t now);

// ---- Futexes ----

// On grant.turn: sleeps until it differs from `seen` or `timeout_ns` passes.
void wait_for_turn(const GpuTimeSegment& seg, uint32_t seen, uint64_t timeout_ns);
// Wakes every sleeper on grant.turn (daemon, after changing the grant).
void wake_turn(GpuTimeSegment& seg);
// Tenant processes: wakes the daemon's scheduler (a FUTEX_WAKE through a
// read-only mapping: the word's value never changes).
void ring_doorbell(const GpuTimeSegment& seg);
// Daemon: sleeps on the doorbell until rung or `timeout_ns` passes.
void wait_for_doorbell(GpuTimeSegment& seg, uint64_t timeout_ns);

// ---- The drain handshake, process side ----
//
// Entering grant G (a process may launch under it only after this returns
// true): the process stores entered_grant = G, then re-reads its tenant's
// grant word (TenantTime::grant);
// the daemon, to revoke, stores that word "revoking G", then reads every
// slot's entered_grant. All four accesses are seq_cst, so they fall in one
// total order: if the process's re-read comes before the daemon's store, its
// own store came earlier still, and the daemon's read (after its store)
// sees entered_grant = G: the daemon waits for this process's drain. (A
// process entering again a grant it reported drained clears that report
// before its store, so that read also finds it not drained.) If the
// re-read comes after the store, the process sees "revoking" and does not
// open; it reports G drained at once (it launched nothing under G), in case
// the daemon saw its entered_grant. Either way no process launches under a
// grant whose revocation did not wait for it.
//
// True: the process may open its gate under the grant in `word` (granted,
// to `row`). False: the grant moved on meanwhile; drained_grant was set.
bool enter_grant(const GpuTimeSegment& seg, GpuTimeRequest& request, uint64_t word);
// After closing the gate and draining: reports grant `seq` drained and
// rings the doorbell.
void report_drained(const GpuTimeSegment& seg, GpuTimeRequest& request, uint64_t seq);

}  // namespace fracgpu::gputime

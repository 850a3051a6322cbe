// The GPU-time arbiter's shared-memory layout: one file per managed GPU,
// written by the daemon only, read by every process of every tenant granted
// a share of that GPU.
//
//   <run dir>/gpus/<GPU UUID>/gputime    created by the daemon, mode 0644
//   <tenant dir>/gputime-<entry>         a hard link to it, for each GPU
//                                        entry of the tenant's policy
//
// The hard links make the one file reachable through each tenant's directory,
// which is all a container mounts (read-only); futexes are keyed by the
// inode, so they work across links, mounts and PID namespaces.
//
// How time is shared (see docs/sm-time.md): the daemon grants the GPU to
// tenants, each through its own grant word (TenantTime::grant), so several
// may hold it at once when the GPU has room (measured mode), or one at a
// time (held mode); every process of a holding tenant may launch, the
// others wait. The daemon's scheduler decides alone:
// tenants only ask, through the GPU-time request section of their own usage
// file (ledger_layout.h, GpuTimeRequest), and the daemon treats everything
// it reads there as a claim (clamped, checked against the current grant,
// its effect bounded to the tenant that wrote it).
//
// A grant ends with a drain handshake: the daemon marks the grant
// "revoking"; each process of the holder that entered the grant closes its
// gate, waits for its work to finish and says so (drained_grant); the
// revocation completes when all have, have died, or a deadline passes.
//
// Rules for everything below:
//  - integer atomics only; the daemon may be SIGKILLed at any instant;
//  - an all-zero file is a valid, empty arbiter (no tenant, no holder);
//  - the daemon is the only writer. Tenant processes map the file
//    read-only; the two futex words are the only thing they touch, by
//    waiting on `turn` and waking `doorbell` (neither changes a value);
//  - readers validate what they read (a file may be from an older run, or
//    damaged): an out-of-range value means "the daemon is not scheduling",
//    and a process then runs unshared, as it does while the daemon is down.
//
// Any change to this file that moves a byte must bump kGpuTimeLayoutVersion.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace fracgpu::gputime {

inline constexpr uint32_t kGpuTimeLayoutVersion = 3;  // 3: a grant word per tenant, measured GPU time
inline constexpr uint32_t kMaxTenants = 64;  // tenants with a share of one GPU
inline constexpr uint32_t kTenantNameBytes = 64;

// "FRGTIME1" read as a little-endian integer.
inline constexpr uint64_t kGpuTimeMagic = 0x31454d4954475246ULL;
inline constexpr const char* kGpuTimeFileName = "gputime";
inline constexpr const char* kGpusDirName = "gpus";
inline constexpr uint32_t kPpm = 1'000'000;
inline constexpr uint64_t kDefaultSliceNs = 20'000'000;
inline constexpr uint32_t kWaitWindow = 1024;  // waits the TenantTime percentiles are taken over

struct GpuTimeHeader {
  uint64_t magic;           // kGpuTimeMagic
  uint32_t layout_version;  // kGpuTimeLayoutVersion
  uint32_t header_bytes;    // sizeof(GpuTimeHeader)
  uint64_t segment_bytes;   // sizeof(GpuTimeSegment)
  uint8_t uuid[16];         // the GPU this arbiter governs
  uint64_t reserved[2];
};
static_assert(sizeof(GpuTimeHeader) == 56);

// A grant, one 64-bit word so that readers see its parts together:
//   bits 63..16  sequence number of the grant (a new one for every grant)
//   bits 15..8   tenant row of the holder
//   bits  7..0   GrantState
// Sequence numbers only grow, across daemon restarts too (a restarted
// daemon starts above both the file's last one and the monotonic clock in
// microseconds), so a grant a process entered is never mistaken for a later one.
enum GrantState : uint32_t {
  kGrantIdle = 0,      // nobody holds the GPU
  kGranted = 1,        // the tenant in `row` holds it: its processes may launch
  kGrantRevoking = 2,  // it is being taken back: its processes close and drain
};
inline constexpr uint64_t kMaxGrantSeq = (1ull << 48) - 1;

constexpr uint64_t grant_word(uint64_t seq, uint32_t row, uint32_t state) {
  return (seq & kMaxGrantSeq) << 16 | static_cast<uint64_t>(row & 0xff) << 8 | (state & 0xff);
}
constexpr uint64_t grant_seq(uint64_t word) { return word >> 16; }
constexpr uint32_t grant_row(uint64_t word) { return static_cast<uint32_t>(word >> 8) & 0xff; }
constexpr uint32_t grant_state(uint64_t word) { return static_cast<uint32_t>(word) & 0xff; }
// A word a reader may act on: a known state, and a row in range when held.
constexpr bool grant_valid(uint64_t word) {
  return grant_state(word) == kGrantIdle ||
         ((grant_state(word) == kGranted || grant_state(word) == kGrantRevoking) && grant_row(word) < kMaxTenants &&
          grant_seq(word) != 0);
}

// The futex every waiter sleeps on, and the latest grant. Processes act on
// their own tenant's word (TenantTime::grant) only; `word` here is the
// latest grant or revocation made, for display.
struct alignas(64) GrantSection {
  std::atomic<uint64_t> word;       // grant_word(...) of the latest change (informational)
  std::atomic<uint32_t> turn;       // futex word, bumped after every change of any grant word
  uint32_t reserved0;
  std::atomic<uint64_t> grant_ns;   // CLOCK_MONOTONIC when the latest grant began
  std::atomic<uint64_t> revoke_ns;  // when the latest revocation began; 0 while none is under way
  std::atomic<uint64_t> handovers;  // grants made, total
  uint64_t reserved[3];
};
static_assert(sizeof(GrantSection) == 64);

// The daemon's side: liveness, configuration of the whole GPU, and the
// futex it sleeps on between scheduling passes.
struct alignas(64) DaemonSection {
  // Tenant processes FUTEX_WAKE it (through their read-only mapping) when
  // they start wanting the GPU or finish a drain; nobody ever changes it.
  std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> active_tenants;        // tenants configured with a share of this GPU
  std::atomic<uint64_t> daemon_heartbeat_ns;   // CLOCK_MONOTONIC of the scheduler's last pass; 0: stopped
  std::atomic<uint64_t> slice_ns;              // length of a time slice; 0: kDefaultSliceNs
  std::atomic<uint64_t> drain_deadline_ns;     // how long a revocation waits for drains (informational)
  std::atomic<uint32_t> charging;              // ChargeMode: how tenants are charged now
  std::atomic<uint32_t> busy_ppm;              // GPU busy (measured, all processes) over the last ~10 ms
  // The driver's sampling period as the meter sees it (the gap between its
  // samples); 0: no meter answers. Held mode audits with it (docs/sm-time.md).
  std::atomic<uint64_t> sample_period_ns;
  // While a latency tenant is active on this GPU (docs/sm-time.md,
  // "Latency tenants"): how much GPU time a process of any other tenant may
  // keep queued on it (its own streams' events say what is still in flight;
  // one launch at least). 0: no pacing, queue as deep as you like.
  std::atomic<uint64_t> pace_inflight_ns;
  uint64_t reserved[1];
};
static_assert(sizeof(DaemonSection) == 64);

// DaemonSection::charging.
enum ChargeMode : uint32_t {
  kChargeHeld = 0,      // charged the time they hold the GPU, one holder at a time (plus what the audit finds)
  kChargeMeasured = 1,  // charged the GPU time the driver measured; several may hold it at once
};

enum TenantTimeState : uint32_t {
  kTenantUnused = 0,
  kTenantActive = 1,   // configured with a share of this GPU
  kTenantRetired = 2,  // no longer configured here; keeps its statistics
};

// TenantTime::priority: how urgently a tenant's work goes on the GPU. The
// zero value is normal, so an all-zero row is an ordinary tenant.
enum TenantPriority : uint32_t {
  kPriorityNormal = 0,
  kPriorityBatch = 1,    // yields first: a normal or latency tenant within its share takes the GPU from it at once
  kPriorityLatency = 2,  // within its share, takes the GPU from the others at once; they are paced meanwhile
};
// Order of precedence: batch < normal < latency (anything else reads as normal).
constexpr int priority_rank(uint32_t priority) {
  return priority == kPriorityBatch ? 0 : priority == kPriorityLatency ? 2 : 1;
}
inline constexpr int kLatencyRank = priority_rank(kPriorityLatency);

// TenantTime::flags, the scheduler's view of the tenant for `fracgpu status`.
enum TenantTimeFlags : uint32_t {
  kTenantWants = 1u << 0,    // a live process of the tenant asks for the GPU
  kTenantBlocked = 1u << 1,  // missed a drain deadline: not granted again until it shows progress
  kTenantSideBySide = 1u << 2,  // holds the GPU beside others, sharing it through the driver's time slices
  kTenantYields = 1u << 3,  // a process of it outside the gate was found at work lately: it gives way to the others
  kTenantTakesTurns = 1u << 4,  // found taking more than its part of the driver's turns side by side: it takes turns
};

// One tenant's standing on this GPU. A row is bound to a tenant name for
// the life of the file (the daemon only appends), so processes can cache it.
// All of it is the daemon's.
struct alignas(64) TenantTime {
  std::atomic<uint32_t> state;             // TenantTimeState, published with release
  std::atomic<uint32_t> share_ppm;         // guaranteed share (processes read their own policy)
  std::atomic<uint32_t> limit_ppm;         // cap
  std::atomic<uint32_t> achieved_1s_ppm;   // GPU time used (measured; else charged) over the last 1 s
  std::atomic<uint32_t> achieved_10s_ppm;  // ... over the last 10 s
  std::atomic<uint32_t> flags;             // TenantTimeFlags
  char name[kTenantNameBytes];             // NUL-terminated; written before state leaves kTenantUnused

  std::atomic<uint64_t> vtime;          // virtual time: sum of (GPU ns charged) * kPpm / share_ppm
  std::atomic<uint64_t> used_ns;        // GPU time charged, total (see docs/sm-time.md, "What is charged")
  std::atomic<uint64_t> throttled_ns;   // time it wanted the GPU and did not hold it, total
  std::atomic<uint64_t> cap_tat_ns;     // limit: GCRA theoretical arrival time (CLOCK_MONOTONIC)
  std::atomic<uint64_t> slices;         // grants it was given
  std::atomic<uint32_t> waiting_processes;  // its live processes asking for the GPU (last pass)
  std::atomic<uint32_t> missed_deadlines;   // revocations that hit the drain deadline, total
  // This tenant's grant: grant_word(seq, this row, state), stored seq_cst
  // (the drain handshake); its processes launch only under it.
  std::atomic<uint64_t> grant;
  std::atomic<uint64_t> measured_ns;  // GPU time its processes used, as the meter measured it, total
  std::atomic<uint64_t> held_ns;      // time it held a grant (revocations included), total
  // Held mode's audit: GPU time the driver's samples found its processes
  // using while it held no grant (charged to it), and how many samples.
  std::atomic<uint64_t> out_of_grant_ns;
  std::atomic<uint64_t> out_of_grant_samples;
  std::atomic<uint32_t> priority;  // TenantPriority, as configured
  uint32_t reserved32;
  // Latency tenants: how long it waited for the GPU, from a process asking
  // to the grant, as the scheduler saw it, over its last kWaitWindow waits
  // (percentiles, ns), and how many waits it had in all. 0 for others.
  std::atomic<uint64_t> wait_p50_ns;
  std::atomic<uint64_t> wait_p99_ns;
  std::atomic<uint64_t> wait_p999_ns;
  std::atomic<uint64_t> waits;
  uint64_t reserved[5];
};
static_assert(sizeof(TenantTime) == 256);
static_assert(offsetof(TenantTime, name) == 24);
static_assert(offsetof(TenantTime, vtime) == 88);
static_assert(offsetof(TenantTime, grant) == 136);

struct GpuTimeSegment {
  GpuTimeHeader header;
  std::atomic<uint64_t> generation;  // bumped by the daemon after each configuration change
  GrantSection grant;                // at offset 64
  DaemonSection daemon;              // at offset 128
  std::atomic<uint64_t> min_vtime;   // floor for tenants that come back from idle (monotonic)
  uint64_t reserved[7];
  TenantTime tenants[kMaxTenants];
};
static_assert(offsetof(GpuTimeSegment, grant) == 64);
static_assert(offsetof(GpuTimeSegment, daemon) == 128);
static_assert(offsetof(GpuTimeSegment, min_vtime) == 192);
static_assert(offsetof(GpuTimeSegment, tenants) == 256);
static_assert(sizeof(GpuTimeSegment) == 256 + 256 * kMaxTenants);

}  // namespace fracgpu::gputime

// The ledger's shared-memory layout: the one contract between the interposer
// (in every tenant process), the node daemon and the CLI.
//
// Each tenant owns a directory holding two files, mapped by every process of
// that tenant:
//
//   <tenant dir>/policy   written by the daemon only; tenants map it read-only.
//                         Quotas live here, so a tenant cannot raise its own.
//   <tenant dir>/usage    read-write for the tenant's processes: process slots,
//                         the bytes each slot has charged on each GPU, and
//                         each slot's requests to the GPU-time arbiters.
//   <tenant dir>/node     a hard link to <run_dir>/node, one file for the whole
//                         node, written by the daemon only: the generation of
//                         policy in force on every tenant (NodeSegment below).
//
// Rules for everything below:
//  - integer atomics only: no pointers, no semaphores, no pthread mutexes,
//    because any process may be SIGKILLed at any instant;
//  - an all-zero file is a valid, empty segment (no GPU granted, no process);
//  - a slot's liveness is a POSIX record lock on one byte of the usage file,
//    held by its owner for its whole life and dropped by the kernel when the
//    owner dies, whatever PID namespace the owner lives in;
//  - a tenant's usage on a GPU is *defined* as the sum of its slots' charges,
//    so reclaiming a dead process is zeroing its slot: no total can drift.
//
// Any change to this file that moves a byte must bump kLayoutVersion.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <sys/types.h>

namespace fracgpu::ledger {

inline constexpr uint32_t kLayoutVersion = 2;
inline constexpr uint32_t kMaxGpus = 16;    // GPUs one tenant may ever be granted
inline constexpr uint32_t kMaxSlots = 256;  // live processes per tenant
inline constexpr uint32_t kTenantNameBytes = 64;
inline constexpr uint64_t kUnlimited = UINT64_MAX;

// "FRGPOLCY", "FRGUSAGE" and "FRGPNODE" read as little-endian integers.
inline constexpr uint64_t kPolicyMagic = 0x59434c4f50475246ULL;
inline constexpr uint64_t kUsageMagic = 0x4547415355475246ULL;
inline constexpr uint64_t kNodeMagic = 0x45444f4e50475246ULL;

inline constexpr const char* kPolicyFileName = "policy";
inline constexpr const char* kUsageFileName = "usage";
inline constexpr const char* kNodeFileName = "node";

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int32_t>::is_always_lock_free);

// First bytes of both files. All zero means "fresh": valid and empty.
struct SegmentHeader {
  uint64_t magic;           // kPolicyMagic / kUsageMagic
  uint32_t layout_version;  // kLayoutVersion
  uint32_t header_bytes;    // sizeof(SegmentHeader)
  uint64_t segment_bytes;   // sizeof(PolicySegment) / sizeof(UsageSegment)
  uint64_t reserved;
};
static_assert(sizeof(SegmentHeader) == 32);

enum GpuGrantState : uint32_t {
  kGpuUnused = 0,   // entry never bound to a GPU
  kGpuGranted = 1,  // the tenant may use this GPU within the limits below
  kGpuRevoked = 2,  // was granted, no longer is: new charges are refused
};

// Why new processes may not start on a GPU (GpuPolicy::unavailable). Written
// by the daemon's health probe and bypass audit (docs/operations.md); read by
// the interposer at cuInit only, so processes already running keep running.
enum GpuUnavailableReason : uint32_t {
  kGpuAvailable = 0,
  kGpuLost = 1,          // NVML cannot reach the GPU (lost, fallen off the bus, not listed)
  kGpuXid = 2,           // a critical Xid error was reported; detail: the Xid
  kGpuEcc = 3,           // uncorrected ECC errors since the driver loaded; detail: the count
  kGpuSensors = 4,       // temperature or power cannot be read
  kGpuBypassDenied = 5,  // a process of this tenant uses the GPU without the interposer; detail: its PID
};

enum GpuPolicyFlags : uint32_t {
  kCountManagedMemory = 1u << 0,  // cuMemAllocManaged is charged to the quota
  // The tenant is being deleted (draining): a process that attaches now is
  // denied; processes already attached keep running within their quotas.
  // Set on every granted entry of the tenant. Was always 0, so the layout
  // version did not change.
  kTenantDraining = 1u << 1,
};

// One GPU granted to the tenant. An entry is bound to one GPU UUID for the
// life of the segment (usage charges are indexed by entry): each copy the
// daemon writes keeps the committed copy's bindings and only ever appends.
struct alignas(64) GpuPolicy {
  std::atomic<uint32_t> state;            // GpuGrantState, published with release
  std::atomic<uint32_t> flags;            // GpuPolicyFlags
  uint8_t uuid[16];                       // CUuuid bytes of the GPU
  std::atomic<uint64_t> memory_quota;     // bytes; kUnlimited: no memory limit
  std::atomic<uint64_t> context_memory;   // bytes charged per context on this GPU
  std::atomic<uint32_t> share_ppm;        // guaranteed GPU-time share, parts per million
  std::atomic<uint32_t> limit_ppm;        // GPU-time cap, parts per million
  // GpuUnavailableReason; not kGpuAvailable: cuInit refuses new processes.
  std::atomic<uint32_t> unavailable;
  std::atomic<uint32_t> unavailable_detail;  // Xid, ECC count or PID, for the message
  uint64_t reserved;
};
static_assert(sizeof(GpuPolicy) == 64);
static_assert(offsetof(GpuPolicy, unavailable) == 48);
static_assert(offsetof(GpuPolicy, uuid) == 8);
static_assert(offsetof(GpuPolicy, memory_quota) == 24);
static_assert(offsetof(GpuPolicy, context_memory) == 32);
static_assert(offsetof(GpuPolicy, share_ppm) == 40);

// Policy changes are atomic across the whole node: every tenant's policy
// holds two copies of its GPU table, each stamped with the generation it was
// written for, and the node file says which generation is in force. A reload
// (or a start that changes policies) writes every tenant's *other* copy for
// generation G+1, and only then stores G+1 into the node file: one store,
// the commit point. A daemon killed at any instant before it leaves every
// tenant at G, after it every tenant at G+1; never a mix. Then the copies of
// G are retired (kStampRetired): only the copy in force is ever complete
// between changes, so no node file could point a tenant back at an older one.
//
// Readers (shm/ledger.h: committed_gpus, read_gpu_table) load the committed
// generation G, read copies[G & 1], and accept what they read only if that
// copy is still stamped G afterwards (a seqlock: the daemon sets the stamp to
// kStampWriting before it rewrites a copy). A copy stamped otherwise than the
// committed generation (the tenant is newer than it, or the node file was
// recreated) grants nothing. Health and audit marks (`unavailable`), which
// change outside reloads, are written into both copies.
inline constexpr uint64_t kStampWriting = UINT64_MAX;
inline constexpr uint64_t kStampRetired = UINT64_MAX - 1;

struct alignas(64) PolicyCopy {
  std::atomic<uint64_t> stamp;  // the generation it holds; kStampWriting while rewritten, kStampRetired after
  uint64_t reserved[7];
  GpuPolicy gpus[kMaxGpus];
};
static_assert(offsetof(PolicyCopy, gpus) == 64);
static_assert(sizeof(PolicyCopy) == 64 + 64 * kMaxGpus);

struct PolicySegment {
  SegmentHeader header;
  char tenant[kTenantNameBytes];              // NUL-terminated tenant name
  uint64_t reserved1;                         // was the per-tenant generation (layout 1)
  std::atomic<uint64_t> daemon_heartbeat_ns;  // CLOCK_MONOTONIC of the daemon's last pass
  std::atomic<int32_t> daemon_pid;            // in the daemon's PID namespace
  uint32_t reserved0;
  uint64_t reserved[5];
  PolicyCopy copies[2];  // the GPU table of generation G is copies[G & 1], if stamped G
};
static_assert(offsetof(PolicySegment, tenant) == 32);
static_assert(offsetof(PolicySegment, daemon_heartbeat_ns) == 104);
static_assert(offsetof(PolicySegment, copies) == 192);
static_assert(sizeof(PolicySegment) == 192 + 2 * sizeof(PolicyCopy));

// <run_dir>/node (0644), hard-linked into every tenant directory as `node`
// (containers mount it read-only with the rest of the tenant directory).
// Written by the daemon only. All zero: generation 0, whose copy of a fresh
// policy (all zero, stamped 0) grants nothing.
struct NodeSegment {
  SegmentHeader header;
  std::atomic<uint64_t> committed;  // the generation of policy in force on the node
  uint64_t reserved[3];
};
static_assert(offsetof(NodeSegment, committed) == 32);
static_assert(sizeof(NodeSegment) == 64);

enum SlotState : uint32_t {
  kSlotFree = 0,
  kSlotLive = 1,  // the owner holds the slot's record lock
};

// One attached process. Written by its owner; cleared by whoever reclaims it
// after taking its record lock (which proves the owner is gone).
struct alignas(64) ProcessSlot {
  std::atomic<uint32_t> state;        // SlotState
  std::atomic<int32_t> pid;           // as the owner sees itself (its PID namespace)
  std::atomic<uint64_t> start_time;   // owner's start time, clock ticks since boot
  std::atomic<uint64_t> attach_ns;    // CLOCK_REALTIME when it attached
  char comm[16];                      // owner's command name, NUL-terminated
  // CLOCK_MONOTONIC when a reclaimer first found the owner gone; 0 while the
  // owner lives. Charges are dropped only a grace period after that (see
  // kReclaimGraceNs in shm/ledger.h).
  std::atomic<uint64_t> orphaned_ns;
  // The owner's PID in the daemon's PID namespace (the host's, for a daemon
  // run as documented), written by the daemon once the slot's record-lock
  // holder has the slot's start time; 0 until then, and reset by each new
  // owner. NVML keys per-process records by host PID: this is how a tenant
  // process tells its own tenant's among them. Was reserved (always 0), so
  // the layout version did not change.
  std::atomic<int32_t> host_pid;
  // The descriptor, in the owner's own table, through which it holds the
  // slot's lock: where the daemon looks (/proc/<pid>/fdinfo/<lock_fd>) to
  // see that the lock's holder holds it itself. The owner's word, so only a
  // place to look: a wrong one leaves its own process unverified. Was
  // reserved (always 0), so the layout version did not change.
  std::atomic<int32_t> lock_fd;
};
static_assert(sizeof(ProcessSlot) == 64);
static_assert(offsetof(ProcessSlot, orphaned_ns) == 40);
static_assert(offsetof(ProcessSlot, host_pid) == 48);
static_assert(offsetof(ProcessSlot, lock_fd) == 52);

// What one process asks of a GPU's time arbiter (gputime_layout.h), and
// what it says it did: the only channel from a tenant process to the
// daemon's scheduler. Written by the process owning the slot; cleared when
// a new owner claims the slot. The daemon reads all of it as a claim: times
// are clamped to its own clock, grant numbers count only when they equal
// the current grant's, and whatever is written here can only change how
// the daemon treats this tenant (docs/sm-time.md).
struct alignas(64) GpuTimeRequest {
  // CLOCK_MONOTONIC since when a thread of the process waits for the GPU; 0: none waits.
  std::atomic<uint64_t> want_since_ns;
  // CLOCK_MONOTONIC of its last launch (as its pacer saw it) while its tenant holds the GPU.
  std::atomic<uint64_t> last_active_ns;
  // Grant sequence number (gputime::grant_seq) under which it opened its launch gate.
  std::atomic<uint64_t> entered_grant;
  // Grant sequence number for which it closed its gate and drained its work.
  std::atomic<uint64_t> drained_grant;
  // For display only (fracgpu status): GPU time its tenant held while this
  // process had its gate open, and time it waited for the GPU, totals.
  std::atomic<uint64_t> used_ns;
  std::atomic<uint64_t> waited_ns;
  // CLOCK_MONOTONIC when the process last looked at the grant while asking
  // (its waiting threads and its pacer, every few milliseconds): a want
  // nobody renews (a stopped process) stops counting.
  std::atomic<uint64_t> poll_ns;
  // Contexts the process has launched into on this GPU (each gets turns of
  // its own from the driver): side by side counts them (docs/sm-time.md).
  // Was reserved (always 0), which reads as one.
  std::atomic<uint64_t> contexts;
};
static_assert(sizeof(GpuTimeRequest) == 64);
static_assert(offsetof(GpuTimeRequest, poll_ns) == 48);

struct UsageSegment {
  SegmentHeader header;
  std::atomic<uint32_t> slot_high_water;  // slots [0, high water) may hold charges
  uint32_t reserved0;
  // Pacing beside a latency tenant (docs/sm-time.md, "Latency tenants"),
  // shared by all of the tenant's processes and read by none but them (the
  // daemon never looks): per GPU entry, when the tenant's GPU work queued
  // so far is expected to end, in microseconds of CLOCK_MONOTONIC modulo
  // 2^32 (a budget for the whole tenant, not per process); and until when
  // (milliseconds, modulo 2^32) its processes pace one launch at a time,
  // since one of its kernels ran far past its estimate. Written by any of
  // its processes, so each reads them as claims: a value out of range is
  // ignored. Were reserved (always 0, which reads as nothing queued), so the
  // layout version did not change.
  std::atomic<uint32_t> pace_end_us[kMaxGpus];
  std::atomic<uint32_t> pace_strict_until_ms;
  uint32_t reserved1;
  uint64_t reserved[2];
  ProcessSlot slots[kMaxSlots];
  // Bytes charged by slot s on GPU entry g. A row per GPU, so summing one
  // GPU's usage reads consecutive words of only the slots ever used.
  std::atomic<uint64_t> charges[kMaxGpus][kMaxSlots];
  // Slot s's requests to the time arbiter of GPU entry g (layout version 2).
  GpuTimeRequest gputime[kMaxGpus][kMaxSlots];
};
static_assert(offsetof(UsageSegment, slot_high_water) == 32);
static_assert(offsetof(UsageSegment, pace_end_us) == 40);
static_assert(offsetof(UsageSegment, slots) == 128);
static_assert(offsetof(UsageSegment, charges) == 128 + 64 * kMaxSlots);
static_assert(offsetof(UsageSegment, gputime) == 128 + 64 * kMaxSlots + 8 * kMaxGpus * kMaxSlots);
static_assert(sizeof(UsageSegment) ==
              128 + 64 * kMaxSlots + 8 * kMaxGpus * kMaxSlots + sizeof(GpuTimeRequest) * kMaxGpus * kMaxSlots);

// The byte of the usage file whose record lock means "slot s is owned".
constexpr off_t slot_lock_offset(uint32_t slot) {
  return static_cast<off_t>(offsetof(UsageSegment, slots) + slot * sizeof(ProcessSlot));
}

}  // namespace fracgpu::ledger

// The GPU-time arbiter's shared-memory layout: one file per managed GPU,
// shared by every process of every tenant granted a share of that GPU.
//
//   <run dir>/gpus/<GPU UUID>/gputime    created by the daemon, mode 0666
//   <tenant dir>/gputime-<entry>         a hard link to it, for each GPU
//                                        entry of the tenant's policy
//
// The hard links make the one file reachable through each tenant's directory,
// which is all a container mounts; record locks and futexes are keyed by the
// inode, so they work across links, mounts and PID namespaces.
//
// How time is shared (see docs/sm-time.md): exclusive time slices. At most one
// process holds a GPU at a time; only the holder's launches reach the driver.
// Each tenant has a virtual time that advances by (GPU time used) / share, and
// the next holder is a waiting process of the tenant with the smallest virtual
// time that is within its limit. The holder hands the GPU on when its slice is
// used up and someone waits, when it stops launching, or when its tenant
// reaches its limit; it first drains its own work, so GPU time is charged to
// whoever occupied the GPU.
//
// Rules for everything below (as for the ledger):
//  - integer atomics only; any process may be SIGKILLed at any instant;
//  - an all-zero file is a valid, empty arbiter (no tenant, no holder);
//  - a process entry's liveness is a POSIX record lock on one byte of this
//    file, held by its owner, dropped by the kernel when it dies;
//  - scheduling state (holder, virtual times, charges) is written only by the
//    process that holds the GPU (it won `holder` by compare-and-swap), or by
//    whoever takes the GPU over from a dead holder: one writer at a time;
//  - the daemon writes only the tenant table's configuration and statistics;
//  - waiting processes add to their tenant's throttled time (an atomic sum).
//
// Any change to this file that moves a byte must bump kGpuTimeLayoutVersion.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <sys/types.h>

namespace fracgpu::gputime {

inline constexpr uint32_t kGpuTimeLayoutVersion = 1;
inline constexpr uint32_t kMaxTenants = 64;     // tenants with a share of one GPU
inline constexpr uint32_t kMaxProcesses = 256;  // processes of all tenants on one GPU
inline constexpr uint32_t kTenantNameBytes = 64;

// "FRGTIME1" read as a little-endian integer.
inline constexpr uint64_t kGpuTimeMagic = 0x31454d4954475246ULL;
inline constexpr const char* kGpuTimeFileName = "gputime";
inline constexpr const char* kGpusDirName = "gpus";
inline constexpr uint32_t kPpm = 1'000'000;
inline constexpr uint64_t kDefaultSliceNs = 20'000'000;

struct GpuTimeHeader {
  uint64_t magic;           // kGpuTimeMagic
  uint32_t layout_version;  // kGpuTimeLayoutVersion
  uint32_t header_bytes;    // sizeof(GpuTimeHeader)
  uint64_t segment_bytes;   // sizeof(GpuTimeSegment)
  uint8_t uuid[16];         // the GPU this arbiter governs
  uint64_t reserved[2];
};
static_assert(sizeof(GpuTimeHeader) == 56);

enum TenantTimeState : uint32_t {
  kTenantUnused = 0,
  kTenantActive = 1,   // configured with a share of this GPU
  kTenantRetired = 2,  // no longer configured here; keeps its statistics
};

// One tenant's standing on this GPU. An entry is bound to a tenant name for
// the life of the file (the daemon only appends), so processes can cache it.
struct alignas(64) TenantTime {
  // Written by the daemon.
  std::atomic<uint32_t> state;      // TenantTimeState, published with release
  std::atomic<uint32_t> share_ppm;  // guaranteed share (informational: processes read their own policy)
  std::atomic<uint32_t> limit_ppm;  // cap
  std::atomic<uint32_t> achieved_1s_ppm;   // GPU time used over the last second / 1 s
  std::atomic<uint32_t> achieved_10s_ppm;  // ... over the last 10 s
  uint32_t reserved0;
  char name[kTenantNameBytes];  // NUL-terminated; written before state leaves kTenantUnused

  // Written by the holder (see the rules above).
  std::atomic<uint64_t> vtime;         // virtual time: sum of (GPU ns used) * kPpm / share_ppm
  std::atomic<uint64_t> used_ns;       // GPU time charged to the tenant, total
  std::atomic<uint64_t> throttled_ns;  // time its launches waited for the GPU (other holders or its limit)
  std::atomic<uint64_t> cap_tat_ns;    // limit: GCRA theoretical arrival time (CLOCK_MONOTONIC)
  std::atomic<uint64_t> slices;        // times a process of the tenant was given the GPU
  // Written by its waiting processes.
  std::atomic<uint64_t> throttled_mark_ns;  // throttled_ns counts waits up to here (overlaps count once)
  uint64_t reserved[2];
};
static_assert(sizeof(TenantTime) == 192);
static_assert(offsetof(TenantTime, name) == 24);
static_assert(offsetof(TenantTime, vtime) == 88);

enum ProcessTimeState : uint32_t {
  kProcessFree = 0,
  kProcessLive = 1,  // its owner holds the entry's record lock
};

// One process using this GPU. Written by its owner; cleared by whoever
// reclaims it after taking its record lock (which proves the owner is gone).
struct alignas(64) ProcessTime {
  std::atomic<uint32_t> state;          // ProcessTimeState
  std::atomic<uint32_t> tenant;         // index into GpuTimeSegment::tenants
  std::atomic<int32_t> pid;             // as the owner sees itself
  std::atomic<uint32_t> reserved0;
  std::atomic<uint64_t> want_since_ns;  // CLOCK_MONOTONIC since it waits for the GPU; 0: not waiting
  std::atomic<uint64_t> start_time;     // owner's start time (clock ticks since boot), identity
  std::atomic<uint64_t> used_ns;        // GPU time charged to this process, total
  std::atomic<uint64_t> waited_ns;      // time it spent waiting for the GPU, total
  uint64_t reserved[2];
};
static_assert(sizeof(ProcessTime) == 64);

// The holder: who may launch now, and the futex waiters sleep on.
struct alignas(64) HolderState {
  std::atomic<uint32_t> holder;        // process index + 1; 0: nobody holds the GPU
  std::atomic<uint32_t> turn;          // futex word, bumped after every change of holder
  std::atomic<uint64_t> grant_ns;      // when the holder got the GPU
  std::atomic<uint64_t> charged_ns;    // up to when the holder's time has been charged
  std::atomic<uint64_t> heartbeat_ns;  // the holder's last sign of life
  std::atomic<uint64_t> min_vtime;     // floor for tenants that come back from idle (monotonic)
  std::atomic<uint64_t> handovers;     // changes of holder, total
  std::atomic<uint64_t> idle_since_ns; // when the GPU was last released to nobody; 0 while held
};
static_assert(sizeof(HolderState) == 64);

struct GpuTimeSegment {
  GpuTimeHeader header;
  std::atomic<uint64_t> generation;           // bumped by the daemon after each configuration write
  HolderState arbiter;                        // at offset 64
  std::atomic<uint32_t> active_tenants;       // tenants in kTenantActive (daemon)
  std::atomic<uint32_t> process_high_water;   // entries [0, high water) may be live
  std::atomic<uint64_t> daemon_heartbeat_ns;  // CLOCK_MONOTONIC of the daemon's last pass
  std::atomic<uint64_t> slice_ns;             // length of a time slice (daemon); 0: kDefaultSliceNs
  uint64_t reserved[5];
  TenantTime tenants[kMaxTenants];
  ProcessTime processes[kMaxProcesses];
};
static_assert(offsetof(GpuTimeSegment, arbiter) == 64);
static_assert(offsetof(GpuTimeSegment, active_tenants) == 128);
static_assert(offsetof(GpuTimeSegment, tenants) == 192);
static_assert(offsetof(GpuTimeSegment, processes) == 192 + 192 * kMaxTenants);
static_assert(sizeof(GpuTimeSegment) == 192 + 192 * kMaxTenants + 64 * kMaxProcesses);

// The byte of the file whose record lock means "process entry p is owned".
constexpr off_t process_lock_offset(uint32_t p) {
  return static_cast<off_t>(offsetof(GpuTimeSegment, processes) + p * sizeof(ProcessTime));
}

}  // namespace fracgpu::gputime

// Operations on a tenant's ledger (layout in include/fracgpu/ledger_layout.h).
//
// Used by three kinds of caller with different rights:
//   - the interposer in a tenant process: policy read-only, usage read-write;
//   - the daemon: creates/adopts both files, writes policy, reclaims dead slots;
//   - the CLI: everything read-only.
// Files are opened through safe_file.h: one name at a time from a directory
// descriptor, never through a link, never a FIFO or device, and checked to be
// regular files of the exact size (and owner, for the daemon and the CLI)
// before they are mapped.
// Nothing here allocates after attach, throws, or logs: errors come back as a
// code plus a message in a caller-provided buffer, because the interposer
// calls this from inside arbitrary user processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <sys/types.h>

#include "fracgpu/ledger_layout.h"
#include "safe_file.h"

namespace fracgpu::ledger {

enum class LedgerError {
  kOk = 0,
  kMissing,       // the directory or a file does not exist
  kPermission,    // open/mmap refused
  kWrongSize,     // file size differs from this build's layout
  kForeign,       // magic does not match: not a fracgpu segment
  kWrongVersion,  // a fracgpu segment of another layout version
  kCorrupt,       // header fields or entries out of range
  kIo,            // any other system error
  kFull,          // no free process slot / GPU entry
  kRefused,       // not a regular file (a link, FIFO, device...), or not the expected owner's: never opened
};

const char* ledger_error_name(LedgerError e);

enum class AccessMode {
  kTenant,    // policy read-only, usage read-write (interposer)
  kDaemon,    // both read-write; creates missing files
  kReadOnly,  // both read-only (CLI, tests)
};

// A mapped tenant directory. Plain data, trivially destructible: safe to keep
// in a constant-initialized global of the interposer. close() unmaps.
struct TenantLedger {
  PolicySegment* policy = nullptr;  // read-only mapping unless kDaemon
  UsageSegment* usage = nullptr;
  int policy_fd = -1;
  int usage_fd = -1;  // record locks on slots are taken on this descriptor
  AccessMode mode = AccessMode::kReadOnly;

  bool is_open() const { return policy != nullptr && usage != nullptr; }
};

// Maps <dir>/policy and <dir>/usage. With kDaemon, missing files are created
// (complete before they get their name: safe_file.h) with modes 0644 (policy)
// and 0666 (usage), `tenant_name` is stamped into a fresh policy, and the
// blocks of existing files are reserved (files of older versions were
// sparse). Existing files are validated, never rewritten. On failure *out is
// untouched, and a one-line reason naming the file is written to err.
//
// `dir` is opened as given (links in it followed: the operator named it);
// the files in it are opened by name from that directory, refused if they
// are anything but regular files of this build's sizes. Owners checked:
// kDaemon, the daemon's euid; kReadOnly, the directory's owner; kTenant,
// none (inside a user namespace the owner may show as another user).
LedgerError open_ledger(const char* dir, AccessMode mode, const char* tenant_name, TenantLedger* out,
                        char* err, size_t err_len);
// The same in the directory `dirfd` (named `shown_dir` in messages), with the
// files' expected owner given (shm::kAnyOwner: not checked; kDirOwner: the
// directory's owner).
LedgerError open_ledger_at(int dirfd, const char* shown_dir, AccessMode mode, uid_t owner, const char* tenant_name,
                           TenantLedger* out, char* err, size_t err_len);
void close_ledger(TenantLedger* ledger);
// Unmaps and closes the usage file only (closing drops every record lock this
// process holds on it); the policy stays mapped.
void close_usage(TenantLedger* ledger);

// True if `dir` holds a policy or a usage file, or anything else by either
// name: tenant state, so a process there must never run unlimited. (A
// process whose directory has neither passes through, or is denied, by
// FRACGPU_UNMANAGED.)
bool has_tenant_state(const char* dir);

// The daemon, every reap: a usage file must stay exactly the layout's size.
// Grown (a tenant writing past the end, perhaps to fill the disk): cut back
// to size, which is safe for every mapping (none reaches past the layout).
// Shrunk: the tenant's mappings fault; the caller must treat the ledger as
// corrupt. *bytes (if given) is the size found.
enum class UsageSize { kOk, kTruncated, kShrunk, kError };
UsageSize enforce_usage_size(const TenantLedger& ledger, uint64_t* bytes);

// CLOCK_MONOTONIC in nanoseconds: the clock of every time stored in the
// ledgers and arbiters (comparable across processes, never set back).
uint64_t monotonic_ns();

// Validates a mapped segment header. All-zero is valid (fresh).
LedgerError check_header(const SegmentHeader& h, uint64_t expected_magic, uint64_t expected_bytes);

// ---- Shared files (also used by the GPU-time arbiter, shm/gputime.h) ----

using shm::set_error;

// Fills a freshly created, zeroed mapping (header, names) before it is published.
using StampFn = shm::FillFn;

// A POSIX record lock (F_WRLCK / F_UNLCK, never waiting) on one byte: how
// slots and arbiter entries prove their owner alive. Returns fcntl's result.
int set_byte_lock(int fd, off_t offset, short type);

// The expected owner of a shared file: the owner of the directory it is in.
inline constexpr uid_t kDirOwner = static_cast<uid_t>(-2);

// Creates `path` complete (shm::create_file_at: nameless, sized, stamped,
// then linked in), so no process can ever map a half-written file. If
// another creator wins the race, theirs is kept.
LedgerError create_segment_file(const char* path, mode_t mode, size_t bytes, StampFn stamp, const void* stamp_arg,
                                char* err, size_t err_len);

// Opens and maps `path` (MAP_SHARED), which must be a regular file exactly
// `bytes` long, owned by `owner` (shm::kAnyOwner: anyone), never a link.
// With create_mode != 0 a missing file is created first (create_segment_file).
// Headers are the caller's to check.
LedgerError map_shared_file(const char* path, bool writable, mode_t create_mode, size_t bytes, StampFn stamp,
                            const void* stamp_arg, void** map_out, int* fd_out, char* err, size_t err_len,
                            uid_t owner = kDirOwner);
// The same for `name` in the directory `dirfd`, shown as `shown_dir`.
LedgerError map_shared_file_at(int dirfd, const char* name, const char* shown_dir, bool writable, mode_t create_mode,
                               size_t bytes, StampFn stamp, const void* stamp_arg, uid_t owner, void** map_out,
                               int* fd_out, char* err, size_t err_len);

// ---- GPU entries (policy) ----

// Index of the granted-or-revoked entry for this UUID, or -1.
int find_gpu(const PolicySegment& policy, const uint8_t uuid[16]);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (hex digits of either case), as
// nvidia-smi and NVML write GPU UUIDs, to the 16 bytes policies are keyed by.
// False for anything else ("MIG-..." included), leaving `out` undefined.
bool parse_gpu_uuid_text(std::string_view text, uint8_t out[16]);

// Daemon only: the entry for this UUID, appending one if needed. -1 if full.
int bind_gpu(PolicySegment& policy, const uint8_t uuid[16]);

// ---- Charges (usage) ----

// Bytes the tenant has charged on GPU entry g: the sum over slots.
uint64_t tenant_used(const UsageSegment& usage, uint32_t gpu);

// Charges `bytes` to `slot` on entry `gpu` if the tenant stays within the
// entry's quota; otherwise charges nothing and returns false. Safe against
// any number of concurrent callers in any number of processes: the charge is
// published before the sum is read (sequentially consistent), so of two
// racing callers at least one sees the other, and their sum can never pass
// the quota. Callers racing at the very edge may both be refused, so a refusal
// is retried a few times while the quota, as last seen, still has room.
// A revoked or unused entry refuses everything but zero bytes.
bool try_charge(const PolicySegment& policy, UsageSegment& usage, uint32_t gpu, uint32_t slot,
                uint64_t bytes);

// Adds without any check (settling a charge the driver already made, e.g. a
// pool that grew past its reservation, when the caller has decided to keep it).
void force_charge(UsageSegment& usage, uint32_t gpu, uint32_t slot, uint64_t bytes);

// Returns bytes charged earlier by the same slot.
void uncharge(UsageSegment& usage, uint32_t gpu, uint32_t slot, uint64_t bytes);

// ---- Process slots ----

struct ProcessIdentity {
  int32_t pid;
  uint64_t start_time;  // /proc/self/stat field 22
  char comm[16];
};

// Reads this process's identity from /proc/self. Returns false on failure.
bool read_self_identity(ProcessIdentity* out);

// Claims a free slot for the calling process: takes the slot's record lock
// (kept until the process exits or calls release_slot), clears whatever a dead
// previous owner left, and publishes the identity. Returns the slot index or
// -1 (kFull / kIo in *error).
int claim_slot(TenantLedger& ledger, const ProcessIdentity& self, LedgerError* error);

// Gives a slot back while alive (its charges must already be zero).
void release_slot(TenantLedger& ledger, uint32_t slot);

// How long a dead owner's charges stay after its death was first seen. A
// process's record lock is dropped when its descriptors are closed at exit,
// but the driver may close its own a moment later and only then give the
// memory back: charges are held until the device has surely let go.
inline constexpr uint64_t kReclaimGraceNs = 100'000'000;

struct ReclaimResult {
  int reclaimed = 0;      // slots cleared
  uint64_t bytes = 0;     // what they held
  int pending = 0;        // owners seen gone, still within the grace period
};

// Reclaims every slot whose owner is gone: for each candidate, takes its
// record lock (possible only if no live process holds it); the first time,
// notes when; once kReclaimGraceNs have passed since, zeroes its charges and
// marks it free. Skips `own_slot` (POSIX record locks never conflict with
// the caller's own, so the caller must not probe its own slot).
ReclaimResult reclaim_dead_slots(TenantLedger& ledger, int own_slot);

// The PID (in the caller's PID namespace) of the process holding the slot's
// record lock: 0 if nobody holds it, -1 if the holder lives in a PID
// namespace the caller cannot see (the kernel reports its PID as 0). A
// process cannot see its own locks this way.
int32_t slot_owner_pid(const TenantLedger& ledger, uint32_t slot);

// Daemon: writes each live slot's host_pid (its owner's PID in the caller's
// namespace, checked against the slot's start time) and zeroes the others'.
// One F_GETLK and one /proc read per live slot. The slot's copy is for the
// tenant's own NVML view; a tenant can overwrite it, so anything that acts on
// other parties (the audits) uses `verified` instead: if given (kMaxSlots
// entries), each slot's PID as found here, 0 where none.
void record_host_pids(TenantLedger& ledger, int32_t* verified = nullptr);

// ---- Policy writes (daemon only) ----

void publish_policy_change(PolicySegment& policy);

}  // namespace fracgpu::ledger

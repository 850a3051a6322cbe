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

#include <atomic>
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
  NodeSegment* node = nullptr;      // <dir>/node; read-only mapping unless kDaemon
  int policy_fd = -1;
  int usage_fd = -1;  // record locks on slots are taken on this descriptor
  int node_fd = -1;
  AccessMode mode = AccessMode::kReadOnly;

  bool is_open() const { return policy != nullptr && usage != nullptr && node != nullptr; }
};

// Maps <dir>/policy, <dir>/usage and <dir>/node. With kDaemon, missing files
// are created (complete before they get their name: safe_file.h) with modes
// 0644 (policy, node) and 0666 (usage), `tenant_name` is stamped into a fresh
// policy, and the blocks of existing files are reserved (files of older
// versions were sparse). (The daemon links <run_dir>/node into the directory
// first: a node file created here is the directory's own, for tools and
// tests.) Existing files are validated, never rewritten. A policy without a
// valid node file is refused (kCorrupt): which copy of the policy is in force
// cannot be told, and a tenant must then be denied, never let through. On
// failure *out is untouched, and a one-line reason naming the file is written
// to err.
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

// ---- The committed GPU table: every read of policy goes through here ----
//
// A tenant's GPU table in force is the copy of its policy stamped with the
// generation its node file has committed (ledger_layout.h). Readers in the
// hot path use committed_gpus() + still_committed() around the fields they
// need (one acquire load before, one relaxed load after); every other reader
// takes a whole consistent snapshot with read_gpu_table().

struct CommittedGpus {
  const GpuPolicy* gpus;  // kMaxGpus entries: the copy of `generation`, if stamped so
  uint64_t generation;
  const std::atomic<uint64_t>* stamp;
};

inline CommittedGpus committed_gpus(const TenantLedger& ledger) {
  const uint64_t generation = ledger.node->committed.load(std::memory_order_acquire);
  const PolicyCopy& copy = ledger.policy->copies[generation & 1];
  return {copy.gpus, generation, &copy.stamp};
}

// After reading fields of `table.gpus` with acquire loads: true if they all
// came from the copy of table.generation, whole. False if that copy is
// stamped with another generation (it grants nothing) or was rewritten while
// it was read (the reader fell a commit behind the daemon): read again from
// committed_gpus(). Why acquire loads (free on x86): the daemon marks a copy
// before it stores into it with release stores, so a reader whose acquire
// load saw one of those stores sees the mark here; and no load can move
// after this one (a seqlock without fences, which ThreadSanitizer follows).
inline bool still_committed(const CommittedGpus& table) {
  return table.stamp->load(std::memory_order_relaxed) == table.generation;
}

// How often a reader retries a copy the daemon rewrote under it. Once it has
// re-read the committed generation, that copy cannot be rewritten before the
// next commit: one retry is enough unless reloads follow each other within
// a single read.
inline constexpr int kPolicyReadAttempts = 4;

// Calls read(entry) (acquire loads of the fields it needs) on entry `gpu` of
// the committed table until one call's loads all came from one copy whole.
// False when none did (no copy of the committed generation): then what read
// saw must be dropped and the entry taken as not granted.
template <typename Read>
bool read_committed_entry(const TenantLedger& ledger, uint32_t gpu, Read&& read) {
  for (int attempt = 0; attempt < kPolicyReadAttempts; ++attempt) {
    const CommittedGpus table = committed_gpus(ledger);
    read(table.gpus[gpu]);
    if (still_committed(table)) return true;
  }
  return false;
}

// One GPU entry as read, whole, from one copy: plain values.
struct GpuEntry {
  uint32_t state = kGpuUnused;  // GpuGrantState
  uint32_t flags = 0;           // GpuPolicyFlags
  uint8_t uuid[16] = {};
  uint64_t memory_quota = 0;
  uint64_t context_memory = 0;
  uint32_t share_ppm = 0;
  uint32_t limit_ppm = 0;
  uint32_t unavailable = kGpuAvailable;  // GpuUnavailableReason
  uint32_t unavailable_detail = 0;

  bool operator==(const GpuEntry&) const = default;
};

struct GpuTable {
  uint64_t generation = 0;  // the committed generation it was read at
  bool stamped = false;     // false: the policy has no copy of that generation, so nothing is granted
  GpuEntry gpus[kMaxGpus];
};

// The committed table, whole (a seqlock read, retried a few times if the
// daemon rewrites the copy meanwhile). Returns out->stamped; when false,
// every entry is kGpuUnused: nothing is granted, never a mix of copies.
bool read_gpu_table(const TenantLedger& ledger, GpuTable* out);
// One entry of it (kGpuUnused when nothing is granted), read whole.
GpuEntry read_gpu_entry(const TenantLedger& ledger, uint32_t gpu);

// Index of the granted-or-revoked entry for this UUID in the committed
// table (in `table`), or -1.
int find_gpu(const TenantLedger& ledger, const uint8_t uuid[16]);
int find_gpu(const GpuTable& table, const uint8_t uuid[16]);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (hex digits of either case), as
// nvidia-smi and NVML write GPU UUIDs, to the 16 bytes policies are keyed by.
// False for anything else ("MIG-..." included), leaving `out` undefined.
bool parse_gpu_uuid_text(std::string_view text, uint8_t out[16]);

// ---- Policy writes (daemon only) ----
//
// A change of policy, across every tenant of the node:
//   next = next_generation(committed, ledgers);
//   for every tenant: gpus = begin_policy_copy(ledger, next); edit gpus;
//                     end_policy_copy(ledger, next);
//   commit_generation(node, next);        <- the commit point, one store
//   for every tenant: retire_policy_copy(ledger, committed);
// Until the commit, readers see generation `committed` on every tenant; after
// it, `next` on every tenant. A tenant whose copy was not written for `next`
// grants nothing after the commit, so every open ledger must be written.

// The generation a change is written for: of the other parity than
// `committed` (so its copy is never the one in force), and above every stamp
// in `ledger`'s policy, so a tenant's most recent copy always has its
// highest stamp, even after the node file was recreated. Start from
// committed + 1 and pass every ledger.
uint64_t next_generation(uint64_t candidate, const TenantLedger& ledger);

// Marks copy next & 1 (never the one in force) as being rewritten, fills it
// with the tenant's latest table (bindings, limits, unavailable marks) and
// returns its entries for editing.
GpuPolicy* begin_policy_copy(TenantLedger& ledger, uint64_t next);
// Stamps that copy with `next` (release): complete, ready to be committed.
void end_policy_copy(TenantLedger& ledger, uint64_t next);
// The commit point: every tenant's policy is read at `next` from this store on.
void commit_generation(NodeSegment& node, uint64_t next);
// After the commit: the copy of `previous` (the generation in force before
// it) is stamped kStampRetired, so that nothing can read it as complete any
// more. A reader still in it finds the stamp changed and reads `next`.
void retire_policy_copy(TenantLedger& ledger, uint64_t previous);

// Writes every field of an entry of a copy being written (release stores, the
// state last).
void store_gpu_entry(GpuPolicy& entry, const GpuEntry& value);

// The entry for this UUID in a table being written, appending one if
// needed (bound, not granted yet: kGpuRevoked). -1 if full.
int bind_gpu(GpuPolicy* table, const uint8_t uuid[16]);

// Daemon: the table a change must start from. The committed one when
// readable; otherwise (a new tenant, or the node file was recreated) the
// complete copy with the highest stamp, whose bindings live charges may still
// be indexed by. Never fails: a fresh policy is all unused.
void latest_gpu_table(const TenantLedger& ledger, GpuTable* out);

// Daemon: maps <dir>/node read-write, creating it (generation 0) if missing,
// and checks its header. Caller unmaps with close_node().
LedgerError open_node(const char* dir, NodeSegment** out, int* fd_out, char* err, size_t err_len);
void close_node(NodeSegment* node, int fd);

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
// The entry's state and quota are read from the committed table
// (committed_gpus), so a reload in progress is never half-seen.
bool try_charge(const TenantLedger& ledger, uint32_t gpu, uint32_t slot, uint64_t bytes);

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
// The same for any process this one can see (the daemon's audits): false if
// it is gone or unreadable.
bool read_process_identity(int32_t pid, ProcessIdentity* out);

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
// the caller's own, so the caller must not probe its own slot). Never by two
// threads of one process at once: the locks are the process's, so both
// would get a dead slot's, and the later could clear it after another
// process had claimed it.
ReclaimResult reclaim_dead_slots(TenantLedger& ledger, int own_slot);

// The PID (in the caller's PID namespace) of the process holding the slot's
// record lock: 0 if nobody holds it, -1 if the holder lives in a PID
// namespace the caller cannot see (the kernel reports its PID as 0). A
// process cannot see its own locks this way.
int32_t slot_owner_pid(const TenantLedger& ledger, uint32_t slot);

// The owners record_host_pids has checked: each slot's host PID (0: none)
// and the start time the slot said when it was checked.
struct HostPidMemo {
  uint64_t start_time[kMaxSlots] = {};
  int32_t host_pid[kMaxSlots] = {};
  // Each slot's lock holder as last looked at: its PID and start time (0:
  // none), the descriptor its slot named, and whether that descriptor held
  // the lock. Looked at again once any of the three changes.
  int32_t lock_pid[kMaxSlots] = {};
  uint64_t lock_start_time[kMaxSlots] = {};
  int32_t lock_fd[kMaxSlots] = {};
  bool lock_held[kMaxSlots] = {};
};

// Daemon: writes each live slot's host_pid (its owner's PID in the caller's
// namespace, checked against the slot's start time) and zeroes the others'.
// Two F_GETLK per slot lock held (plus one), one /proc read per lock
// holder and one per live slot (with `memo`: only where the lock holder or
// the slot's start time is not one an earlier call with it found to be the
// owner), and one read of /proc/<pid>/fdinfo/<lock_fd> per lock holder
// (with `memo`: only where the holder, its start time or the slot's lock_fd
// changed since).
// The slot's copy is for the tenant's own NVML view; a tenant can overwrite
// it, so anything that acts on other parties (the audits) uses `verified`
// instead: if given (kMaxSlots entries), the PID of each slot's record-lock
// holder, 0 where none, found by the locks alone (every slot, whatever its
// state, start time or the high-water mark say: a process holding a lock on
// the tenant's usage file is the tenant's), and only where the process with
// that PID holds a write lock on the file through the descriptor the slot
// names (the lock's PID is its taker's, and outlives it where another
// process shares its descriptors).
void record_host_pids(TenantLedger& ledger, int32_t* verified = nullptr, HostPidMemo* memo = nullptr);

}  // namespace fracgpu::ledger

#include "ledger.h"

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

namespace fracgpu::ledger {
namespace {

LedgerError errno_to_error(int e) {
  switch (e) {
    case ENOENT:
    case ENOTDIR:
      return LedgerError::kMissing;
    case EACCES:
    case EPERM:
    case EROFS:
      return LedgerError::kPermission;
    default:
      return LedgerError::kIo;
  }
}

LedgerError file_error(const shm::Opened& o) {
  switch (o.status) {
    case shm::FileStatus::kOk: return LedgerError::kOk;
    case shm::FileStatus::kMissing: return LedgerError::kMissing;
    case shm::FileStatus::kWrongSize: return LedgerError::kWrongSize;
    case shm::FileStatus::kWrongType:
    case shm::FileStatus::kWrongOwner:
    case shm::FileStatus::kOpenToOthers: return LedgerError::kRefused;
    case shm::FileStatus::kExists: return LedgerError::kIo;
    case shm::FileStatus::kSystem: return errno_to_error(o.sys_errno);
  }
  return LedgerError::kIo;
}

uid_t resolve_owner(int dirfd, uid_t owner) {
  if (owner != kDirOwner) return owner;
  struct stat st {};
  // A directory we cannot stat has no owner to match: nothing will.
  return fstat(dirfd, &st) == 0 ? st.st_uid : static_cast<uid_t>(-3);
}

// Splits "a/b/c" into the directory "a/b" (opened, links followed: the
// caller named it) and the name "c". Returns the directory's descriptor or
// -1 with the error set.
int open_parent(const char* path, char* dir, size_t dir_len, const char** name, LedgerError* error, char* err,
                size_t err_len) {
  const char* slash = strrchr(path, '/');
  if (slash == nullptr) {
    snprintf(dir, dir_len, ".");
    *name = path;
  } else {
    snprintf(dir, dir_len, "%.*s", static_cast<int>(slash == path ? 1 : slash - path), path);
    *name = slash + 1;
  }
  const shm::Opened d = shm::open_dir_path(dir, shm::kAnyOwner, false, err, err_len);
  if (!d.ok()) *error = file_error(d);
  return d.fd;
}

bool is_all_zero(const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i)
    if (b[i] != 0) return false;
  return true;
}

// Stamps a fresh policy or usage segment: its header and the tenant name.
struct LedgerStamp {
  uint64_t magic;
  size_t bytes;
  const char* tenant_name;
};

void stamp_ledger_segment(void* map, const void* arg) {
  const auto* stamp = static_cast<const LedgerStamp*>(arg);
  auto* header = static_cast<SegmentHeader*>(map);
  header->magic = stamp->magic;
  header->layout_version = kLayoutVersion;
  header->header_bytes = sizeof(SegmentHeader);
  header->segment_bytes = stamp->bytes;
  if (stamp->magic == kPolicyMagic && stamp->tenant_name != nullptr) {
    auto* policy = static_cast<PolicySegment*>(map);
    snprintf(policy->tenant, sizeof policy->tenant, "%s", stamp->tenant_name);
  }
}

struct Mapping {
  void* addr = nullptr;
  int fd = -1;
};

// pread of exactly `bytes` at `offset`; a file cut short meanwhile is kWrongSize.
LedgerError read_exactly(int fd, void* out, size_t bytes, off_t offset, const char* dir, const char* file, char* err,
                         size_t err_len) {
  const ssize_t n = pread(fd, out, bytes, offset);
  if (n == static_cast<ssize_t>(bytes)) return LedgerError::kOk;
  if (n < 0) {
    set_error(err, err_len, "%s/%s: cannot read: %s", dir, file, strerror(errno));
    return errno_to_error(errno);
  }
  set_error(err, err_len, "%s/%s: shrank while being opened", dir, file);
  return LedgerError::kWrongSize;
}

LedgerError map_segment(int dirfd, const char* dir, const char* file, bool writable, bool create, uint64_t magic,
                        size_t bytes, mode_t mode, uid_t owner, const char* tenant_name, Mapping* out, char* err,
                        size_t err_len) {
  const LedgerStamp stamp{magic, bytes, tenant_name};
  void* map = nullptr;
  int fd = -1;
  LedgerError e = map_shared_file_at(dirfd, file, dir, writable, create ? mode : 0, bytes,
                                     create ? stamp_ledger_segment : nullptr, &stamp, owner, &map, &fd, err, err_len);
  if (e != LedgerError::kOk) return e;
  // Read through the descriptor, not the mapping: the file may shrink
  // between the size check and here, and a read past its end through the
  // mapping would kill the caller (the daemon, the CLI: sigbus_guard.h).
  SegmentHeader h{};
  LedgerError check = read_exactly(fd, &h, sizeof h, 0, dir, file, err, err_len);
  if (check == LedgerError::kOk) check = check_header(h, magic, bytes);
  if (check != LedgerError::kOk) {
    if (check == LedgerError::kWrongSize) {
      // read_exactly said why.
    } else if (check == LedgerError::kWrongVersion)
      set_error(err, err_len, "%s/%s: ledger layout version %u, this fracgpu speaks version %u", dir, file,
                h.layout_version, kLayoutVersion);
    else if (check == LedgerError::kForeign)
      set_error(err, err_len, "%s/%s: not a fracgpu %s segment (bad magic)", dir, file, file);
    else
      set_error(err, err_len, "%s/%s: corrupt header", dir, file);
    munmap(map, bytes);
    ::close(fd);
    return check;
  }
  out->addr = map;
  out->fd = fd;
  return LedgerError::kOk;
}

void unmap(Mapping& m, size_t bytes) {
  if (m.addr != nullptr) munmap(m.addr, bytes);
  if (m.fd >= 0) ::close(m.fd);
}

int set_record_lock(int fd, uint32_t slot, short type) { return set_byte_lock(fd, slot_lock_offset(slot), type); }

void clear_slot_charges(UsageSegment& usage, uint32_t slot) {
  for (uint32_t g = 0; g < kMaxGpus; ++g) usage.charges[g][slot].store(0, std::memory_order_seq_cst);
}

// A new owner must not inherit a dead one's GPU-time requests: the daemon
// would take its `entered_grant` for a process that has yet to drain.
void clear_slot_requests(UsageSegment& usage, uint32_t slot) {
  for (uint32_t g = 0; g < kMaxGpus; ++g) {
    GpuTimeRequest& r = usage.gputime[g][slot];
    r.want_since_ns.store(0, std::memory_order_relaxed);
    r.last_active_ns.store(0, std::memory_order_relaxed);
    r.entered_grant.store(0, std::memory_order_relaxed);
    r.drained_grant.store(0, std::memory_order_relaxed);
    r.used_ns.store(0, std::memory_order_relaxed);
    r.waited_ns.store(0, std::memory_order_relaxed);
    r.poll_ns.store(0, std::memory_order_relaxed);
  }
}

uint64_t slot_total(const UsageSegment& usage, uint32_t slot) {
  uint64_t sum = 0;
  for (uint32_t g = 0; g < kMaxGpus; ++g) sum += usage.charges[g][slot].load(std::memory_order_relaxed);
  return sum;
}

// With the slot's record lock held (so its owner is gone): true once the
// grace period since the owner was first seen gone has passed. A slot left
// clean (free, nothing charged) needs no grace.
bool orphan_grace_over(ProcessSlot& slot) {
  const uint64_t now = monotonic_ns();
  uint64_t seen = slot.orphaned_ns.load(std::memory_order_relaxed);
  if (seen == 0) {
    slot.orphaned_ns.store(now, std::memory_order_relaxed);
    return false;
  }
  return now - seen >= kReclaimGraceNs;
}

}  // namespace

bool parse_gpu_uuid_text(std::string_view text, uint8_t out[16]) {
  constexpr std::string_view kPrefix = "GPU-";
  if (text.size() != kPrefix.size() + 36 || text.substr(0, kPrefix.size()) != kPrefix) return false;
  const auto hex_value = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  size_t pos = kPrefix.size();
  for (size_t i = 0; i < 16; ++i) {
    const int hi = hex_value(text[pos]);
    const int lo = hex_value(text[pos + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
    pos += 2;
    if (i == 3 || i == 5 || i == 7 || i == 9) {  // 8-4-4-4-12
      if (text[pos] != '-') return false;
      ++pos;
    }
  }
  return true;
}

uint64_t monotonic_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

int set_byte_lock(int fd, off_t offset, short type) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = 1;
  return fcntl(fd, F_SETLK, &fl);
}

LedgerError create_segment_file(const char* path, mode_t mode, size_t bytes, StampFn stamp, const void* stamp_arg,
                                char* err, size_t err_len) {
  char dir[4096];
  const char* name = nullptr;
  LedgerError e = LedgerError::kOk;
  const int dirfd = open_parent(path, dir, sizeof dir, &name, &e, err, err_len);
  if (dirfd < 0) return e;
  int sys_errno = 0;
  const shm::FileStatus created =
      shm::create_file_at(dirfd, name, mode, bytes, stamp, stamp_arg, dir, &sys_errno, err, err_len);
  ::close(dirfd);
  // Another creator won the race: theirs is kept.
  if (created == shm::FileStatus::kOk || created == shm::FileStatus::kExists) return LedgerError::kOk;
  return errno_to_error(sys_errno);
}

LedgerError map_shared_file(const char* path, bool writable, mode_t create_mode, size_t bytes, StampFn stamp,
                            const void* stamp_arg, void** map_out, int* fd_out, char* err, size_t err_len,
                            uid_t owner) {
  char dir[4096];
  const char* name = nullptr;
  LedgerError e = LedgerError::kOk;
  const int dirfd = open_parent(path, dir, sizeof dir, &name, &e, err, err_len);
  if (dirfd < 0) return e;
  e = map_shared_file_at(dirfd, name, dir, writable, create_mode, bytes, stamp, stamp_arg, owner, map_out, fd_out,
                         err, err_len);
  ::close(dirfd);
  return e;
}

LedgerError map_shared_file_at(int dirfd, const char* name, const char* shown_dir, bool writable, mode_t create_mode,
                               size_t bytes, StampFn stamp, const void* stamp_arg, uid_t owner, void** map_out,
                               int* fd_out, char* err, size_t err_len) {
  owner = resolve_owner(dirfd, owner);
  const int access = writable ? O_RDWR : O_RDONLY;
  const auto size = static_cast<int64_t>(bytes);
  shm::Opened file = shm::open_file_at(dirfd, name, access, owner, size, shown_dir, err, err_len);
  if (file.status == shm::FileStatus::kMissing && create_mode != 0) {
    int sys_errno = 0;
    const shm::FileStatus created =
        shm::create_file_at(dirfd, name, create_mode, bytes, stamp, stamp_arg, shown_dir, &sys_errno, err, err_len);
    if (created != shm::FileStatus::kOk && created != shm::FileStatus::kExists) return errno_to_error(sys_errno);
    // Ours, or the winner's of a race (checked like any other).
    file = shm::open_file_at(dirfd, name, access, owner, size, shown_dir, err, err_len);
  }
  if (!file.ok()) return file_error(file);
  // Only now, with the size checked: a mapping past the end would fault.
  void* map = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, file.fd, 0);
  if (map == MAP_FAILED) {
    int e = errno;
    ::close(file.fd);
    set_error(err, err_len, "%s/%s: cannot map: %s", shown_dir, name, strerror(e));
    return errno_to_error(e);
  }
  *map_out = map;
  *fd_out = file.fd;
  return LedgerError::kOk;
}

const char* ledger_error_name(LedgerError e) {
  switch (e) {
    case LedgerError::kOk: return "ok";
    case LedgerError::kMissing: return "missing";
    case LedgerError::kPermission: return "permission denied";
    case LedgerError::kWrongSize: return "wrong size";
    case LedgerError::kForeign: return "foreign segment";
    case LedgerError::kWrongVersion: return "wrong layout version";
    case LedgerError::kCorrupt: return "corrupt";
    case LedgerError::kIo: return "i/o error";
    case LedgerError::kFull: return "full";
    case LedgerError::kRefused: return "refused";
  }
  return "unknown";
}

LedgerError check_header(const SegmentHeader& h, uint64_t expected_magic, uint64_t expected_bytes) {
  if (is_all_zero(&h, sizeof h)) return LedgerError::kOk;  // fresh
  if (h.magic != expected_magic) return LedgerError::kForeign;
  if (h.layout_version != kLayoutVersion) return LedgerError::kWrongVersion;
  if (h.header_bytes != sizeof(SegmentHeader) || h.segment_bytes != expected_bytes) return LedgerError::kCorrupt;
  return LedgerError::kOk;
}

LedgerError open_ledger(const char* dir, AccessMode mode, const char* tenant_name, TenantLedger* out, char* err,
                        size_t err_len) {
  const bool daemon = mode == AccessMode::kDaemon;
  if (daemon && mkdir(dir, 0755) != 0 && errno != EEXIST) {
    set_error(err, err_len, "%s: cannot create directory: %s", dir, strerror(errno));
    return errno_to_error(errno);
  }
  const shm::Opened d = shm::open_dir_path(dir, shm::kAnyOwner, false, err, err_len);
  if (!d.ok()) return file_error(d);
  const uid_t owner = daemon ? geteuid() : mode == AccessMode::kTenant ? shm::kAnyOwner : kDirOwner;
  const LedgerError e = open_ledger_at(d.fd, dir, mode, owner, tenant_name, out, err, err_len);
  ::close(d.fd);
  return e;
}

LedgerError open_ledger_at(int dirfd, const char* dir, AccessMode mode, uid_t owner, const char* tenant_name,
                           TenantLedger* out, char* err, size_t err_len) {
  const bool daemon = mode == AccessMode::kDaemon;
  Mapping policy, usage;
  LedgerError e = map_segment(dirfd, dir, kPolicyFileName, daemon, daemon, kPolicyMagic, sizeof(PolicySegment), 0644,
                              owner, tenant_name, &policy, err, err_len);
  if (e != LedgerError::kOk) return e;
  e = map_segment(dirfd, dir, kUsageFileName, mode != AccessMode::kReadOnly, daemon, kUsageMagic, sizeof(UsageSegment),
                  0666, owner, nullptr, &usage, err, err_len);
  if (e != LedgerError::kOk) {
    unmap(policy, sizeof(PolicySegment));
    return e;
  }
  if (daemon) {
    // Files of older versions were created sparse: a tenant's store into a
    // hole could then fault on a full file system. Best effort (a file
    // system without fallocate keeps them as they are).
    shm::reserve_blocks(policy.fd, sizeof(PolicySegment));
    shm::reserve_blocks(usage.fd, sizeof(UsageSegment));
  }
  // Entries and the high-water mark index fixed-size arrays: refuse values
  // that would send a reader out of bounds. (Read through the descriptors,
  // as the headers are.)
  const auto refuse = [&](LedgerError why) {
    unmap(policy, sizeof(PolicySegment));
    unmap(usage, sizeof(UsageSegment));
    return why;
  };
  uint32_t high = 0;
  e = read_exactly(usage.fd, &high, sizeof high, offsetof(UsageSegment, slot_high_water), dir, kUsageFileName, err,
                   err_len);
  if (e != LedgerError::kOk) return refuse(e);
  if (high > kMaxSlots) {
    set_error(err, err_len, "%s/%s: corrupt: slot high-water mark out of range", dir, kUsageFileName);
    return refuse(LedgerError::kCorrupt);
  }
  unsigned char copies[sizeof(PolicySegment::copies)];
  e = read_exactly(policy.fd, copies, sizeof copies, offsetof(PolicySegment, copies), dir, kPolicyFileName, err,
                   err_len);
  if (e != LedgerError::kOk) return refuse(e);
  for (uint32_t c = 0; c < 2; ++c) {
    for (uint32_t g = 0; g < kMaxGpus; ++g) {
      uint32_t state = 0;
      memcpy(&state, copies + c * sizeof(PolicyCopy) + offsetof(PolicyCopy, gpus) + g * sizeof(GpuPolicy) +
                         offsetof(GpuPolicy, state),
             sizeof state);
      if (state > kGpuRevoked) {
        set_error(err, err_len, "%s/%s: corrupt: GPU entry in unknown state", dir, kPolicyFileName);
        return refuse(LedgerError::kCorrupt);
      }
    }
  }
  auto* p = static_cast<PolicySegment*>(policy.addr);
  auto* u = static_cast<UsageSegment*>(usage.addr);
  // Which copy of the policy is in force is the node's to say: without its
  // node file a tenant's policy cannot be read (kCorrupt, not kMissing, so
  // the interposer denies rather than letting the process through unlimited).
  Mapping node;
  e = map_segment(dirfd, dir, kNodeFileName, daemon, daemon, kNodeMagic, sizeof(NodeSegment), 0644, owner, nullptr,
                  &node, err, err_len);
  if (e != LedgerError::kOk) {
    if (e == LedgerError::kMissing)
      set_error(err, err_len, "%s/%s: missing: the generation of policy in force cannot be told", dir, kNodeFileName);
    return refuse(e == LedgerError::kMissing ? LedgerError::kCorrupt : e);
  }
  out->policy = p;
  out->usage = u;
  out->node = static_cast<NodeSegment*>(node.addr);
  out->policy_fd = policy.fd;
  out->usage_fd = usage.fd;
  out->node_fd = node.fd;
  out->mode = mode;
  return LedgerError::kOk;
}

void close_ledger(TenantLedger* ledger) {
  if (ledger->policy != nullptr) munmap(ledger->policy, sizeof(PolicySegment));
  if (ledger->usage != nullptr) munmap(ledger->usage, sizeof(UsageSegment));
  if (ledger->node != nullptr) munmap(ledger->node, sizeof(NodeSegment));
  if (ledger->policy_fd >= 0) ::close(ledger->policy_fd);
  if (ledger->usage_fd >= 0) ::close(ledger->usage_fd);
  if (ledger->node_fd >= 0) ::close(ledger->node_fd);
  *ledger = TenantLedger{};
}

void close_usage(TenantLedger* ledger) {
  if (ledger->usage != nullptr) munmap(ledger->usage, sizeof(UsageSegment));
  if (ledger->usage_fd >= 0) ::close(ledger->usage_fd);
  ledger->usage = nullptr;
  ledger->usage_fd = -1;
}

bool has_tenant_state(const char* dir) {
  struct stat st {};
  for (const char* name : {kPolicyFileName, kUsageFileName}) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    // Anything by the name counts, a link or FIFO too: never looked through.
    if (fstatat(AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) == 0 || errno != ENOENT) return true;
  }
  return false;
}

UsageSize enforce_usage_size(const TenantLedger& ledger, uint64_t* bytes) {
  struct stat st {};
  if (ledger.usage_fd < 0 || fstat(ledger.usage_fd, &st) != 0) return UsageSize::kError;
  if (bytes != nullptr) *bytes = static_cast<uint64_t>(st.st_size);
  if (static_cast<uint64_t>(st.st_size) == sizeof(UsageSegment)) return UsageSize::kOk;
  if (static_cast<uint64_t>(st.st_size) < sizeof(UsageSegment)) return UsageSize::kShrunk;
  // Cutting what lies past the layout touches no mapped byte.
  return ftruncate(ledger.usage_fd, static_cast<off_t>(sizeof(UsageSegment))) == 0 ? UsageSize::kTruncated
                                                                                    : UsageSize::kError;
}

// ---- The committed GPU table ----

namespace {

// The UUID's bytes are plain data in a copy the daemon may be rewriting: each
// byte is read and written with an atomic access (acquire and release, as
// every field: see still_committed), and the stamp check decides whether
// what was read counts.
void load_uuid(const GpuPolicy& entry, uint8_t out[16]) {
  for (int i = 0; i < 16; ++i) out[i] = __atomic_load_n(&entry.uuid[i], __ATOMIC_RELAXED);
}

void store_uuid(GpuPolicy& entry, const uint8_t uuid[16]) {
  for (int i = 0; i < 16; ++i) __atomic_store_n(&entry.uuid[i], uuid[i], __ATOMIC_RELEASE);
}

GpuEntry load_entry(const GpuPolicy& e) {
  GpuEntry v;
  v.state = e.state.load(std::memory_order_acquire);
  v.flags = e.flags.load(std::memory_order_acquire);
  load_uuid(e, v.uuid);
  v.memory_quota = e.memory_quota.load(std::memory_order_acquire);
  v.context_memory = e.context_memory.load(std::memory_order_acquire);
  v.share_ppm = e.share_ppm.load(std::memory_order_acquire);
  v.limit_ppm = e.limit_ppm.load(std::memory_order_acquire);
  v.unavailable = e.unavailable.load(std::memory_order_acquire);
  v.unavailable_detail = e.unavailable_detail.load(std::memory_order_acquire);
  return v;
}

void load_copy(const GpuPolicy* gpus, GpuTable* out) {
  for (uint32_t g = 0; g < kMaxGpus; ++g) out->gpus[g] = load_entry(gpus[g]);
}

}  // namespace

bool read_gpu_table(const TenantLedger& ledger, GpuTable* out) {
  CommittedGpus table{};
  for (int attempt = 0; attempt < kPolicyReadAttempts; ++attempt) {
    table = committed_gpus(ledger);
    load_copy(table.gpus, out);
    if (still_committed(table)) {
      out->generation = table.generation;
      out->stamped = true;
      return true;
    }
  }
  *out = GpuTable{};
  out->generation = table.generation;
  return false;
}

GpuEntry read_gpu_entry(const TenantLedger& ledger, uint32_t gpu) {
  GpuEntry entry;
  if (gpu >= kMaxGpus || !read_committed_entry(ledger, gpu, [&](const GpuPolicy& e) { entry = load_entry(e); }))
    return {};
  return entry;
}

int find_gpu(const GpuTable& table, const uint8_t uuid[16]) {
  for (uint32_t g = 0; g < kMaxGpus; ++g)
    if (table.gpus[g].state != kGpuUnused && memcmp(table.gpus[g].uuid, uuid, 16) == 0) return static_cast<int>(g);
  return -1;
}

int find_gpu(const TenantLedger& ledger, const uint8_t uuid[16]) {
  GpuTable table;
  read_gpu_table(ledger, &table);
  return find_gpu(table, uuid);
}

// ---- Policy writes (daemon only) ----

void latest_gpu_table(const TenantLedger& ledger, GpuTable* out) {
  if (read_gpu_table(ledger, out)) return;
  // No copy of the committed generation: take the most recent complete one.
  // The daemon is the only writer, so nothing moves under this read.
  const PolicyCopy* best = nullptr;
  for (const PolicyCopy& copy : ledger.policy->copies) {
    const uint64_t stamp = copy.stamp.load(std::memory_order_acquire);
    if (stamp < kStampRetired && (best == nullptr || stamp > best->stamp.load(std::memory_order_relaxed))) best = &copy;
  }
  *out = GpuTable{};
  if (best != nullptr) load_copy(best->gpus, out);
  out->generation = ledger.node->committed.load(std::memory_order_acquire);
}

uint64_t next_generation(uint64_t candidate, const TenantLedger& ledger) {
  for (const PolicyCopy& copy : ledger.policy->copies) {
    const uint64_t stamp = copy.stamp.load(std::memory_order_acquire);
    if (stamp >= kStampRetired) continue;
    while (candidate <= stamp) candidate += 2;  // keeps the parity
  }
  return candidate;
}

GpuPolicy* begin_policy_copy(TenantLedger& ledger, uint64_t next) {
  GpuTable from;
  latest_gpu_table(ledger, &from);
  PolicyCopy& copy = ledger.policy->copies[next & 1];
  // The mark first, then the entries with release stores (seqlock): a reader
  // whose acquire load sees any of them also sees the mark when it checks.
  copy.stamp.store(kStampWriting, std::memory_order_relaxed);
  for (uint32_t g = 0; g < kMaxGpus; ++g) store_gpu_entry(copy.gpus[g], from.gpus[g]);
  return copy.gpus;
}

void end_policy_copy(TenantLedger& ledger, uint64_t next) {
  ledger.policy->copies[next & 1].stamp.store(next, std::memory_order_release);
}

void commit_generation(NodeSegment& node, uint64_t next) { node.committed.store(next, std::memory_order_release); }

void retire_policy_copy(TenantLedger& ledger, uint64_t previous) {
  std::atomic<uint64_t>& stamp = ledger.policy->copies[previous & 1].stamp;
  if (stamp.load(std::memory_order_relaxed) == previous) stamp.store(kStampRetired, std::memory_order_release);
}

void store_gpu_entry(GpuPolicy& entry, const GpuEntry& value) {
  uint8_t bound[16];
  load_uuid(entry, bound);
  if (memcmp(bound, value.uuid, 16) != 0) store_uuid(entry, value.uuid);
  entry.flags.store(value.flags, std::memory_order_release);
  entry.memory_quota.store(value.memory_quota, std::memory_order_release);
  entry.context_memory.store(value.context_memory, std::memory_order_release);
  entry.share_ppm.store(value.share_ppm, std::memory_order_release);
  entry.limit_ppm.store(value.limit_ppm, std::memory_order_release);
  entry.unavailable_detail.store(value.unavailable_detail, std::memory_order_release);
  entry.unavailable.store(value.unavailable, std::memory_order_release);
  entry.state.store(value.state, std::memory_order_release);
}

int bind_gpu(GpuPolicy* table, const uint8_t uuid[16]) {
  int free_entry = -1;
  for (uint32_t g = 0; g < kMaxGpus; ++g) {
    const uint32_t state = table[g].state.load(std::memory_order_relaxed);
    if (state == kGpuUnused) {
      if (free_entry < 0) free_entry = static_cast<int>(g);
      continue;
    }
    uint8_t bound[16];
    load_uuid(table[g], bound);
    if (memcmp(bound, uuid, 16) == 0) return static_cast<int>(g);
  }
  if (free_entry < 0) return -1;
  GpuEntry entry;
  memcpy(entry.uuid, uuid, 16);
  // Bound but not granted yet: like a revoked grant until the caller fills
  // the limits and grants it.
  entry.state = kGpuRevoked;
  store_gpu_entry(table[free_entry], entry);
  return free_entry;
}

LedgerError open_node(const char* dir, NodeSegment** out, int* fd_out, char* err, size_t err_len) {
  const shm::Opened d = shm::open_dir_path(dir, geteuid(), false, err, err_len);
  if (!d.ok()) return file_error(d);
  Mapping node;
  const LedgerError e = map_segment(d.fd, dir, kNodeFileName, true, true, kNodeMagic, sizeof(NodeSegment), 0644,
                                    geteuid(), nullptr, &node, err, err_len);
  ::close(d.fd);
  if (e != LedgerError::kOk) return e;
  *out = static_cast<NodeSegment*>(node.addr);
  *fd_out = node.fd;
  return LedgerError::kOk;
}

void close_node(NodeSegment* node, int fd) {
  if (node != nullptr) munmap(node, sizeof(NodeSegment));
  if (fd >= 0) ::close(fd);
}

uint64_t tenant_used(const UsageSegment& usage, uint32_t gpu) {
  const uint32_t high = std::min(usage.slot_high_water.load(std::memory_order_seq_cst), kMaxSlots);
  uint64_t sum = 0;
  for (uint32_t s = 0; s < high; ++s) sum += usage.charges[gpu][s].load(std::memory_order_seq_cst);
  return sum;
}

bool try_charge(const TenantLedger& ledger, uint32_t gpu, uint32_t slot, uint64_t bytes) {
  if (bytes == 0) return true;
  UsageSegment& usage = *ledger.usage;
  std::atomic<uint64_t>& mine = usage.charges[gpu][slot];
  // Retry only while the quota looks like it has room without us: a refusal
  // then was a collision with a racing caller that has since undone its own;
  // or when the copy of the policy read was being rewritten (see below).
  constexpr int kAttempts = 8;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    // State and quota from one copy, the one in force: a reload in progress
    // is never half-seen. (A copy stamped otherwise than the committed
    // generation grants nothing: after the retries, refused.)
    const CommittedGpus table = committed_gpus(ledger);
    const uint32_t state = table.gpus[gpu].state.load(std::memory_order_acquire);
    const uint64_t quota = table.gpus[gpu].memory_quota.load(std::memory_order_acquire);
    if (!still_committed(table)) continue;
    if (state != kGpuGranted) return false;
    if (quota == kUnlimited) {
      mine.fetch_add(bytes, std::memory_order_seq_cst);
      return true;
    }
    if (bytes > quota) return false;
    mine.fetch_add(bytes, std::memory_order_seq_cst);
    const uint64_t used = tenant_used(usage, gpu);  // includes our own charge
    if (used <= quota) return true;
    mine.fetch_sub(bytes, std::memory_order_seq_cst);
    // Refused. If the others alone leave no room, that is the answer; if they
    // do, we collided with a racing caller that has since backed off: retry.
    if (tenant_used(usage, gpu) > quota - bytes) return false;
  }
  return false;
}

void force_charge(UsageSegment& usage, uint32_t gpu, uint32_t slot, uint64_t bytes) {
  usage.charges[gpu][slot].fetch_add(bytes, std::memory_order_seq_cst);
}

void uncharge(UsageSegment& usage, uint32_t gpu, uint32_t slot, uint64_t bytes) {
  usage.charges[gpu][slot].fetch_sub(bytes, std::memory_order_seq_cst);
}

namespace {

// Command name and start time from a /proc/<pid>/stat file.
bool read_stat_identity(const char* stat_path, ProcessIdentity* out) {
  int fd = ::open(stat_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  // Field 2 is "(comm)" and comm may contain spaces or parentheses: the
  // fields after it start after the last ')'.
  const char* open_paren = strchr(buf, '(');
  const char* close_paren = strrchr(buf, ')');
  if (open_paren == nullptr || close_paren == nullptr || close_paren < open_paren) return false;
  size_t comm_len = std::min<size_t>(static_cast<size_t>(close_paren - open_paren - 1), sizeof out->comm - 1);
  memcpy(out->comm, open_paren + 1, comm_len);
  // After ')' come fields 3.. ; starttime is field 22, i.e. the 20th after ')'.
  const char* p = close_paren + 1;
  for (int field = 3; field < 22 && *p != '\0'; ++field) {
    while (*p == ' ') ++p;
    while (*p != ' ' && *p != '\0') ++p;
  }
  while (*p == ' ') ++p;
  out->start_time = strtoull(p, nullptr, 10);
  return true;
}

}  // namespace

bool read_self_identity(ProcessIdentity* out) {
  *out = ProcessIdentity{};
  out->pid = static_cast<int32_t>(getpid());
  return read_stat_identity("/proc/self/stat", out);
}

bool read_process_identity(int32_t pid, ProcessIdentity* out) {
  *out = ProcessIdentity{};
  out->pid = pid;
  char path[40];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  return pid > 0 && read_stat_identity(path, out);
}

namespace {

// Every slot's record-lock holder, whatever the slot's words and the
// high-water mark say (they are the tenant's to write): its PID as the
// caller's namespace numbers it, -1 if it cannot see it, 0 if nobody holds
// the lock. One F_GETLK over a run of slots finds a lock in it, if any; the
// runs either side of the slots that lock covers are looked at in turn. So
// it costs two calls per lock held plus one, and never more than two per
// slot however the tenant places locks in its own file.
void find_lock_holders(int fd, int32_t* holders) {
  std::fill(holders, holders + kMaxSlots, 0);
  struct Run {
    uint32_t from, to;  // slots [from, to)
  };
  Run runs_left[kMaxSlots + 1];
  size_t pending = 0;
  runs_left[pending++] = {0, kMaxSlots};
  const off_t stride = static_cast<off_t>(sizeof(ProcessSlot));
  // The first slot in [run.from, run.to) whose lock byte is at `at` or after.
  auto first_at = [&](const Run& run, off_t at) {
    const off_t base = slot_lock_offset(run.from);
    if (at <= base) return run.from;
    const off_t after = (at - base + stride - 1) / stride;
    return static_cast<uint32_t>(std::min<off_t>(run.from + after, run.to));
  };
  while (pending > 0) {
    const Run run = runs_left[--pending];
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = slot_lock_offset(run.from);
    fl.l_len = slot_lock_offset(run.to - 1) + 1 - fl.l_start;
    if (fcntl(fd, F_GETLK, &fl) != 0 || fl.l_type == F_UNLCK) continue;
    const uint32_t first = first_at(run, fl.l_start);
    const uint32_t end = fl.l_len == 0 ? run.to : first_at(run, fl.l_start + fl.l_len);
    for (uint32_t s = first; s < end; ++s) holders[s] = fl.l_pid > 0 ? fl.l_pid : -1;
    // Both runs are shorter than this one: the lock lies within it, so it
    // covers a slot's byte, or lies between two (first > run.from).
    // Runs left are disjoint and not empty: never more than the slots.
    for (const Run rest : {Run{run.from, first}, Run{end, run.to}})
      if (rest.from < rest.to && pending < sizeof runs_left / sizeof runs_left[0]) runs_left[pending++] = rest;
  }
}

// Whether `pid`'s own descriptor `fd` holds a POSIX write lock on the file
// `file` (its /proc/<pid>/fdinfo/<fd> lock lines: the kernel lists there
// the locks the process's descriptor table owns on that descriptor's file,
// with the file's device and inode). A lock's PID is its taker's, which the
// lock outlives when another process shares the taker's descriptors (clone
// with CLONE_FILES): taker gone and its PID reused, F_GETLK names whoever
// has that PID now. The descriptor is the one its slot names (lock_fd), not
// found by a search: a process can hold its lock through a descriptor past
// thousands of others, and looking through them all, for each lock it
// holds, once a tick, is the daemon's time spent at the tenant's choosing.
// Only a write lock counts: a read lock needs no write access to the file.
// Reads /proc only (no file system is asked anything, so no tenant's mount
// can stall it) and allocates nothing.
bool holds_lock_on(int32_t pid, int32_t fd, const struct stat& file) {
  if (fd < 0) return false;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fdinfo/%d", pid, fd);
  const int info = open(path, O_RDONLY | O_CLOEXEC);
  if (info < 0) return false;
  char text[4096];
  const ssize_t got = read(info, text, sizeof text - 1);
  close(info);
  if (got <= 0) return false;
  text[got] = '\0';
  // "lock:\t1: POSIX  ADVISORY  WRITE 4242 00:2f:1234 100 100": the device
  // in hex, the inode in decimal.
  for (const char* line = strstr(text, "lock:"); line != nullptr; line = strstr(line + 5, "lock:")) {
    char kind[16] = {}, access[16] = {};
    unsigned dev_major = 0, dev_minor = 0;
    unsigned long long inode = 0;
    if (sscanf(line, "lock: %*d: %15s %*s %15s %*d %x:%x:%llu", kind, access, &dev_major, &dev_minor, &inode) == 5 &&
        strcmp(kind, "POSIX") == 0 && strcmp(access, "WRITE") == 0 && inode == file.st_ino &&
        dev_major == major(file.st_dev) && dev_minor == minor(file.st_dev))
      return true;
  }
  return false;
}

}  // namespace

void record_host_pids(TenantLedger& ledger, int32_t* verified, HostPidMemo* memo) {
  UsageSegment& usage = *ledger.usage;
  int32_t holders[kMaxSlots];
  find_lock_holders(ledger.usage_fd, holders);
  // Whose processes these are: every holder of a slot's write lock has the
  // tenant's usage file open for writing, so it is the tenant's, whatever
  // the slot's state, PID or start time say. But the PID F_GETLK gives is
  // the lock's taker's, which may have died with the lock kept by a process
  // sharing its descriptors, and its PID gone to anybody's process since: a
  // holder counts only once its own descriptor, the one the slot names,
  // shows the lock. A process that names a wrong one is not verified, which
  // makes it no more than a process that never attached: the audits find
  // it by what the kernel ties it to, as they find those.
  struct stat file {};
  const bool file_known = fstat(ledger.usage_fd, &file) == 0;
  for (uint32_t s = 0; s < kMaxSlots; ++s) {
    const int32_t holder = holders[s];
    if (holder <= 0) continue;
    const int32_t fd = usage.slots[s].lock_fd.load(std::memory_order_relaxed);
    ProcessIdentity now{};
    const bool alive = read_process_identity(holder, &now);
    bool holds = false;
    if (alive && memo != nullptr && memo->lock_pid[s] == holder && memo->lock_start_time[s] == now.start_time &&
        memo->lock_fd[s] == fd) {
      holds = memo->lock_held[s];  // looked at before, and nothing it depends on changed
    } else {
      holds = alive && file_known && holds_lock_on(holder, fd, file);
      if (memo != nullptr) {
        memo->lock_pid[s] = alive ? holder : 0;
        memo->lock_start_time[s] = alive ? now.start_time : 0;
        memo->lock_fd[s] = fd;
        memo->lock_held[s] = holds;
      }
    }
    if (!holds) holders[s] = 0;
  }
  if (verified != nullptr)
    for (uint32_t s = 0; s < kMaxSlots; ++s) verified[s] = std::max(holders[s], 0);
  const uint32_t high = std::min(usage.slot_high_water.load(std::memory_order_acquire), kMaxSlots);
  for (uint32_t s = 0; s < high; ++s) {
    ProcessSlot& slot = usage.slots[s];
    int32_t host_pid = 0;
    if (slot.state.load(std::memory_order_acquire) == kSlotLive) {
      // The lock holder, as our namespace numbers it, is the owner only if it
      // started when the owner did: the slot may have changed hands since.
      const int32_t holder = holders[s];
      const uint64_t start_time = slot.start_time.load(std::memory_order_relaxed);
      if (memo != nullptr && holder > 0 && memo->host_pid[s] == holder && memo->start_time[s] == start_time) {
        // Found to be the owner before, and the same PID holds the lock: the
        // process checked then, or one that took its PID and the slot since
        // and wrote the old start time into it (a new owner writes its
        // own). Either way the PID names the process that holds the slot.
        host_pid = holder;
      } else {
        ProcessIdentity seen{};
        if (read_process_identity(holder, &seen) && seen.start_time == start_time) host_pid = holder;
        if (memo != nullptr) {
          memo->start_time[s] = start_time;
          memo->host_pid[s] = host_pid;
        }
      }
    }
    if (slot.host_pid.load(std::memory_order_relaxed) != host_pid)
      slot.host_pid.store(host_pid, std::memory_order_relaxed);
  }
}

int claim_slot(TenantLedger& ledger, const ProcessIdentity& self, LedgerError* error) {
  UsageSegment& usage = *ledger.usage;
  for (uint32_t s = 0; s < kMaxSlots; ++s) {
    // Record locks never conflict with the caller's own: a slot this very
    // process already holds would look free. Its identity tells it apart.
    const ProcessSlot& existing = usage.slots[s];
    if (existing.state.load(std::memory_order_acquire) == kSlotLive &&
        existing.pid.load(std::memory_order_relaxed) == self.pid &&
        existing.start_time.load(std::memory_order_relaxed) == self.start_time)
      continue;
    if (set_record_lock(ledger.usage_fd, s, F_WRLCK) != 0) {
      if (errno == EACCES || errno == EAGAIN) continue;  // a live owner, or a reclaimer at work
      if (error) *error = LedgerError::kIo;
      return -1;
    }
    // The lock is ours, so no live process owns this slot; whatever it holds
    // is a dead owner's, dropped only once the grace period has passed.
    ProcessSlot& slot = usage.slots[s];
    if (slot_total(usage, s) != 0 && !orphan_grace_over(slot)) {
      set_record_lock(ledger.usage_fd, s, F_UNLCK);
      continue;
    }
    clear_slot_charges(usage, s);
    clear_slot_requests(usage, s);
    slot.orphaned_ns.store(0, std::memory_order_relaxed);
    slot.host_pid.store(0, std::memory_order_relaxed);  // the daemon fills it in
    slot.lock_fd.store(ledger.usage_fd, std::memory_order_relaxed);
    slot.pid.store(self.pid, std::memory_order_relaxed);
    slot.start_time.store(self.start_time, std::memory_order_relaxed);
    struct timespec ts {};
    clock_gettime(CLOCK_REALTIME, &ts);
    slot.attach_ns.store(static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + ts.tv_nsec, std::memory_order_relaxed);
    memcpy(slot.comm, self.comm, sizeof slot.comm);
    slot.state.store(kSlotLive, std::memory_order_release);
    uint32_t high = usage.slot_high_water.load(std::memory_order_relaxed);
    while (high < s + 1 &&
           !usage.slot_high_water.compare_exchange_weak(high, s + 1, std::memory_order_seq_cst)) {
    }
    return static_cast<int>(s);
  }
  if (error) *error = LedgerError::kFull;
  return -1;
}

void release_slot(TenantLedger& ledger, uint32_t slot) {
  ledger.usage->slots[slot].state.store(kSlotFree, std::memory_order_release);
  set_record_lock(ledger.usage_fd, slot, F_UNLCK);
}

ReclaimResult reclaim_dead_slots(TenantLedger& ledger, int own_slot) {
  UsageSegment& usage = *ledger.usage;
  const uint32_t high = std::min(usage.slot_high_water.load(std::memory_order_acquire), kMaxSlots);
  ReclaimResult result;
  for (uint32_t s = 0; s < high; ++s) {
    if (static_cast<int>(s) == own_slot) continue;
    if (usage.slots[s].state.load(std::memory_order_acquire) == kSlotFree && slot_total(usage, s) == 0) continue;
    if (set_record_lock(ledger.usage_fd, s, F_WRLCK) != 0) continue;  // owner alive
    if (!orphan_grace_over(usage.slots[s])) {
      ++result.pending;
      set_record_lock(ledger.usage_fd, s, F_UNLCK);
      continue;
    }
    result.bytes += slot_total(usage, s);
    clear_slot_charges(usage, s);
    usage.slots[s].orphaned_ns.store(0, std::memory_order_relaxed);
    usage.slots[s].state.store(kSlotFree, std::memory_order_release);
    set_record_lock(ledger.usage_fd, s, F_UNLCK);
    ++result.reclaimed;
  }
  return result;
}

int32_t slot_owner_pid(const TenantLedger& ledger, uint32_t slot) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = slot_lock_offset(slot);
  fl.l_len = 1;
  if (fcntl(ledger.usage_fd, F_GETLK, &fl) != 0) return 0;
  if (fl.l_type == F_UNLCK) return 0;
  return fl.l_pid > 0 ? fl.l_pid : -1;
}

}  // namespace fracgpu::ledger

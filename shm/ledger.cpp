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
#include <unistd.h>

namespace fracgpu::ledger {
void set_error(char* err, size_t err_len, const char* fmt, ...) {
  if (err == nullptr || err_len == 0) return;
  va_list args;
  va_start(args, fmt);
  vsnprintf(err, err_len, fmt, args);
  va_end(args);
}

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

LedgerError map_segment(const char* dir, const char* file, bool writable, bool create, uint64_t magic,
                        size_t bytes, mode_t mode, const char* tenant_name, Mapping* out, char* err,
                        size_t err_len) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  const LedgerStamp stamp{magic, bytes, tenant_name};
  void* map = nullptr;
  int fd = -1;
  LedgerError e = map_shared_file(path, writable, create ? mode : 0, bytes, create ? stamp_ledger_segment : nullptr,
                                  &stamp, &map, &fd, err, err_len);
  if (e != LedgerError::kOk) return e;
  LedgerError check = check_header(*static_cast<const SegmentHeader*>(map), magic, bytes);
  if (check != LedgerError::kOk) {
    const auto* h = static_cast<const SegmentHeader*>(map);
    if (check == LedgerError::kWrongVersion)
      set_error(err, err_len, "%s: ledger layout version %u, this fracgpu speaks version %u", path,
                h->layout_version, kLayoutVersion);
    else if (check == LedgerError::kForeign)
      set_error(err, err_len, "%s: not a fracgpu %s segment (bad magic)", path, file);
    else
      set_error(err, err_len, "%s: corrupt header", path);
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
  char tmp[4096 + 32];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, static_cast<int>(getpid()));
  int fd = ::open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) {
    set_error(err, err_len, "%s: cannot create: %s", tmp, strerror(errno));
    return errno_to_error(errno);
  }
  fchmod(fd, mode);  // not subject to the umask
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    ::close(fd);
    unlink(tmp);
    set_error(err, err_len, "%s: cannot size: %s", tmp, strerror(e));
    return errno_to_error(e);
  }
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    unlink(tmp);
    set_error(err, err_len, "%s: cannot map: %s", tmp, strerror(e));
    return errno_to_error(e);
  }
  if (stamp != nullptr) stamp(map, stamp_arg);
  munmap(map, bytes);
  ::close(fd);
  // link() fails if another creator won the race; then we use theirs.
  if (link(tmp, path) != 0 && errno != EEXIST) {
    int e = errno;
    unlink(tmp);
    set_error(err, err_len, "%s: cannot publish: %s", path, strerror(e));
    return errno_to_error(e);
  }
  unlink(tmp);
  return LedgerError::kOk;
}

LedgerError map_shared_file(const char* path, bool writable, mode_t create_mode, size_t bytes, StampFn stamp,
                            const void* stamp_arg, void** map_out, int* fd_out, char* err, size_t err_len) {
  int fd = ::open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT && create_mode != 0) {
    LedgerError e = create_segment_file(path, create_mode, bytes, stamp, stamp_arg, err, err_len);
    if (e != LedgerError::kOk) return e;
    fd = ::open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  }
  if (fd < 0) {
    int e = errno;
    set_error(err, err_len, "%s: cannot open: %s", path, strerror(e));
    return errno_to_error(e);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    set_error(err, err_len, "%s: cannot stat: %s", path, strerror(e));
    return errno_to_error(e);
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    ::close(fd);
    set_error(err, err_len, "%s: size is %lld bytes, this fracgpu expects %zu", path,
              static_cast<long long>(st.st_size), bytes);
    return LedgerError::kWrongSize;
  }
  void* map = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    set_error(err, err_len, "%s: cannot map: %s", path, strerror(e));
    return errno_to_error(e);
  }
  *map_out = map;
  *fd_out = fd;
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
  if (daemon) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
      set_error(err, err_len, "%s: cannot create directory: %s", dir, strerror(errno));
      return errno_to_error(errno);
    }
  }
  Mapping policy, usage;
  LedgerError e = map_segment(dir, kPolicyFileName, daemon, daemon, kPolicyMagic, sizeof(PolicySegment), 0644,
                              tenant_name, &policy, err, err_len);
  if (e != LedgerError::kOk) return e;
  e = map_segment(dir, kUsageFileName, mode != AccessMode::kReadOnly, daemon, kUsageMagic, sizeof(UsageSegment),
                  0666, nullptr, &usage, err, err_len);
  if (e != LedgerError::kOk) {
    unmap(policy, sizeof(PolicySegment));
    return e;
  }
  auto* p = static_cast<PolicySegment*>(policy.addr);
  // Entries and the high-water mark index fixed-size arrays: refuse values
  // that would send a reader out of bounds.
  auto* u = static_cast<UsageSegment*>(usage.addr);
  if (u->slot_high_water.load(std::memory_order_relaxed) > kMaxSlots) {
    set_error(err, err_len, "%s/%s: corrupt: slot high-water mark out of range", dir, kUsageFileName);
    unmap(policy, sizeof(PolicySegment));
    unmap(usage, sizeof(UsageSegment));
    return LedgerError::kCorrupt;
  }
  for (const GpuPolicy& g : p->gpus) {
    if (g.state.load(std::memory_order_relaxed) > kGpuRevoked) {
      set_error(err, err_len, "%s/%s: corrupt: GPU entry in unknown state", dir, kPolicyFileName);
      unmap(policy, sizeof(PolicySegment));
      unmap(usage, sizeof(UsageSegment));
      return LedgerError::kCorrupt;
    }
  }
  out->policy = p;
  out->usage = u;
  out->policy_fd = policy.fd;
  out->usage_fd = usage.fd;
  out->mode = mode;
  return LedgerError::kOk;
}

void close_ledger(TenantLedger* ledger) {
  if (ledger->policy != nullptr) munmap(ledger->policy, sizeof(PolicySegment));
  if (ledger->usage != nullptr) munmap(ledger->usage, sizeof(UsageSegment));
  if (ledger->policy_fd >= 0) ::close(ledger->policy_fd);
  if (ledger->usage_fd >= 0) ::close(ledger->usage_fd);
  *ledger = TenantLedger{};
}

int find_gpu(const PolicySegment& policy, const uint8_t uuid[16]) {
  for (uint32_t g = 0; g < kMaxGpus; ++g) {
    if (policy.gpus[g].state.load(std::memory_order_acquire) == kGpuUnused) continue;
    if (memcmp(policy.gpus[g].uuid, uuid, 16) == 0) return static_cast<int>(g);
  }
  return -1;
}

int bind_gpu(PolicySegment& policy, const uint8_t uuid[16]) {
  int found = find_gpu(policy, uuid);
  if (found >= 0) return found;
  for (uint32_t g = 0; g < kMaxGpus; ++g) {
    GpuPolicy& entry = policy.gpus[g];
    if (entry.state.load(std::memory_order_acquire) != kGpuUnused) continue;
    memcpy(entry.uuid, uuid, 16);
    entry.memory_quota.store(0, std::memory_order_relaxed);
    // Bound but not yet granted: readers treat it like a revoked grant until
    // the daemon fills the limits and flips it to kGpuGranted.
    entry.state.store(kGpuRevoked, std::memory_order_release);
    return static_cast<int>(g);
  }
  return -1;
}

uint64_t tenant_used(const UsageSegment& usage, uint32_t gpu) {
  const uint32_t high = std::min(usage.slot_high_water.load(std::memory_order_seq_cst), kMaxSlots);
  uint64_t sum = 0;
  for (uint32_t s = 0; s < high; ++s) sum += usage.charges[gpu][s].load(std::memory_order_seq_cst);
  return sum;
}

bool try_charge(const PolicySegment& policy, UsageSegment& usage, uint32_t gpu, uint32_t slot, uint64_t bytes) {
  if (bytes == 0) return true;
  const GpuPolicy& entry = policy.gpus[gpu];
  if (entry.state.load(std::memory_order_acquire) != kGpuGranted) return false;
  std::atomic<uint64_t>& mine = usage.charges[gpu][slot];
  // Retry only while the quota looks like it has room without us: a refusal
  // then was a collision with a racing caller that has since undone its own.
  constexpr int kAttempts = 8;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const uint64_t quota = entry.memory_quota.load(std::memory_order_acquire);
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

void record_host_pids(TenantLedger& ledger) {
  UsageSegment& usage = *ledger.usage;
  const uint32_t high = std::min(usage.slot_high_water.load(std::memory_order_acquire), kMaxSlots);
  for (uint32_t s = 0; s < high; ++s) {
    ProcessSlot& slot = usage.slots[s];
    int32_t host_pid = 0;
    if (slot.state.load(std::memory_order_acquire) == kSlotLive) {
      // The lock holder, as our namespace numbers it, is the owner only if it
      // started when the owner did: the slot may have changed hands since.
      const int32_t holder = slot_owner_pid(ledger, s);
      ProcessIdentity seen{};
      char path[40];
      snprintf(path, sizeof path, "/proc/%d/stat", holder);
      if (holder > 0 && read_stat_identity(path, &seen) &&
          seen.start_time == slot.start_time.load(std::memory_order_relaxed))
        host_pid = holder;
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

void publish_policy_change(PolicySegment& policy) {
  policy.generation.fetch_add(1, std::memory_order_seq_cst);
}

}  // namespace fracgpu::ledger

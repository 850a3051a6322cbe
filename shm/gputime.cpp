#include "gputime.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace fracgpu::gputime {
namespace {

using ledger::set_error;

void stamp_arbiter(void* map, const void* arg) {
  stamp_header(static_cast<GpuTimeSegment*>(map)->header, static_cast<const uint8_t*>(arg));
}

bool all_zero(const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  return std::all_of(b, b + n, [](unsigned char c) { return c == 0; });
}

// Not FUTEX_PRIVATE_FLAG: the words live in a file mapped by many processes.
// The kernel keys them by inode and offset, so a read-only mapping (a
// tenant's) and the daemon's read-write one name the same futex.
long futex(const std::atomic<uint32_t>* word, int op, uint32_t value, uint64_t timeout_ns) {
  struct timespec timeout {};
  timeout.tv_sec = static_cast<time_t>(timeout_ns / 1'000'000'000ull);
  timeout.tv_nsec = static_cast<long>(timeout_ns % 1'000'000'000ull);
  return syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), op, value, op == FUTEX_WAIT ? &timeout : nullptr,
                 nullptr, 0);
}

}  // namespace

void stamp_header(GpuTimeHeader& h, const uint8_t* uuid) {
  h.magic = kGpuTimeMagic;
  h.layout_version = kGpuTimeLayoutVersion;
  h.header_bytes = sizeof(GpuTimeHeader);
  h.segment_bytes = sizeof(GpuTimeSegment);
  if (uuid != nullptr) memcpy(h.uuid, uuid, 16);
}

bool header_valid(const GpuTimeHeader& h, const uint8_t* uuid) {
  return h.magic == kGpuTimeMagic && h.layout_version == kGpuTimeLayoutVersion &&
         h.header_bytes == sizeof(GpuTimeHeader) && h.segment_bytes == sizeof(GpuTimeSegment) &&
         (uuid == nullptr || memcmp(h.uuid, uuid, 16) == 0);
}

LedgerError open_arbiter(const char* path, bool create, bool read_only, const uint8_t* uuid, Arbiter* out, char* err,
                         size_t err_len) {
  void* map = nullptr;
  int fd = -1;
  // 0644: only the daemon (root) may write it; tenants map it read-only.
  LedgerError e = ledger::map_shared_file(path, !read_only, create ? 0644 : 0, sizeof(GpuTimeSegment),
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

// ---- Policy arithmetic ----

uint64_t saturating_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

uint64_t scale(uint64_t ns, uint32_t ppm) {
  const auto v = static_cast<unsigned __int128>(ns) * kPpm / std::max<uint32_t>(ppm, 1);
  return v > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(v);
}

bool within_limit(uint64_t tat, uint32_t limit_ppm, uint64_t now, uint64_t* eligible_at, uint64_t burst_ns) {
  if (eligible_at != nullptr) *eligible_at = 0;
  if (limit_ppm >= kPpm) return true;
  if (tat <= saturating_add(now, burst_ns)) return true;
  if (eligible_at != nullptr) *eligible_at = tat - burst_ns;
  return false;
}

uint64_t advance_limit(uint64_t tat, uint64_t ns, uint32_t limit_ppm, uint64_t credit_from, uint64_t burst_ns) {
  if (limit_ppm >= kPpm || ns == 0) return tat;
  // GCRA: using ns of GPU time at a rate of limit_ppm costs ns / limit of
  // wall time; time left unused is credited only up to the burst.
  const uint64_t floor = credit_from > burst_ns ? credit_from - burst_ns : 0;
  return saturating_add(std::max(tat, floor), scale(ns, limit_ppm));
}

bool daemon_alive(const GpuTimeSegment& seg, uint64_t now) {
  const uint64_t beat = seg.daemon.daemon_heartbeat_ns.load(std::memory_order_acquire);
  // A heartbeat from the future (a damaged file) proves nothing. The reader's
  // `now` may predate the daemon's store by a moment: allow a millisecond.
  if (beat == 0 || beat > now + 1'000'000) return false;
  return now <= beat || now - beat < kDaemonDownNs;
}

// ---- Futexes ----

void wait_for_turn(const GpuTimeSegment& seg, uint32_t seen, uint64_t timeout_ns) {
  futex(&seg.grant.turn, FUTEX_WAIT, seen, timeout_ns);
}

void wake_turn(GpuTimeSegment& seg) { futex(&seg.grant.turn, FUTEX_WAKE, INT_MAX, 0); }

void ring_doorbell(const GpuTimeSegment& seg) { futex(&seg.daemon.doorbell, FUTEX_WAKE, 1, 0); }

void wait_for_doorbell(GpuTimeSegment& seg, uint64_t timeout_ns) {
  // The word is 0 (the daemon keeps it so): the wait sleeps until a wake or
  // the timeout, whatever tenants do.
  futex(&seg.daemon.doorbell, FUTEX_WAIT, 0, timeout_ns);
}

// ---- The drain handshake (the argument is in gputime.h) ----

bool enter_grant(const GpuTimeSegment& seg, GpuTimeRequest& request, uint64_t word) {
  const uint64_t seq = grant_seq(word);
  // Entering again a grant this process already reported drained (it gave
  // the GPU back, idle, and its next launch came before the daemon's next
  // pass): its words would read entered G, drained G, which is "done" to
  // the daemon. The drain is taken back first, so that whatever the daemon
  // reads after the store below finds this process entered and not drained.
  if (request.drained_grant.load(std::memory_order_seq_cst) == seq)
    request.drained_grant.store(0, std::memory_order_seq_cst);
  request.entered_grant.store(seq, std::memory_order_seq_cst);
  // The tenant's own word (the row is part of it, and in range: the caller
  // acts only on a word naming its own row).
  const uint32_t row = grant_row(word);
  if (row < kMaxTenants && seg.tenants[row].grant.load(std::memory_order_seq_cst) == word) return true;
  report_drained(seg, request, seq);
  return false;
}

void report_drained(const GpuTimeSegment& seg, GpuTimeRequest& request, uint64_t seq) {
  request.drained_grant.store(seq, std::memory_order_seq_cst);
  ring_doorbell(seg);
}

}  // namespace fracgpu::gputime

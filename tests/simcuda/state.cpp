// Shared device state, process bookkeeping, memory accounting and the
// simulated timeline. See sim_internal.h for the concurrency rules.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string_view>
#include <vector>

#include "sim_internal.h"

namespace simcuda {

U64 g_calls[kProcRows];

bool failing(int row) {
  static const std::vector<bool> failing_rows = [] {
    std::vector<bool> rows(kProcRows, false);
    const char* list = std::getenv("SIMCUDA_FAIL");
    for (std::string_view rest = list != nullptr ? list : ""; !rest.empty();) {
      const size_t comma = rest.find(',');
      const std::string_view name = rest.substr(0, comma);
      for (size_t i = 0; i < kProcRows; ++i)
        if (kProcTable[i].exported == name) rows[i] = true;
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
    return rows;
  }();
  return failing_rows[static_cast<size_t>(row)];
}

namespace {

// ---------------------------------------------------------------------------
// SIMCUDA_DEVICES parsing
// ---------------------------------------------------------------------------

struct DevSpec {
  unsigned char uuid[16] = {};
  std::string name = "Simulated GPU";
  uint64_t mem = 16 * kGiB;
  uint64_t ctx = 64 * kMiB;
  uint32_t sms = 132;
  uint32_t cc_major = 9;  // compute capability
  uint32_t cc_minor = 0;
};

// Logs configuration problems once per message kind: a test double must say
// why it refuses to start rather than fail silently, but must not flood.
void log_once(std::atomic<bool>& flag, const std::string& msg) {
  if (!flag.exchange(true)) std::fprintf(stderr, "simcuda: %s\n", msg.c_str());
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

// "<integer>[unit]", unit one of B, K/KiB, M/MiB, G/GiB, T/TiB (binary).
bool parse_size(std::string_view s, uint64_t& out) {
  s = trim(s);
  size_t i = 0;
  uint64_t v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
    ++i;
  }
  if (i == 0) return false;
  std::string_view unit = trim(s.substr(i));
  uint64_t mul = 1;
  if (unit.empty() || iequals(unit, "b")) mul = 1;
  else if (iequals(unit, "k") || iequals(unit, "kib")) mul = 1ull << 10;
  else if (iequals(unit, "m") || iequals(unit, "mib")) mul = 1ull << 20;
  else if (iequals(unit, "g") || iequals(unit, "gib")) mul = 1ull << 30;
  else if (iequals(unit, "t") || iequals(unit, "tib")) mul = 1ull << 40;
  else return false;
  if (v > UINT64_MAX / mul) return false;
  out = v * mul;
  return true;
}

int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (the "GPU-" prefix optional).
bool parse_uuid(std::string_view s, unsigned char out[16]) {
  s = trim(s);
  if (s.size() >= 4 && (s.substr(0, 4) == "GPU-" || s.substr(0, 4) == "gpu-")) s.remove_prefix(4);
  int n = 0;
  int hi = -1;
  for (char c : s) {
    if (c == '-') continue;
    int v = hexval(c);
    if (v < 0 || n >= 16) return false;
    if (hi < 0) {
      hi = v;
    } else {
      out[n++] = static_cast<unsigned char>(hi * 16 + v);
      hi = -1;
    }
  }
  return n == 16 && hi < 0;
}

std::string format_uuid(const unsigned char u[16]) {
  char buf[64];
  std::snprintf(buf, sizeof buf,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                u[14], u[15]);
  return buf;
}

bool parse_devices(const char* env, std::vector<DevSpec>& out, std::string& err) {
  out.clear();
  if (env == nullptr) {  // unset: one default device
    out.emplace_back();
    out.back().uuid[15] = 1;
    return true;
  }
  std::string_view all(env);
  size_t index = 0;
  while (true) {
    size_t semi = all.find(';');
    std::string_view dev = trim(all.substr(0, semi));
    if (!dev.empty()) {
      if (out.size() == static_cast<size_t>(kMaxDevices)) {
        err = "SIMCUDA_DEVICES: at most " + std::to_string(kMaxDevices) + " devices";
        return false;
      }
      DevSpec d;
      // Default UUID derived from the index: GPU-00000000-...-0000000000NN.
      d.uuid[14] = static_cast<unsigned char>((index + 1) >> 8);
      d.uuid[15] = static_cast<unsigned char>(index + 1);
      while (!dev.empty()) {
        size_t comma = dev.find(',');
        std::string_view field = trim(dev.substr(0, comma));
        dev = comma == std::string_view::npos ? std::string_view() : dev.substr(comma + 1);
        if (field.empty()) continue;
        size_t eq = field.find('=');
        if (eq == std::string_view::npos) {
          err = "SIMCUDA_DEVICES: field without '=': " + std::string(field);
          return false;
        }
        std::string_view k = trim(field.substr(0, eq)), v = trim(field.substr(eq + 1));
        bool ok = true;
        if (k == "uuid") {
          ok = parse_uuid(v, d.uuid);
        } else if (k == "name") {
          ok = !v.empty() && v.size() < sizeof(SharedDevice::name);
          d.name = std::string(v);
        } else if (k == "mem") {
          ok = parse_size(v, d.mem) && d.mem > 0;
        } else if (k == "ctx") {
          ok = parse_size(v, d.ctx);
        } else if (k == "sms") {
          uint64_t n = 0;
          ok = parse_size(v, n) && n > 0 && n < 100000 && v.find_first_not_of("0123456789 ") == std::string_view::npos;
          d.sms = static_cast<uint32_t>(n);
        } else if (k == "cc") {
          // "<major>.<minor>", one or two digits each.
          const size_t dot = v.find('.');
          const auto digits = [](std::string_view t) {
            return !t.empty() && t.size() <= 2 && t.find_first_not_of("0123456789") == std::string_view::npos;
          };
          ok = dot != std::string_view::npos && digits(v.substr(0, dot)) && digits(v.substr(dot + 1));
          if (ok) {
            d.cc_major = static_cast<uint32_t>(std::stoul(std::string(v.substr(0, dot))));
            d.cc_minor = static_cast<uint32_t>(std::stoul(std::string(v.substr(dot + 1))));
            ok = d.cc_major > 0;
          }
        } else {
          err = "SIMCUDA_DEVICES: unknown field '" + std::string(k) + "'";
          return false;
        }
        if (!ok) {
          err = "SIMCUDA_DEVICES: bad value for '" + std::string(k) + "': " + std::string(v);
          return false;
        }
      }
      out.push_back(d);
      ++index;
    }
    if (semi == std::string_view::npos) break;
    all.remove_prefix(semi + 1);
  }
  return true;
}

std::string canonical(const std::vector<DevSpec>& devs) {
  // The scheduling model is part of the GPU: a stale file made under another
  // model is re-made like one made for other devices.
  const SchedParams sp = sched_params_from_env();
  std::string s = "sched=" + std::string(sp.model == kModelQueue ? "queue" : "timeslice") +
                  ",slice=" + std::to_string(sp.timeslice_ns) + ",switch=" + std::to_string(sp.switch_ns) + ";";
  for (const auto& d : devs) {
    s += "uuid=" + format_uuid(d.uuid) + ",name=" + d.name + ",mem=" + std::to_string(d.mem) +
         ",ctx=" + std::to_string(d.ctx) + ",sms=" + std::to_string(d.sms) +
         ",cc=" + std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor) + ";";
  }
  return s;
}

void init_state(SharedState* s, const std::vector<DevSpec>& devs, const std::string& canon) {
  // Magic first to 0: a process killed mid-way leaves a file the next
  // starter re-initializes rather than trusts.
  s->magic.store(0, std::memory_order_release);
  std::memset(static_cast<void*>(reinterpret_cast<char*>(s) + sizeof(U64)), 0,
              sizeof(SharedState) - sizeof(U64));
  s->layout_version = kLayoutVersion;
  s->device_count = static_cast<uint32_t>(devs.size());
  {
    timespec real{}, mono{};
    clock_gettime(CLOCK_REALTIME, &real);
    clock_gettime(CLOCK_MONOTONIC, &mono);
    const auto us = [](const timespec& t) {
      return static_cast<uint64_t>(t.tv_sec) * 1000000ull + static_cast<uint64_t>(t.tv_nsec) / 1000;
    };
    s->realtime_offset_us.store(us(real) - us(mono), std::memory_order_relaxed);
  }
  std::snprintf(s->spec, sizeof s->spec, "%s", canon.c_str());
  const SchedParams sp = sched_params_from_env();
  s->model = sp.model;
  s->timeslice_ns = sp.timeslice_ns;
  s->switch_ns = sp.switch_ns;
  for (auto& d : s->sched) d.copies[0].resident = d.copies[1].resident = -1;
  for (size_t i = 0; i < devs.size(); ++i) {
    SharedDevice& d = s->devices[i];
    std::memcpy(d.uuid, devs[i].uuid, 16);
    std::snprintf(d.name, sizeof d.name, "%s", devs[i].name.c_str());
    d.capacity = devs[i].mem;
    d.ctx_bytes = devs[i].ctx;
    d.sms = devs[i].sms;
    d.cc_major = devs[i].cc_major;
    d.cc_minor = devs[i].cc_minor;
    d.pci_bus = static_cast<uint32_t>(0x10 + i);
  }
  s->magic.store(kMagic, std::memory_order_release);
}

uint64_t process_start_time() {
  // Field 22 of /proc/self/stat; (pid, start time) names a process even when
  // the pid is reused.
  int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  // After ')' come field 3 (state) .. ; starttime is field 22.
  int field = 2;
  for (++p; *p != 0; ++p) {
    if (*p == ' ') {
      ++field;
      if (field == 22) return std::strtoull(p + 1, nullptr, 10);
    }
  }
  return 0;
}

// ---- OFD locks on the state file ----------------------------------------
// Byte 0: the global critical section. Byte 1+i: held by slot i's owner.
// OFD locks belong to the open file description: released by the kernel when
// the process dies, not inherited in a useful way by fork (the child closes
// its copy of the descriptor at once, see atfork_child), and not dropped when
// some other descriptor of the file is closed (classic POSIX locks would be).

bool ofd_lock(int fd, off_t byte, bool wait) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  while (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) != 0) {
    if (errno != EINTR) return false;
  }
  return true;
}

void ofd_unlock(int fd, off_t byte) {
  struct flock fl {};
  fl.l_type = F_UNLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  while (fcntl(fd, F_OFD_SETLK, &fl) != 0 && errno == EINTR) {
  }
}

// True when someone holds a lock on the byte (i.e. the slot owner is alive).
// On an unexpected error we answer "held": never drop a live process's memory.
bool ofd_held(int fd, off_t byte) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return true;
  return fl.l_type != F_UNLCK;
}

// Retires the slots of dead processes: their memory stops counting, their
// busy-time record stays for simcuda_busy_ns until the slot is recycled.
// Caller holds the global lock.
void sweep_locked() {
  Process& P = proc();
  if (!P.shared) return;
  SharedState* s = P.S;
  for (int i = 0; i < kMaxSlots; ++i) {
    SharedSlot& sl = s->slots[i];
    if (i == P.slot || sl.state.load(std::memory_order_acquire) != kSlotLive) continue;
    if (ofd_held(P.fd, 1 + i)) continue;
    sl.state.store(kSlotRetired, std::memory_order_release);
    for (auto& u : sl.used) u.store(0, std::memory_order_relaxed);
  }
}

bool any_live_locked(SharedState* s) {
  for (auto& sl : s->slots)
    if (sl.state.load(std::memory_order_acquire) == kSlotLive) return true;
  return false;
}

void set_va_ranges() {
  Process& P = proc();
  // Fake addresses: 16 TiB of bump space per slot above 2^52, so pointers
  // are unique among live processes, 512-aligned and never 0. The v1
  // (32-bit) entry points get a separate window below 4 GiB.
  uint64_t slot = P.slot < 0 ? 0 : static_cast<uint64_t>(P.slot);
  P.va_next = (1ull << 52) + (slot << 44) + kChunk;
  P.va_end = (1ull << 52) + ((slot + 1) << 44);
  P.va32_next = 0x10000000ull;
  P.va32_end = 0xF0000000ull;
}

// Claims a slot for this process (global lock held).
bool claim_slot_locked() {
  Process& P = proc();
  SharedState* s = P.S;
  if (!P.shared) {
    P.slot = 0;
  } else {
    sweep_locked();
    // Free slots first, then the retired slot retired longest ago.
    std::vector<int> order;
    for (int i = 0; i < kMaxSlots; ++i)
      if (s->slots[i].state.load() == kSlotFree) order.push_back(i);
    std::vector<int> retired;
    for (int i = 0; i < kMaxSlots; ++i)
      if (s->slots[i].state.load() == kSlotRetired) retired.push_back(i);
    std::sort(retired.begin(), retired.end(),
              [s](int a, int b) { return s->slots[a].seq.load() < s->slots[b].seq.load(); });
    order.insert(order.end(), retired.begin(), retired.end());
    P.slot = -1;
    for (int i : order) {
      if (!ofd_lock(P.fd, 1 + i, false)) continue;  // somebody still holds it
      P.slot = i;
      break;
    }
    if (P.slot < 0) return false;
  }
  SharedSlot& sl = s->slots[P.slot];
  sl.state.store(kSlotFree, std::memory_order_relaxed);
  for (int d = 0; d < kMaxDevices; ++d) {
    sl.used[d].store(0, std::memory_order_relaxed);
    sl.busy_ns[d].store(0, std::memory_order_relaxed);
    sl.launches[d].store(0, std::memory_order_relaxed);
  }
  sl.pid.store(P.pid, std::memory_order_relaxed);
  sl.start_time.store(process_start_time(), std::memory_order_relaxed);
  sl.seq.store(s->next_seq.fetch_add(1) + 1, std::memory_order_relaxed);
  sl.own_slice_ns.store(own_slice_from_env(), std::memory_order_relaxed);
  timeslice_forget_slot(P.slot);
  sl.state.store(kSlotLive, std::memory_order_release);
  set_va_ranges();
  return true;
}

std::atomic<bool> g_logged_spec{false}, g_logged_open{false}, g_logged_foreign{false},
    g_logged_mismatch{false}, g_logged_slots{false};

// The devices this process's environment asks for (kept for a forked child
// with private state, which starts a fresh private GPU).
std::vector<DevSpec>& my_devices() {
  static auto* v = new std::vector<DevSpec>();
  return *v;
}

bool attach_shared(const char* path, const std::vector<DevSpec>& devs, const std::string& canon) {
  Process& P = proc();
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    log_once(g_logged_open, std::string("cannot open SIMCUDA_STATE ") + path + ": " + std::strerror(errno));
    return false;
  }
  if (!ofd_lock(fd, 0, true)) {
    log_once(g_logged_open, std::string("cannot lock SIMCUDA_STATE ") + path + ": " + std::strerror(errno));
    close(fd);
    return false;
  }
  auto fail = [&](const std::string& msg, std::atomic<bool>& flag) {
    log_once(flag, msg);
    ofd_unlock(fd, 0);
    close(fd);
    return false;
  };
  struct stat st {};
  if (fstat(fd, &st) != 0) return fail(std::string("fstat failed: ") + std::strerror(errno), g_logged_open);
  if (st.st_size != 0 && static_cast<size_t>(st.st_size) != sizeof(SharedState)) {
    // Another size: only take over a file written by some simcuda build.
    uint64_t magic = 0;
    if (pread(fd, &magic, sizeof magic, 0) != static_cast<ssize_t>(sizeof magic) || magic != kMagic)
      return fail(std::string("SIMCUDA_STATE ") + path + " is not a simcuda state file; refusing to overwrite it",
                  g_logged_foreign);
  }
  if (static_cast<size_t>(st.st_size) != sizeof(SharedState) && ftruncate(fd, sizeof(SharedState)) != 0)
    return fail(std::string("ftruncate failed: ") + std::strerror(errno), g_logged_open);
  void* m = mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return fail(std::string("mmap failed: ") + std::strerror(errno), g_logged_open);
  auto* s = static_cast<SharedState*>(m);
  P.fd = fd;
  P.S = s;
  P.shared = true;
  if (s->magic.load(std::memory_order_acquire) != kMagic || s->layout_version != kLayoutVersion) {
    init_state(s, devs, canon);
  } else if (canon != s->spec) {
    sweep_locked();
    if (!any_live_locked(s)) {
      // A stale file from an earlier run with another configuration.
      init_state(s, devs, canon);
    } else {
      log_once(g_logged_mismatch,
               "SIMCUDA_DEVICES differs from the live state in SIMCUDA_STATE; using the state's devices");
    }
  }
  ofd_unlock(fd, 0);
  return true;
}

}  // namespace

bool state_file_lock(off_t byte) { return ofd_lock(proc().fd, byte, true); }
void state_file_unlock(off_t byte) { ofd_unlock(proc().fd, byte); }

// ---------------------------------------------------------------------------
// Process and fork handling
// ---------------------------------------------------------------------------

namespace {

void atfork_prepare() {
  proc().mu.lock();
  proc().sched_mu.lock();
}
void atfork_parent() {
  proc().sched_mu.unlock();
  proc().mu.unlock();
}
// Set in a forked child, consumed by its first Guard: cheaper than asking
// getpid() (a system call) on every entry point.
std::atomic<bool> g_forked{false};
void atfork_child() {
  Process& P = proc();
  g_forked.store(true, std::memory_order_relaxed);
  // The inherited descriptor shares the parent's open file description and
  // with it the parent's slot lock: close it at once so the parent's death
  // stays detectable. The child re-opens the file in Guard().
  if (P.fd >= 0) {
    close(P.fd);
    P.fd = -1;
  }
  for (auto& c : g_calls) c.store(0, std::memory_order_relaxed);
  P.sched_mu.unlock();
  P.mu.unlock();
}

Process* make_process() {
  // Leaked on purpose: entry points may run during or after static
  // destruction (other libraries' destructors, detached threads).
  auto* p = new Process();
  p->pid = getpid();
  pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
  return p;
}

// First lock in a forked child: a fresh process that shares the parent's GPU.
void reset_after_fork() {
  Process& P = proc();
  P.pid = getpid();
  P.gen.fetch_add(1, std::memory_order_acq_rel);
  P.contexts.clear();
  P.ctx_set.clear();
  P.greens.clear();
  P.green_set.clear();
  P.descs.clear();
  P.desc_set.clear();
  P.streams.clear();
  P.events.clear();
  P.modules.clear();
  P.functions.clear();
  P.pools.clear();
  P.arrays.clear();
  P.mipmaps.clear();
  P.graphs.clear();
  P.graph_execs.clear();
  P.graph_allocs.clear();
  P.allocs.clear();
  P.phys.clear();
  P.reservations.clear();
  P.mappings.clear();
  for (auto& d : P.dev) {
    d.proc_tail.reset();
    d.primary = nullptr;
    d.default_pool = nullptr;
    d.current_pool = nullptr;
    d.vmm_bytes = 0;
    d.graph_mem = {};
  }
  P.slot = -1;
  if (!P.attached) return;
  if (P.shared) {
    if (P.fd >= 0) close(P.fd);  // no atfork ran (raw clone): same reasoning as atfork_child
    P.fd = open(P.path.c_str(), O_RDWR | O_CLOEXEC);
    if (P.fd < 0) {
      P.attached = false;
      P.initialized = false;
      return;
    }
  } else {
    // Private state is copied by fork; the child gets its own fresh GPU.
    init_state(P.S, my_devices(), canonical(my_devices()));
  }
  if (P.initialized) {
    if (P.shared) ofd_lock(P.fd, 0, true);
    bool ok = claim_slot_locked();
    if (P.shared) ofd_unlock(P.fd, 0);
    if (!ok) P.initialized = false;
  }
}

}  // namespace

Process& proc() {
  static Process* p = make_process();
  return *p;
}

Guard::Guard() { lock(); }
Guard::~Guard() {
  if (locked_) proc().mu.unlock();
}
void Guard::lock() {
  Process& P = proc();
  P.mu.lock();
  locked_ = true;
  if (g_forked.load(std::memory_order_relaxed)) [[unlikely]] {
    g_forked.store(false, std::memory_order_relaxed);
    reset_after_fork();
  }
}
void Guard::unlock() {
  if (locked_) proc().mu.unlock();
  locked_ = false;
}

StateLock::StateLock() {
  Process& P = proc();
  if (P.shared) {
    ofd_lock(P.fd, 0, true);
    sweep_locked();
  }
}
StateLock::~StateLock() {
  Process& P = proc();
  if (P.shared) ofd_unlock(P.fd, 0);
}

// ---------------------------------------------------------------------------
// Attachment, cuInit
// ---------------------------------------------------------------------------

bool attach() {
  Process& P = proc();
  if (P.attached) return true;
  std::vector<DevSpec> devs;
  std::string err;
  if (!parse_devices(std::getenv("SIMCUDA_DEVICES"), devs, err)) {
    log_once(g_logged_spec, err);
    return false;
  }
  std::string canon = canonical(devs);
  my_devices() = devs;
  const char* path = std::getenv("SIMCUDA_STATE");
  if (path != nullptr && *path != 0) {
    if (!attach_shared(path, devs, canon)) return false;
    P.path = path;
  } else {
    void* m = std::calloc(1, sizeof(SharedState));
    if (m == nullptr) return false;
    P.S = static_cast<SharedState*>(m);
    P.shared = false;
    P.path.clear();
    init_state(P.S, devs, canon);
  }
  P.attached = true;
  return true;
}

namespace {

// How the driver reads CUDA_VISIBLE_DEVICES (at cuInit), as NVIDIA's CUDA
// programming guide describes it ("CUDA Environment Variables") and as
// PyTorch's own reading of the variable (torch.cuda._parse_visible_devices)
// spells out the cases the guide leaves open:
//   - unset: every device, in order;
//   - a comma-separated list of device indices or of GPU UUIDs ("GPU-" and
//     enough of the UUID's leading characters to name one device), read as
//     the first entry is: the devices appear in the list's order;
//   - an index is read like strtoul (blanks around it ignored, "1gpu" is 1);
//   - the list ends at the first entry that names no device: not a number,
//     negative, past the last device, a UUID that no device's starts with or
//     that several share, an entry of the other kind;
//   - naming a device twice leaves no device at all;
//   - "MIG-..." entries name MIG devices: none here.
// Into `out`, the devices; returns how many.
int select_visible(const char* value, const SharedState& s, int out[kMaxDevices]) {
  const int n = static_cast<int>(s.device_count);
  if (value == nullptr) {
    for (int d = 0; d < n; ++d) out[d] = d;
    return n;
  }
  std::string_view rest(value);
  const bool by_uuid = rest.substr(0, 4) == "GPU-";
  if (!by_uuid && rest.substr(0, 4) == "MIG-") return 0;
  int count = 0;
  for (;;) {
    const size_t comma = rest.find(',');
    const std::string_view entry = rest.substr(0, comma);
    int dev = -1;
    if (by_uuid) {
      if (entry.substr(0, 4) != "GPU-") break;
      int matches = 0;
      for (int d = 0; d < n; ++d) {
        const std::string text = format_uuid(s.devices[d].uuid);
        if (entry.size() > text.size()) continue;
        bool same = true;
        for (size_t i = 0; i < entry.size() && same; ++i)
          same = std::tolower(static_cast<unsigned char>(entry[i])) == std::tolower(static_cast<unsigned char>(text[i]));
        if (same) {
          dev = d;
          ++matches;
        }
      }
      if (matches != 1) break;
    } else {
      std::string_view t = trim(entry);
      if (!t.empty() && t[0] == '+') t.remove_prefix(1);
      if (t.empty() || t[0] < '0' || t[0] > '9') break;  // not a number, or negative
      long long index = 0;
      for (size_t i = 0; i < t.size() && t[i] >= '0' && t[i] <= '9' && index <= n; ++i) index = index * 10 + (t[i] - '0');
      if (index >= n) break;
      dev = static_cast<int>(index);
    }
    if (std::find(out, out + count, dev) != out + count) return 0;
    out[count++] = dev;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return count;
}

}  // namespace

CUresult initialize() {
  Process& P = proc();
  if (P.initialized) return CUDA_SUCCESS;
  if (!attach()) return CUDA_ERROR_INVALID_VALUE;  // malformed configuration (logged)
  if (P.S->device_count == 0) return CUDA_ERROR_NO_DEVICE;
  P.visible_count = select_visible(std::getenv("CUDA_VISIBLE_DEVICES"), *P.S, P.visible);
  if (P.visible_count == 0) return CUDA_ERROR_NO_DEVICE;
  bool ok;
  {
    if (P.shared) ofd_lock(P.fd, 0, true);
    ok = claim_slot_locked();
    if (P.shared) ofd_unlock(P.fd, 0);
  }
  if (!ok) {
    log_once(g_logged_slots, "no free process slot in SIMCUDA_STATE (more than 256 live processes)");
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  P.initialized = true;
  return CUDA_SUCCESS;
}

int device_count() {
  Process& P = proc();
  return P.attached ? static_cast<int>(P.S->device_count) : 0;
}

bool valid_device(int dev) { return dev >= 0 && dev < device_count(); }

int visible_count() { return proc().visible_count; }

bool take_ordinal(int& dev) {
  const Process& P = proc();
  if (dev < 0 || dev >= P.visible_count) return false;
  dev = P.visible[dev];
  return true;
}

int ordinal_of(int dev) {
  const Process& P = proc();
  for (int i = 0; i < P.visible_count; ++i)
    if (P.visible[i] == dev) return i;
  return -1;
}

uint64_t sum_live_locked(int dev) {
  SharedState* s = S();
  uint64_t total = 0;
  for (auto& sl : s->slots)
    if (sl.state.load(std::memory_order_acquire) == kSlotLive) total += sl.used[dev].load(std::memory_order_relaxed);
  return total;
}

CUresult charge(int dev, uint64_t bytes) {
  Process& P = proc();
  if (bytes == 0) return CUDA_SUCCESS;
  StateLock lock;
  SharedDevice& d = P.S->devices[dev];
  uint64_t used = sum_live_locked(dev);
  if (used > d.capacity || bytes > d.capacity - used) return CUDA_ERROR_OUT_OF_MEMORY;
  P.S->slots[P.slot].used[dev].fetch_add(bytes, std::memory_order_relaxed);
  if (used + bytes > d.peak.load(std::memory_order_relaxed)) d.peak.store(used + bytes, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}

void uncharge(int dev, uint64_t bytes) {
  Process& P = proc();
  if (bytes == 0 || P.slot < 0) return;
  StateLock lock;
  U64& u = P.S->slots[P.slot].used[dev];
  uint64_t cur = u.load(std::memory_order_relaxed);
  u.store(cur >= bytes ? cur - bytes : 0, std::memory_order_relaxed);
}

CUdeviceptr reserve_va(uint64_t size, uint64_t align) {
  Process& P = proc();
  uint64_t p = round_up(P.va_next, align);
  uint64_t len = round_up(std::max<uint64_t>(size, 1), kPtrAlign);
  if (p < P.va_next || p > P.va_end || len > P.va_end - p) return 0;
  P.va_next = p + len;
  return static_cast<CUdeviceptr>(p);
}

CUdeviceptr reserve_va32(uint64_t size) {
  Process& P = proc();
  uint64_t p = round_up(P.va32_next, kPtrAlign);
  uint64_t len = round_up(std::max<uint64_t>(size, 1), kPtrAlign);
  if (p > P.va32_end || len > P.va32_end - p) return 0;
  P.va32_next = p + len;
  return static_cast<CUdeviceptr>(p);
}

// ---------------------------------------------------------------------------
// Per-thread context stack, default streams and stream-capture mode
// ---------------------------------------------------------------------------

namespace {

struct ThreadState {
  uint64_t gen = 0;
  std::vector<Ctx*> stack;
  Tail ptds_tail[kMaxDevices];  // per-thread default stream, per device
  CUstreamCaptureMode capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
};

// A pointer, not an object: thread_local objects are destroyed at exit before
// atexit handlers run, and those may still call the driver. Leaked per
// thread, like Process.
thread_local ThreadState* t_state_ptr = nullptr;

ThreadState& thread_state() {
  if (t_state_ptr == nullptr) t_state_ptr = new ThreadState();
  ThreadState& t_state = *t_state_ptr;
  uint64_t g = proc().gen.load(std::memory_order_acquire);
  if (t_state.gen != g) {  // first use in this thread, or a forked child
    t_state.gen = g;
    t_state.stack.clear();
    for (auto& t : t_state.ptds_tail) t.reset();
    t_state.capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  }
  return t_state;
}

void atomic_max(U64& a, uint64_t v) {
  uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_acq_rel)) {
  }
}

}  // namespace

std::vector<Ctx*>& ctx_stack() { return thread_state().stack; }

CUstreamCaptureMode& thread_capture_mode() { return thread_state().capture_mode; }

Ctx* current_ctx() {
  auto& st = ctx_stack();
  return st.empty() ? nullptr : st.back();
}

CUresult require_ctx(Ctx*& out) {
  Ctx* c = current_ctx();
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (!c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  out = c;
  return CUDA_SUCCESS;
}

CUresult resolve_ctx(CUcontext h, Ctx*& out) {
  if (h == nullptr) return require_ctx(out);
  Process& P = proc();
  if (P.ctx_set.count(key(h)) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = reinterpret_cast<Ctx*>(h);
  if (!c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  out = c;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Simulated time
// ---------------------------------------------------------------------------

uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void sleep_until(uint64_t t) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(t / 1000000000ull);
  ts.tv_nsec = static_cast<long>(t % 1000000000ull);
  // Absolute sleep: EINTR just retries to the same deadline.
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

CUresult resolve_stream(CUstream s, bool ptds, StreamTarget& out) {
  Process& P = proc();
  if (s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
    Ctx* c = nullptr;
    if (CUresult r = require_ctx(c)) return r;
    bool per_thread = s == CU_STREAM_PER_THREAD || (s == nullptr && ptds);
    out.dev = c->dev;
    // The legacy default stream waits for all earlier work of the process
    // on the device, so its tail is the process's tail.
    out.tail = per_thread ? &thread_state().ptds_tail[c->dev] : &P.dev[c->dev].proc_tail;
    return CUDA_SUCCESS;
  }
  auto it = P.streams.find(key(s));
  if (it == P.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  out.dev = it->second->dev;
  out.tail = &it->second->tail;
  out.hold = it->second;
  return CUDA_SUCCESS;
}

namespace {

// Records the kernel [start, end) of `pid` in the device's 1 ms bins (see
// SampleBins), lock-free: every word is replaced by a CAS loop or a store
// that leaves it valid at every instant. Bins more than kSampleBins/2 ms
// ahead of `now` are skipped: their ring slots still hold bins a reader may
// want, and work queued that far ahead is not what tests sample.
void record_bins(SampleBins& b, uint64_t start, uint64_t end, int32_t pid, uint64_t now) {
  if (end <= start) return;
  const uint64_t last_bin = now / kBinNs + kSampleBins / 2;
  for (uint64_t m = start / kBinNs; m * kBinNs < end && m <= last_bin; ++m) {
    const uint64_t lo = m * kBinNs, hi = lo + kBinNs;
    const uint64_t overlap = std::min(end, hi) - std::max(start, lo);
    const size_t i = static_cast<size_t>(m % kSampleBins);
    // Busy ns: add to the bin's word, or start it afresh over an older bin's.
    const uint64_t tag = m & kBusyTagMask;
    uint64_t cur = b.busy[i].load(std::memory_order_relaxed);
    while (true) {
      const uint64_t cur_tag = cur >> kBusyNsBits;
      if (cur_tag > tag) break;  // a newer bin owns the slot (cannot happen for bins this near)
      const uint64_t ns = cur_tag == tag ? (cur & ((1ull << kBusyNsBits) - 1)) + overlap : overlap;
      const uint64_t next = tag << kBusyNsBits | std::min(ns, kBinNs);
      if (b.busy[i].compare_exchange_weak(cur, next, std::memory_order_acq_rel)) break;
    }
    // Resident at the bin's first instant.
    if (start <= lo) b.instant[i].store(static_cast<uint64_t>(static_cast<uint32_t>(m)) << 32 | static_cast<uint32_t>(pid),
                                        std::memory_order_release);
    // Ended last in the bin (running past it: the full offset).
    const uint64_t offset = std::min(end, hi) - lo;
    const uint64_t ltag = m & kLastTagMask;
    const uint64_t word = ltag << (kLastOffsetBits + kLastPidBits) | offset << kLastPidBits |
                          (static_cast<uint64_t>(static_cast<uint32_t>(pid)) & ((1ull << kLastPidBits) - 1));
    cur = b.last[i].load(std::memory_order_relaxed);
    while (true) {
      const bool same_bin = cur >> (kLastOffsetBits + kLastPidBits) == ltag;
      if (same_bin && ((cur >> kLastPidBits) & ((1ull << kLastOffsetBits) - 1)) >= offset) break;
      if (b.last[i].compare_exchange_weak(cur, word, std::memory_order_acq_rel)) break;
    }
  }
}

}  // namespace

void record_residency(int dev, int32_t pid, int32_t slot, uint64_t start, uint64_t end, uint64_t pos0,
                      uint64_t now) {
  SharedState* st = S();
  KernelLog& log = st->kernel_logs[dev];
  const uint64_t index = log.next.fetch_add(1, std::memory_order_acq_rel);
  KernelRecord& rec = log.records[index % kKernelLogEntries];
  rec.seq.store(0, std::memory_order_release);  // incomplete until seq is written again
  rec.start.store(start, std::memory_order_relaxed);
  rec.end.store(end, std::memory_order_relaxed);
  rec.pid.store(pid, std::memory_order_relaxed);
  rec.slot = slot;
  rec.pos0.store(pos0, std::memory_order_relaxed);
  rec.seq.store(index + 1, std::memory_order_release);
  record_bins(st->sample_bins[dev], start, end, pid, now);
  st->devices[dev].busy_ns.fetch_add(end - start, std::memory_order_relaxed);
  if (slot >= 0 && slot < kMaxSlots) st->slots[slot].busy_ns[dev].fetch_add(end - start, std::memory_order_relaxed);
}

void Tail::advance_to(const Mark& m) {
  atomic_max(time, m.time);
  atomic_max(work, m.work);
}

Mark enqueue_kernel(const StreamTarget& t, uint64_t d, uint64_t launches) {
  Process& P = proc();
  SharedDevice& dev = P.S->devices[t.dev];
  SharedSlot& slot = P.S->slots[P.slot];
  dev.launches.fetch_add(launches, std::memory_order_relaxed);
  slot.launches[t.dev].fetch_add(launches, std::memory_order_relaxed);
  if (timeslice_model()) {
    // Where it ends is known only as a point of this process's work; a copy
    // still running on the stream does not hold it back (see enqueue_copy).
    const Mark end{0, timeslice_enqueue(t.dev, d)};
    t.tail->advance_to(end);
    P.dev[t.dev].proc_tail.advance_to(end);
    return end;
  }
  uint64_t now = now_ns();
  uint64_t busy = dev.busy_until.load(std::memory_order_acquire);
  uint64_t end = 0;
  // One timeline per device: a kernel starts when its stream's earlier work
  // and every kernel already enqueued on the device (any process) are done.
  while (true) {
    uint64_t start = std::max({now, busy, t.tail->time.load(std::memory_order_acquire)});
    end = start + d;
    if (dev.busy_until.compare_exchange_weak(busy, end, std::memory_order_acq_rel)) break;
  }
  t.tail->advance_to({end, 0});
  P.dev[t.dev].proc_tail.advance_to({end, 0});
  record_residency(t.dev, P.pid, P.slot, end - d, end, 0, now);
  return {end, 0};
}

Mark enqueue_copy(const StreamTarget& t, uint64_t d) {
  Process& P = proc();
  uint64_t now = now_ns();
  uint64_t tail = t.tail->time.load(std::memory_order_acquire);
  uint64_t end = 0;
  while (true) {
    end = std::max(now, tail) + d;
    if (t.tail->time.compare_exchange_weak(tail, end, std::memory_order_acq_rel)) break;
  }
  P.dev[t.dev].proc_tail.advance_to({end, 0});
  return {end, t.tail->work.load(std::memory_order_acquire)};
}

uint64_t copy_duration_ns(uint64_t bytes) {
  // 1 us of latency plus ~16 GB/s: small, deterministic, not kernel time.
  return 1000 + bytes / 16;
}

uint64_t function_duration_from_name(std::string_view name) {
  // "sleep_<N>us" anywhere in the (possibly mangled) name: N microseconds.
  size_t pos = 0;
  while ((pos = name.find("sleep_", pos)) != std::string_view::npos) {
    size_t i = pos + 6;
    uint64_t n = 0;
    size_t digits = 0;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9' && digits < 12) {
      n = n * 10 + static_cast<uint64_t>(name[i] - '0');
      ++i;
      ++digits;
    }
    if (digits > 0 && name.substr(i, 2) == "us") return n * 1000;
    pos += 6;
  }
  return 10000;  // 10 us
}

}  // namespace simcuda

// The control API (simcuda.h): the tests' view of the simulated GPU.
// None of these needs cuInit; each attaches to the state on first use and
// answers 0 (or -1) rather than failing hard.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "sim_internal.h"

using namespace simcuda;

namespace {

// Guard held. The slot describing `pid` (0: this process): a live slot if
// there is one, else the most recently claimed retired slot of that pid.
SharedSlot* slot_of(int pid) {
  Process& P = proc();
  if (pid == 0) pid = static_cast<int>(getpid());
  SharedSlot* best = nullptr;
  for (auto& sl : P.S->slots) {
    uint32_t st = sl.state.load(std::memory_order_acquire);
    if (st == kSlotFree || sl.pid.load(std::memory_order_relaxed) != pid) continue;
    if (st == kSlotLive) return &sl;
    if (best == nullptr || sl.seq.load() > best->seq.load()) best = &sl;
  }
  return best;
}

bool attached_device(int ordinal) { return attach() && valid_device(ordinal); }

}  // namespace

extern "C" {

int simcuda_device_count(void) {
  Guard guard;
  return attach() ? device_count() : -1;
}

uint64_t simcuda_device_capacity(int ordinal) {
  Guard guard;
  return attached_device(ordinal) ? S()->devices[ordinal].capacity : 0;
}

uint64_t simcuda_device_ctx_bytes(int ordinal) {
  Guard guard;
  return attached_device(ordinal) ? S()->devices[ordinal].ctx_bytes : 0;
}

uint64_t simcuda_device_used(int ordinal) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  StateLock lock;  // drops dead processes first
  return sum_live_locked(ordinal);
}

uint64_t simcuda_device_peak(int ordinal) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  StateLock lock;
  return S()->devices[ordinal].peak.load(std::memory_order_relaxed);
}

void simcuda_reset_peak(int ordinal) {
  Guard guard;
  if (!attached_device(ordinal)) return;
  StateLock lock;
  S()->devices[ordinal].peak.store(sum_live_locked(ordinal), std::memory_order_relaxed);
}

uint64_t simcuda_process_used(int ordinal, int pid) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  StateLock lock;
  SharedSlot* sl = slot_of(pid);
  if (sl == nullptr || sl->state.load(std::memory_order_acquire) != kSlotLive) return 0;
  return sl->used[ordinal].load(std::memory_order_relaxed);
}

int simcuda_live_process_count(void) {
  Guard guard;
  if (!attach()) return 0;
  StateLock lock;
  int n = 0;
  for (auto& sl : S()->slots)
    if (sl.state.load(std::memory_order_acquire) == kSlotLive) ++n;
  return n;
}

uint64_t simcuda_now_ns(void) { return now_ns(); }

int simcuda_set_own_timeslice_us(uint64_t us) {
  Guard guard;
  if (!attach() || us > 1000000 || proc().slot < 0) return -1;
  // The residency so far was under the old slice: record it before the change.
  for (int d = 0; d < device_count(); ++d) advance_device(d);
  S()->slots[proc().slot].own_slice_ns.store(us * 1000, std::memory_order_relaxed);
  return 0;
}

uint64_t simcuda_busy_ns(int ordinal, int pid) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  advance_device(ordinal);  // residency is recorded as the scheduler runs forward
  StateLock lock;
  SharedSlot* sl = slot_of(pid);
  return sl == nullptr ? 0 : sl->busy_ns[ordinal].load(std::memory_order_relaxed);
}

uint64_t simcuda_launch_count(int ordinal, int pid) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  StateLock lock;
  SharedSlot* sl = slot_of(pid);
  return sl == nullptr ? 0 : sl->launches[ordinal].load(std::memory_order_relaxed);
}

uint64_t simcuda_device_busy_ns(int ordinal) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  advance_device(ordinal);
  return S()->devices[ordinal].busy_ns.load(std::memory_order_relaxed);
}

uint64_t simcuda_device_busy_until_ns(int ordinal) {
  Guard guard;
  return attached_device(ordinal) ? projected_idle_ns(ordinal) : 0;
}

uint64_t simcuda_kernel_log_next(int ordinal) {
  Guard guard;
  if (!attached_device(ordinal)) return 0;
  advance_device(ordinal);
  return S()->kernel_logs[ordinal].next.load(std::memory_order_acquire);
}

size_t simcuda_kernel_log(int ordinal, uint64_t first, simcuda_kernel_record* out, size_t max) {
  Guard guard;
  if (!attached_device(ordinal) || out == nullptr) return 0;
  advance_device(ordinal);
  const KernelLog& log = S()->kernel_logs[ordinal];
  const uint64_t next = log.next.load(std::memory_order_acquire);
  uint64_t index = std::max(first, next > kKernelLogEntries ? next - kKernelLogEntries : 0);
  size_t n = 0;
  for (; index < next && n < max; ++index) {
    const KernelRecord& rec = log.records[index % kKernelLogEntries];
    // A record still being written (or already overwritten) is skipped.
    if (rec.seq.load(std::memory_order_acquire) != index + 1) continue;
    simcuda_kernel_record r{index, rec.start.load(std::memory_order_relaxed), rec.end.load(std::memory_order_relaxed),
                            rec.pid.load(std::memory_order_relaxed), 0};
    if (rec.seq.load(std::memory_order_acquire) != index + 1) continue;
    out[n++] = r;
  }
  return n;
}

uint64_t simcuda_call_count(const char* exported_name) {
  if (exported_name == nullptr) return 0;
  for (size_t i = 0; i < kProcRows; ++i)
    if (kProcTable[i].exported == exported_name) return g_calls[i].load(std::memory_order_relaxed);
  return 0;
}

void simcuda_reset_call_counts(void) {
  for (auto& c : g_calls) c.store(0, std::memory_order_relaxed);
}

size_t simcuda_proc_table_size(void) { return kProcRows; }

int simcuda_proc_table_entry(size_t index, const char** base, int* version, int* per_thread_stream,
                             const char** exported) {
  if (index >= kProcRows) return -1;
  const ProcRow& r = kProcTable[index];
  if (base != nullptr) *base = r.base.data();
  if (version != nullptr) *version = r.version;
  if (per_thread_stream != nullptr) *per_thread_stream = r.per_thread ? 1 : 0;
  if (exported != nullptr) *exported = r.exported.data();
  return 0;
}

const char* simcuda_state_path(void) {
  Guard guard;
  if (!attach()) return "";
  return proc().path.c_str();  // the Process object is never freed
}

int simcuda_process_in_critical_section(int pid) {
  Guard guard;
  if (!attach() || !proc().shared) return -1;
  const std::string& state = proc().path;
  // The process's descriptors of the state file; for each, the locks its
  // open file description holds (fdinfo's "lock:" lines: ... OFDLCK ADVISORY
  // WRITE <pid> <dev:inode> <start> <end>). Slot bytes (1+slot) are held for
  // a process's life and are not critical sections.
  const std::string fds = "/proc/" + std::to_string(pid) + "/fd";
  DIR* dir = opendir(fds.c_str());
  if (dir == nullptr) return -1;
  int found = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    char target[4096];
    const ssize_t n = readlink((fds + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (state != target) continue;
    FILE* info = fopen(("/proc/" + std::to_string(pid) + "/fdinfo/" + e->d_name).c_str(), "r");
    if (info == nullptr) continue;
    char line[512];
    while (fgets(line, sizeof line, info) != nullptr) {
      if (strncmp(line, "lock:", 5) != 0 || strstr(line, "OFDLCK") == nullptr) continue;
      // The start is the second number from the end.
      const char* last = strrchr(line, ' ');
      if (last == nullptr) continue;
      const char* before = last;
      while (before > line && before[-1] == ' ') --before;
      while (before > line && before[-1] != ' ') --before;
      const unsigned long long start = strtoull(before, nullptr, 10);
      if (start == 0 || start >= static_cast<unsigned long long>(kSchedLockByte)) found = 1;
    }
    fclose(info);
  }
  closedir(dir);
  return found;
}

}  // extern "C"

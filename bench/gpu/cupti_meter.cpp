// cupti_meter: a CUPTI injection library that measures, from inside a CUDA
// process, how much GPU time its kernels took: the independent per-process
// measure the real-GPU harness sets beside NVML's samples (docs/gpu-results.md,
// "Calibrating the stand-in NVML"). fracgpu itself never uses CUPTI.
//
//   env CUDA_INJECTION64_PATH=/path/libfracgpu_cupti_meter.so FRACGPU_CUPTI_OUT=/results/cupti-a PROGRAM ...
//
// The CUDA driver loads the library named by CUDA_INJECTION64_PATH when the
// process initializes CUDA (cuInit) and calls its InitializeInjection. That
// enables CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL records (which, unlike
// CUPTI_ACTIVITY_KIND_KERNEL, do not serialize the process's kernels): each
// kernel's start and end as the GPU stamped them. Every second and at exit it
// writes FRACGPU_CUPTI_OUT.<pid>.json (replaced atomically):
//   kernels, kernel_time_sum_ns (the sum of the kernels' lengths),
//   gpu_time_ns (the union of their intervals: time in which one or more of
//   the process's kernels ran), dropped (records CUPTI lost), first/last
//   kernel times, and busy_ns: that union per 100 ms bin of CLOCK_MONOTONIC
//   (bin first_bin + i covers [(first_bin + i) x 100 ms, +100 ms)), so the
//   harness clips it to its measured window and lines processes up. CUPTI's
//   time stamps are converted to CLOCK_MONOTONIC with an offset taken at
//   start (clock: both readings, and the drift at the last write).
//   "final": true only in the file written at exit; "error" when CUPTI
//   refused to start (the process itself runs on regardless).
//
// With FRACGPU_CUPTI_CTX_SWITCH=1 it also asks for CUPTI 13.1's records of the
// compute engine switching contexts (CUPTI_ACTIVITY_KIND_COMPUTE_ENGINE_CTX_SWITCH)
// and for the process's own contexts (CUPTI_ACTIVITY_KIND_CONTEXT), and adds
// "ctx_switch": whether the kind was enabled (else CUPTI's error: a CUPTI
// older than 13.1 does not know it), how many records came, per context ID
// how many starts and ends, the process's own context IDs, and the first
// kCtxSwitchEventsKept records as [CLOCK_MONOTONIC ns, context ID,
// operation (1 start, 2 end)]. What tests/gpu/run_timeslice.sh asks of them:
// whether they come at all on this driver, and whether a process that runs
// nothing receives other processes' switches (docs/gpu-results.md).
//
// What it measures: a kernel's start-end includes time in which another
// process's context held the GPU (the driver's time-slicing) or ran beside it
// (MPS). So it is a process's GPU time only where one process's kernels run
// at a time (fracgpu tenants); beside another busy process without fracgpu it
// reads about the whole window (the harness flags shares summing above 1).
//
// Nothing in it has met a GPU yet: it builds wherever CUPTI's header and
// library are found (bench/gpu/CMakeLists.txt, bench/gpu/build_tools.sh) and
// cannot run without a real driver.
#include <cupti.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

// CUPTI 13.1's context-switch record, as its documentation gives it, for
// toolkits whose header predates it (this project builds with 13.0's): the
// library found at run time decides whether it knows the kind.
constexpr CUpti_ActivityKind kCtxSwitchKind = static_cast<CUpti_ActivityKind>(57);
struct CtxSwitchRecord {
  CUpti_ActivityKind kind;
  uint32_t context_id;
  uint64_t timestamp;
  uint32_t operation;  // 1: the switch starts; 2: it ends
  uint32_t padding;
};
static_assert(sizeof(CtxSwitchRecord) == 24 && offsetof(CtxSwitchRecord, timestamp) == 8, "CUPTI 13.1 record layout");
static_assert(offsetof(CUpti_ActivityContext, contextId) == 4, "CUPTI context record layout");

// start and end sit at the same place in every kernel record version (the
// newer ones only add fields at the end): read them through the oldest that
// every supported toolkit declares.
static_assert(offsetof(CUpti_ActivityKernel4, start) == 16 && offsetof(CUpti_ActivityKernel4, end) == 24,
              "CUPTI kernel record layout");

namespace {

constexpr uint64_t kBinNs = 100000000ull;       // histogram bins: 100 ms
constexpr uint64_t kHorizonNs = 2000000000ull;  // merge window for records delivered late
constexpr size_t kBufferBytes = 1u << 20;

struct Segment {
  uint64_t start, end;  // CLOCK_MONOTONIC ns
  bool operator<(const Segment& o) const { return start < o.start || (start == o.start && end < o.end); }
};

// The state is never destroyed (references to objects made with new): CUPTI's
// own thread may still deliver a buffer while the process's static
// destructors run.
std::mutex g_mutex;  // everything below
std::string& g_path = *new std::string;
std::string& g_error = *new std::string;
pid_t g_pid = 0;
long long g_offset = 0;  // CLOCK_MONOTONIC - CUPTI time, ns
uint64_t g_clock_cupti = 0, g_clock_mono = 0, g_clock_real = 0;
std::vector<Segment>& g_pending = *new std::vector<Segment>;  // delivered, not merged yet
std::vector<Segment>& g_recent = *new std::vector<Segment>;   // merged: sorted, disjoint, not committed yet
std::map<long long, uint64_t>& g_bins = *new std::map<long long, uint64_t>;  // committed union, per bin
uint64_t g_committed_ns = 0, g_horizon = 0;  // union committed; everything committed ends by g_horizon
uint64_t g_kernels = 0, g_sum_ns = 0, g_dropped = 0, g_zero = 0, g_late = 0;
uint64_t g_first = UINT64_MAX, g_last = 0;
std::set<uint32_t>& g_devices = *new std::set<uint32_t>;
// Context switches (FRACGPU_CUPTI_CTX_SWITCH=1).
constexpr size_t kCtxSwitchEventsKept = 20000;
struct SwitchCounts {
  uint64_t starts = 0, ends = 0, other = 0;
};
bool g_ctx_switch_asked = false;
std::string& g_ctx_switch_error = *new std::string;  // empty: enabled
uint64_t g_ctx_switch_records = 0;
std::map<uint32_t, SwitchCounts>& g_switches = *new std::map<uint32_t, SwitchCounts>;
std::set<uint32_t>& g_own_contexts = *new std::set<uint32_t>;
struct SwitchEvent {
  uint64_t mono_ns;
  uint32_t context_id, operation;
};
std::vector<SwitchEvent>& g_switch_events = *new std::vector<SwitchEvent>;
std::atomic<bool> g_stop{false}, g_flusher_done{false};
std::mutex g_write_mutex;

uint64_t clock_ns(clockid_t id) {
  timespec ts{};
  clock_gettime(id, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

const char* cupti_error(CUptiResult r) {
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  return s != nullptr ? s : "unknown CUPTI error";
}

// Adds [s, e) to the bins it spans.
void add_to_bins(std::map<long long, uint64_t>& bins, uint64_t s, uint64_t e) {
  while (s < e) {
    const uint64_t bin = s / kBinNs, bin_end = (bin + 1) * kBinNs;
    const uint64_t piece = std::min(e, bin_end) - s;
    bins[static_cast<long long>(bin)] += piece;
    s += piece;
  }
}

// Merges g_pending into g_recent and commits what ended before the horizon
// (the newest end minus kHorizonNs): records of one stream arrive in order, so
// only overlap across streams or buffers needs the window. Caller holds g_mutex.
void fold() {
  if (g_pending.empty()) return;
  std::vector<Segment> all;
  all.reserve(g_pending.size() + g_recent.size());
  for (const Segment& s : g_pending) {
    if (s.start < g_horizon) {  // delivered after its neighbours were committed
      ++g_late;
      if (s.end <= g_horizon) {
        add_to_bins(g_bins, s.start, s.end);  // may count time twice: counted in "late"
        g_committed_ns += s.end - s.start;
        continue;
      }
      add_to_bins(g_bins, s.start, g_horizon);
      g_committed_ns += g_horizon - s.start;
      all.push_back({g_horizon, s.end});
      continue;
    }
    all.push_back(s);
  }
  g_pending.clear();
  all.insert(all.end(), g_recent.begin(), g_recent.end());
  std::sort(all.begin(), all.end());
  g_recent.clear();
  for (const Segment& s : all) {
    if (!g_recent.empty() && s.start <= g_recent.back().end) {
      g_recent.back().end = std::max(g_recent.back().end, s.end);
    } else {
      g_recent.push_back(s);
    }
  }
  const uint64_t newest = g_recent.empty() ? 0 : g_recent.back().end;
  if (newest <= kHorizonNs) return;
  const uint64_t horizon = newest - kHorizonNs;
  size_t keep = 0;
  while (keep < g_recent.size() && g_recent[keep].end <= horizon) {
    add_to_bins(g_bins, g_recent[keep].start, g_recent[keep].end);
    g_committed_ns += g_recent[keep].end - g_recent[keep].start;
    ++keep;
  }
  g_recent.erase(g_recent.begin(), g_recent.begin() + static_cast<std::ptrdiff_t>(keep));
  g_horizon = std::max(g_horizon, horizon);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = kBufferBytes;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, kBufferBytes));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream_id, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    CUpti_Activity* record = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind == kCtxSwitchKind) {
        const auto* c = reinterpret_cast<const CtxSwitchRecord*>(record);
        ++g_ctx_switch_records;
        SwitchCounts& counts = g_switches[c->context_id];
        (c->operation == 1 ? counts.starts : c->operation == 2 ? counts.ends : counts.other) += 1;
        if (g_switch_events.size() < kCtxSwitchEventsKept)
          g_switch_events.push_back(
              {static_cast<uint64_t>(static_cast<long long>(c->timestamp) + g_offset), c->context_id, c->operation});
        continue;
      }
      if (record->kind == CUPTI_ACTIVITY_KIND_CONTEXT) {
        g_own_contexts.insert(reinterpret_cast<const CUpti_ActivityContext*>(record)->contextId);
        continue;
      }
      if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel4*>(record);
      if (k->start == 0 || k->end <= k->start) {
        ++g_zero;  // no time stamps collected for it
        continue;
      }
      const uint64_t s = static_cast<uint64_t>(static_cast<long long>(k->start) + g_offset);
      const uint64_t e = static_cast<uint64_t>(static_cast<long long>(k->end) + g_offset);
      g_pending.push_back({s, e});
      ++g_kernels;
      g_sum_ns += e - s;
      g_first = std::min(g_first, s);
      g_last = std::max(g_last, e);
      g_devices.insert(k->deviceId);
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped) == CUPTI_SUCCESS) g_dropped += dropped;
    fold();
  }
  free(buffer);
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += ' ';
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The "ctx_switch" object of the file. Caller holds g_mutex.
std::string ctx_switch_json() {
  std::string text = "{\"enabled\": " + std::string(g_ctx_switch_error.empty() ? "true" : "false");
  if (!g_ctx_switch_error.empty()) text += ", \"error\": " + json_string(g_ctx_switch_error);
  text += ", \"records\": " + std::to_string(g_ctx_switch_records) + ", \"own_contexts\": [";
  bool first = true;
  for (uint32_t id : g_own_contexts) {
    text += (first ? "" : ", ") + std::to_string(id);
    first = false;
  }
  text += "], \"contexts\": {";
  first = true;
  for (const auto& [id, counts] : g_switches) {
    text += (first ? "\"" : ", \"") + std::to_string(id) + "\": {\"starts\": " + std::to_string(counts.starts) +
            ", \"ends\": " + std::to_string(counts.ends) + ", \"other\": " + std::to_string(counts.other) + "}";
    first = false;
  }
  text += "}, \"events\": [";
  first = true;
  for (const SwitchEvent& e : g_switch_events) {
    text += (first ? "[" : ", [") + std::to_string(e.mono_ns) + ", " + std::to_string(e.context_id) + ", " +
            std::to_string(e.operation) + "]";
    first = false;
  }
  return text + "]}";
}

// Writes the file (tmp + rename). Only the process that started the meter
// writes: a child forked without exec inherits the atexit handler and the
// path, not the measurement.
void write_out(bool final) {
  if (g_path.empty() || getpid() != g_pid) return;
  std::lock_guard<std::mutex> wlock(g_write_mutex);
  std::string text;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    fold();
    std::map<long long, uint64_t> bins = g_bins;
    uint64_t union_ns = g_committed_ns;
    for (const Segment& s : g_recent) {
      add_to_bins(bins, s.start, s.end);
      union_ns += s.end - s.start;
    }
    uint64_t cupti_now = 0;
    long long drift = 0;
    if (cuptiGetTimestamp(&cupti_now) == CUPTI_SUCCESS) {
      drift = static_cast<long long>(clock_ns(CLOCK_MONOTONIC)) - (static_cast<long long>(cupti_now) + g_offset);
    }
    char buf[512];
    snprintf(buf, sizeof buf,
             "{\"tool\": \"fracgpu cupti_meter\", \"pid\": %d, \"activity\": \"CONCURRENT_KERNEL\", \"final\": %s, "
             "\"written_mono_ns\": %" PRIu64 ", \"kernels\": %" PRIu64 ", \"kernel_time_sum_ns\": %" PRIu64
             ", \"gpu_time_ns\": %" PRIu64 ", \"dropped\": %" PRIu64 ", \"zero_timestamps\": %" PRIu64
             ", \"late\": %" PRIu64 ", ",
             static_cast<int>(g_pid), final ? "true" : "false", clock_ns(CLOCK_MONOTONIC), g_kernels, g_sum_ns,
             union_ns, g_dropped, g_zero, g_late);
    text = buf;
    if (g_kernels > 0) {
      snprintf(buf, sizeof buf, "\"first_start_mono_ns\": %" PRIu64 ", \"last_end_mono_ns\": %" PRIu64 ", ", g_first,
               g_last);
    } else {
      snprintf(buf, sizeof buf, "\"first_start_mono_ns\": null, \"last_end_mono_ns\": null, ");
    }
    text += buf;
    text += "\"devices\": [";
    bool first = true;
    for (uint32_t d : g_devices) {
      text += (first ? "" : ", ") + std::to_string(d);
      first = false;
    }
    snprintf(buf, sizeof buf,
             "], \"clock\": {\"cupti_ns\": %" PRIu64 ", \"mono_ns\": %" PRIu64 ", \"real_ns\": %" PRIu64
             ", \"mono_minus_cupti_ns\": %lld, \"drift_ns\": %lld}, \"bin_ns\": %" PRIu64 ", ",
             g_clock_cupti, g_clock_mono, g_clock_real, g_offset, drift, kBinNs);
    text += buf;
    const long long first_bin = bins.empty() ? 0 : bins.begin()->first;
    text += "\"first_bin\": " + std::to_string(first_bin) + ", \"busy_ns\": [";
    if (!bins.empty()) {
      for (long long b = first_bin; b <= bins.rbegin()->first; ++b) {
        auto it = bins.find(b);
        text += (b == first_bin ? "" : ", ") + std::to_string(it == bins.end() ? 0 : it->second);
      }
    }
    text += "]";
    if (g_ctx_switch_asked) text += ", \"ctx_switch\": " + ctx_switch_json();
    if (!g_error.empty()) text += ", \"error\": " + json_string(g_error);
    text += "}\n";
  }
  const std::string tmp = g_path + ".tmp";
  FILE* f = fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    fprintf(stderr, "cupti_meter: cannot write %s\n", tmp.c_str());
    return;
  }
  const bool ok = fputs(text.c_str(), f) >= 0;
  if (fclose(f) == 0 && ok) rename(tmp.c_str(), g_path.c_str());
}

void at_exit() {
  if (getpid() != g_pid) return;
  g_stop = true;
  // Let the flusher finish a flush it is in (up to 2 s), then flush all.
  for (int i = 0; i < 200 && !g_flusher_done; ++i) usleep(10000);
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  write_out(true);
}

void flusher() {
  while (!g_stop) {
    for (int i = 0; i < 20 && !g_stop; ++i) usleep(50000);
    if (g_stop) break;
    cuptiActivityFlushAll(0);
    if (!g_stop) write_out(false);
  }
  g_flusher_done = true;
}

}  // namespace

// Called by the CUDA driver (CUDA_INJECTION64_PATH) once, during cuInit.
// Returns 1 whatever happens: the process must run on unmeasured rather than
// fail because of the meter.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* prefix = getenv("FRACGPU_CUPTI_OUT");
    if (prefix == nullptr || *prefix == '\0') {
      fprintf(stderr, "cupti_meter: FRACGPU_CUPTI_OUT is not set: not measuring\n");
      return;
    }
    g_pid = getpid();
    g_path = std::string(prefix) + "." + std::to_string(g_pid) + ".json";
    // One offset for the whole run: CUPTI's clock read between two readings
    // of CLOCK_MONOTONIC.
    uint64_t cupti_now = 0;
    const uint64_t m0 = clock_ns(CLOCK_MONOTONIC);
    CUptiResult r = cuptiGetTimestamp(&cupti_now);
    const uint64_t m1 = clock_ns(CLOCK_MONOTONIC);
    g_clock_real = clock_ns(CLOCK_REALTIME);
    g_clock_mono = (m0 + m1) / 2;
    g_clock_cupti = cupti_now;
    g_offset = static_cast<long long>(g_clock_mono) - static_cast<long long>(cupti_now);
    if (r == CUPTI_SUCCESS) r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r != CUPTI_SUCCESS) {
      g_error = std::string("CUPTI did not start: ") + cupti_error(r);
      fprintf(stderr, "cupti_meter: %s\n", g_error.c_str());
      write_out(true);
      return;
    }
    if (const char* ctx = getenv("FRACGPU_CUPTI_CTX_SWITCH"); ctx != nullptr && strcmp(ctx, "1") == 0) {
      // Kernel records go on whatever CUPTI says to these.
      g_ctx_switch_asked = true;
      uint32_t version = 0;
      cuptiGetVersion(&version);
      CUptiResult c = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONTEXT);
      if (c == CUPTI_SUCCESS) c = cuptiActivityEnable(kCtxSwitchKind);
      if (c != CUPTI_SUCCESS) {
        g_ctx_switch_error = std::string("CUPTI (API version ") + std::to_string(version) +
                             ") refused the context-switch records: " + cupti_error(c);
        fprintf(stderr, "cupti_meter: %s\n", g_ctx_switch_error.c_str());
      }
    }
    atexit(at_exit);
    std::thread(flusher).detach();
    write_out(false);
  });
  return 1;
}

// simnvml: a stand-in libnvidia-ml.so.1 for tests (see README.md).
//
// It shows the simulated driver's GPUs (tests/simcuda) through NVML: it is
// built with the sim's own state code (state.cpp), so it maps the same
// SIMCUDA_STATE file the sim's processes use and reads the same devices and
// per-process memory, with dead processes swept the same way. It never calls
// cuInit, so a process using NVML is not itself a GPU process.
//
// Faults are read from the file named by SIMNVML_FAULTS on every call, so a
// test can flip them (rename a new file into place) while a daemon runs.
#include <strings.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "sim_internal.h"

#pragma GCC visibility push(default)
#include "fracgpu/nvml_abi.h"
#pragma GCC visibility pop

namespace {

using simcuda::kMaxDevices;

// One handle per device: nvmlDevice_t points at its entry.
struct nvmlDeviceEntry {
  unsigned index;
};
nvmlDeviceEntry g_handles[kMaxDevices] = {{0},  {1},  {2},  {3},  {4},  {5},  {6},  {7},
                                          {8},  {9},  {10}, {11}, {12}, {13}, {14}, {15}};

std::mutex g_mu;  // init count and event sets
int g_init_count = 0;

struct Faults {
  bool init_fail = false;
  bool lost[kMaxDevices] = {};
  bool no_temperature[kMaxDevices] = {};
  bool no_power[kMaxDevices] = {};
  bool memory_not_available[kMaxDevices] = {};
  unsigned long long device_samples_scale[kMaxDevices] = {};  // 0: as measured (whole percent)
  // nvmlDeviceGetUtilizationRates' figures, percent + 1 (0: as measured).
  unsigned long long utilization_gpu[kMaxDevices] = {};
  unsigned long long utilization_memory[kMaxDevices] = {};
  unsigned long long ecc[kMaxDevices] = {};
  std::vector<unsigned long long> xids[kMaxDevices];  // in file order
};

std::string uuid_text(int dev) {
  const unsigned char* u = simcuda::S()->devices[dev].uuid;
  char buf[64];
  std::snprintf(buf, sizeof buf, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return buf;
}

int device_count() { return simcuda::S() == nullptr ? 0 : static_cast<int>(simcuda::S()->device_count); }

// "<gpu> <fault>[=<value>]" per line, gpu an index or a UUID; "init_fail"
// alone. Unknown lines are reported once on stderr and ignored.
Faults read_faults() {
  Faults f;
  const char* path = std::getenv("SIMNVML_FAULTS");
  if (path == nullptr || *path == 0) return f;
  std::ifstream in(path);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string gpu, fault;
    if (!(words >> gpu)) continue;
    if (gpu == "init_fail") {
      f.init_fail = true;
      continue;
    }
    words >> fault;
    int dev = -1;
    for (int d = 0; d < device_count(); ++d)
      if (gpu == std::to_string(d) || gpu == uuid_text(d)) dev = d;
    std::string value;
    if (auto eq = fault.find('='); eq != std::string::npos) {
      value = fault.substr(eq + 1);
      fault.resize(eq);
    }
    const unsigned long long number = std::strtoull(value.c_str(), nullptr, 10);
    if (dev < 0 || fault.empty()) {
      std::fprintf(stderr, "simnvml: %s:%d: ignored (unknown GPU or no fault): %s\n", path, lineno, line.c_str());
      continue;
    }
    if (fault == "lost") f.lost[dev] = true;
    else if (fault == "no_temperature") f.no_temperature[dev] = true;
    else if (fault == "no_power") f.no_power[dev] = true;
    else if (fault == "memory_not_available") f.memory_not_available[dev] = true;
    else if (fault == "device_samples_scale") f.device_samples_scale[dev] = number;
    else if (fault == "utilization_gpu") f.utilization_gpu[dev] = number + 1;
    else if (fault == "utilization_memory") f.utilization_memory[dev] = number + 1;
    else if (fault == "ecc") f.ecc[dev] = number;
    else if (fault == "xid") f.xids[dev].push_back(number);
    else std::fprintf(stderr, "simnvml: %s:%d: unknown fault '%s'\n", path, lineno, fault.c_str());
  }
  return f;
}

bool initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_init_count > 0;
}

// Common checks of every per-device query; fills *dev.
nvmlReturn_t device_of(nvmlDevice_t handle, int* dev, const Faults& faults) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (handle == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  auto* e = reinterpret_cast<nvmlDeviceEntry*>(handle);
  if (e < g_handles || e >= g_handles + kMaxDevices || static_cast<int>(e->index) >= device_count())
    return NVML_ERROR_INVALID_ARGUMENT;
  *dev = static_cast<int>(e->index);
  return faults.lost[*dev] ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

nvmlReturn_t copy_string(const std::string& s, char* out, unsigned int length) {
  if (out == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (s.size() + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  std::memcpy(out, s.c_str(), s.size() + 1);
  return NVML_SUCCESS;
}

// Field 22 of /proc/<pid>/stat (start time, clock ticks after boot); 0 if gone.
unsigned long long start_time_of(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i)
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  return 0;
}

// The PID as the caller's namespace numbers the process. The sim's processes
// record their own getpid(), which inside a PID namespace (a container) is
// that namespace's number; the real driver reports the PID of the caller's
// namespace (the host's, for a daemon run as documented). The same process
// is the one that started at the same time and whose innermost PID
// (NSpid's last field) is the recorded one. Unknown: 0.
unsigned find_caller_pid(int32_t recorded, unsigned long long start_time) {
  if (start_time_of(std::to_string(recorded)) == start_time) return static_cast<unsigned>(recorded);
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (start_time_of(name) != start_time) continue;
    std::ifstream status("/proc/" + name + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("NSpid:", 0) != 0) continue;
      const size_t last = line.find_last_of(" \t");
      if (last != std::string::npos && std::atoi(line.c_str() + last + 1) == recorded)
        return static_cast<unsigned>(std::atoi(name.c_str()));
    }
  }
  return 0;
}

// A process's PID as the caller numbers it does not change while it lives,
// and (recorded PID, start time) names one process: each is looked up in
// /proc once. (Without this the stand-in's reads of /proc, once per listed
// process and call, were most of the CPU time of a daemon watching 200
// processes: a cost of the stand-in, not of the real NVML, which asks the
// kernel driver.) Not found: the recorded PID, looked up again next time.
unsigned caller_pid(int32_t recorded, unsigned long long start_time) {
  static std::mutex mutex;
  static std::map<std::pair<int32_t, unsigned long long>, unsigned> found;
  {
    std::lock_guard lock(mutex);
    if (auto it = found.find({recorded, start_time}); it != found.end()) return it->second;
  }
  const unsigned pid = find_caller_pid(recorded, start_time);
  if (pid == 0) return static_cast<unsigned>(recorded);
  std::lock_guard lock(mutex);
  if (found.size() >= 4096) found.clear();  // mostly processes long gone
  found[{recorded, start_time}] = pid;
  return pid;
}

// Live processes holding memory on the device, with their bytes. Sweeps dead
// processes first (as every reader of the sim's state does).
std::vector<std::pair<unsigned, unsigned long long>> processes(int dev) {
  struct Seen {
    int32_t pid;
    unsigned long long start_time, used;
  };
  std::vector<Seen> seen;
  {
    simcuda::Guard guard;
    simcuda::StateLock lock;
    for (auto& slot : simcuda::S()->slots) {
      if (slot.state.load(std::memory_order_acquire) != simcuda::kSlotLive) continue;
      const uint64_t used = slot.used[dev].load(std::memory_order_relaxed);
      if (used > 0)
        seen.push_back({slot.pid.load(std::memory_order_relaxed), slot.start_time.load(std::memory_order_relaxed), used});
    }
  }
  // Outside the state lock: naming a process may take a scan of /proc.
  std::vector<std::pair<unsigned, unsigned long long>> out;
  for (const Seen& p : seen) out.emplace_back(caller_pid(p.pid, p.start_time), p.used);
  return out;
}

// What every per-process call starts with: *count in = the caller's
// capacity (to *capacity), out = the device's processes (to *list).
nvmlReturn_t process_list(nvmlDevice_t device, unsigned int* count, unsigned* capacity,
                          std::vector<std::pair<unsigned, unsigned long long>>* list) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *list = processes(dev);
  if (faults.memory_not_available[dev])
    for (auto& [pid, used] : *list) used = NVML_VALUE_NOT_AVAILABLE;
  *capacity = *count;
  *count = static_cast<unsigned>(list->size());
  return NVML_SUCCESS;
}

template <typename Info>
nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int* count, Info* infos) {
  std::vector<std::pair<unsigned, unsigned long long>> list;
  unsigned capacity = 0;
  if (nvmlReturn_t rc = process_list(device, count, &capacity, &list)) return rc;
  if (list.size() > capacity) return NVML_ERROR_INSUFFICIENT_SIZE;
  if (!list.empty() && infos == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (size_t i = 0; i < list.size(); ++i) {
    Info info{};
    info.pid = list[i].first;
    info.usedGpuMemory = list[i].second;
    if constexpr (requires { info.gpuInstanceId; }) {
      info.gpuInstanceId = 0xFFFFFFFFu;  // no MIG: NVML reports "invalid"
      info.computeInstanceId = 0xFFFFFFFFu;
    }
    infos[i] = info;
  }
  return NVML_SUCCESS;
}

// Kernel time of the recorded PID `pid` on device `dev` within (from, to]
// (CLOCK_MONOTONIC ns), from the sim's kernel log: the records of one device
// lie on one serial timeline, so a backwards scan stops once a run of
// records ended before `from`. Records already overwritten are lost (the
// ring holds kKernelLogEntries), as a real sampler loses old periods.
uint64_t kernel_time(int dev, int32_t pid, uint64_t from, uint64_t to) {
  simcuda::advance_device(dev);  // the time-slice model records residency as it runs forward
  const simcuda::KernelLog& log = simcuda::S()->kernel_logs[dev];
  const uint64_t next = log.next.load(std::memory_order_acquire);
  const uint64_t oldest = next > simcuda::kKernelLogEntries ? next - simcuda::kKernelLogEntries : 0;
  uint64_t busy = 0;
  int before = 0;  // consecutive records that ended by `from`
  for (uint64_t index = next; index > oldest && before < 64;) {
    --index;
    const simcuda::KernelRecord& rec = log.records[index % simcuda::kKernelLogEntries];
    if (rec.seq.load(std::memory_order_acquire) != index + 1) continue;
    const uint64_t start = rec.start.load(std::memory_order_relaxed), end = rec.end.load(std::memory_order_relaxed);
    const int32_t owner = rec.pid.load(std::memory_order_relaxed);
    if (rec.seq.load(std::memory_order_acquire) != index + 1) continue;
    if (end <= from) {
      ++before;
      continue;
    }
    before = 0;
    if (owner != pid) continue;
    const uint64_t a = std::max(start, from), b = std::min(end, to);
    if (b > a) busy += b - a;
  }
  return busy;
}

// Per-process utilization samples: one per process holding memory on the
// device, stamped now (CLOCK_REALTIME, us), covering the period since
// `last_seen` (at most the last second; the whole second when last_seen is
// 0 or older). smUtil is *measured*: the share of that period in which the
// sim's device ran the process's kernels (its kernel log), rounded to the
// nearest percent as NVML reports it; memUtil is a made-up 10. No process
// at all: NVML_ERROR_NOT_FOUND, NVML's "no samples".
template <typename Sample>
nvmlReturn_t utilization_samples(nvmlDevice_t device, unsigned int* count, Sample* samples,
                                 unsigned long long last_seen) {
  std::vector<std::pair<unsigned, unsigned long long>> list;
  unsigned capacity = 0;
  if (nvmlReturn_t rc = process_list(device, count, &capacity, &list)) return rc;
  if (list.empty()) return NVML_ERROR_NOT_FOUND;
  if (list.size() > capacity || samples == nullptr) return NVML_ERROR_INSUFFICIENT_SIZE;
  int dev = 0;
  device_of(device, &dev, Faults{});
  timespec real{}, mono{};
  clock_gettime(CLOCK_REALTIME, &real);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  const uint64_t real_us = static_cast<uint64_t>(real.tv_sec) * 1000000ull + static_cast<uint64_t>(real.tv_nsec) / 1000;
  const uint64_t to = static_cast<uint64_t>(mono.tv_sec) * 1000000000ull + static_cast<uint64_t>(mono.tv_nsec);
  const uint64_t age_ns = last_seen != 0 && last_seen < real_us ? (real_us - last_seen) * 1000 : UINT64_MAX;
  const uint64_t window = std::min<uint64_t>(age_ns, 1000000000ull);
  const uint64_t from = to > window ? to - window : 0;
  // The kernel log names a process by its own PID: a process in another PID
  // namespace than this caller's reads as idle here (a limit of the stand-in).
  for (size_t i = 0; i < list.size(); ++i) {
    Sample sample{};
    sample.pid = list[i].first;
    sample.timeStamp = real_us;
    const uint64_t busy = to > from ? kernel_time(dev, static_cast<int32_t>(list[i].first), from, to) : 0;
    sample.smUtil = to > from ? static_cast<unsigned>(std::min<uint64_t>((busy * 100 + (to - from) / 2) / (to - from), 100))
                              : 0;
    sample.memUtil = 10;
    samples[i] = sample;
  }
  return NVML_SUCCESS;
}

// ---------------------------------------------------------------------------
// Realistic sampling (SIMNVML_SAMPLE_MS > 0): the driver's sample ring, see
// README.md "Realistic sampling" and the facts it cites. Both knobs are read
// on every call (one getenv each), so a test may change them between calls.
// ---------------------------------------------------------------------------

// NV2080_CTRL_PERF_GPUMON_SAMPLE_COUNT_PERFMON_UTIL: the driver's ring depth,
// and the count real NVML asks for (its size queries answer 72).
constexpr unsigned kRingSamples = 72;
// Longest period accepted: a sample must fit in the sim's bin ring.
constexpr uint64_t kMaxSampleMs = simcuda::kSampleBins / 2;
// nvmlDeviceGetSamples's period when SIMNVML_SAMPLE_MS is unset or 0.
constexpr uint64_t kExactModeDeviceSampleMs = 2;

enum class Attribution { kInstant, kLast };

struct SamplingMode {
  uint64_t period_ms = 0;  // 0: exact mode (no sampling)
  Attribution attribution = Attribution::kInstant;
};

std::atomic<bool> g_warned_period{false}, g_warned_attrib{false};

SamplingMode sampling_mode() {
  SamplingMode mode;
  if (const char* v = std::getenv("SIMNVML_SAMPLE_MS"); v != nullptr && *v != 0) {
    char* end = nullptr;
    const unsigned long long ms = std::strtoull(v, &end, 10);
    if (end == v || *end != 0) {
      if (!g_warned_period.exchange(true))
        std::fprintf(stderr, "simnvml: SIMNVML_SAMPLE_MS=%s is not a number of ms; sampling is off\n", v);
    } else if (ms > kMaxSampleMs) {
      if (!g_warned_period.exchange(true))
        std::fprintf(stderr, "simnvml: SIMNVML_SAMPLE_MS=%s capped at %llu\n", v,
                     static_cast<unsigned long long>(kMaxSampleMs));
      mode.period_ms = kMaxSampleMs;
    } else {
      mode.period_ms = ms;
    }
  }
  if (const char* v = std::getenv("SIMNVML_ATTRIB"); v != nullptr && *v != 0) {
    if (std::strcmp(v, "last") == 0) mode.attribution = Attribution::kLast;
    else if (std::strcmp(v, "instant") != 0 && !g_warned_attrib.exchange(true))
      std::fprintf(stderr, "simnvml: SIMNVML_ATTRIB=%s unknown (instant or last); using instant\n", v);
  }
  return mode;
}

// One sample of the device's ring: taken at T = k * period ms of
// CLOCK_MONOTONIC, covering [T - period, T).
struct RingSample {
  unsigned long long stamp_us;  // T as CPU time (CLOCK_REALTIME, us)
  unsigned busy_pct;            // floor(busy ns * 100 / period ns)
  bool named;                   // a process is named
  int32_t pid;                  // the recorded PID it names
};

// The device's ring as every reader sees it: a pure function of the sim's
// bins and the clock. Sample k exists once T_k <= now_ms - 1 (settled; the
// 1 ms lets writers in flight finish); the ring is the newest kRingSamples
// of them whose bins are all still in the bin ring (not older than
// kSampleBins ms, and the slot not reused by a newer bin). Oldest first.
// Only those stamped after `newer_than_us` are computed (what a call with
// that lastSeenTimeStamp asks for): polled every few ms, that is one or none.
std::vector<RingSample> ring_samples(int dev, uint64_t period_ms, Attribution attribution,
                                     unsigned long long newer_than_us) {
  using simcuda::kBinNs;
  using simcuda::kSampleBins;
  simcuda::advance_device(dev);  // the time-slice model fills the bins as it runs forward
  const simcuda::SampleBins& b = simcuda::S()->sample_bins[dev];
  const uint64_t offset_us = simcuda::S()->realtime_offset_us.load(std::memory_order_relaxed);
  const uint64_t now_ms = simcuda::now_ns() / kBinNs;
  std::vector<RingSample> out;
  if (period_ms == 0 || now_ms < 1) return out;
  const auto busy_of = [&](uint64_t m, bool* gone) -> uint64_t {
    const uint64_t w = b.busy[m % kSampleBins].load(std::memory_order_acquire);
    const uint64_t tag = w >> simcuda::kBusyNsBits;
    if (tag > (m & simcuda::kBusyTagMask)) *gone = true;
    return tag == (m & simcuda::kBusyTagMask) ? w & ((1ull << simcuda::kBusyNsBits) - 1) : 0;
  };
  for (uint64_t k = (now_ms - 1) / period_ms; k >= 1 && out.size() < kRingSamples; --k) {
    const uint64_t t = k * period_ms;
    if (t - period_ms + kSampleBins <= now_ms) break;  // its oldest bin has left the ring
    if (t * 1000 + offset_us <= newer_than_us) break;    // older ones are older still
    bool gone = false;
    uint64_t busy = 0;
    for (uint64_t m = t - period_ms; m < t; ++m) busy += busy_of(m, &gone);
    busy_of(t, &gone);  // the instant's bin
    if (gone) break;
    RingSample sample{t * 1000 + offset_us, static_cast<unsigned>(busy * 100 / (period_ms * kBinNs)), false, 0};
    if (attribution == Attribution::kInstant) {
      // The process resident on the engine at the sampling instant.
      const uint64_t w = b.instant[t % kSampleBins].load(std::memory_order_acquire);
      if (w >> 32 == static_cast<uint32_t>(t)) {
        sample.named = true;
        sample.pid = static_cast<int32_t>(static_cast<uint32_t>(w));
      }
    } else {
      // The process whose kernel ended last in the period (or still runs).
      for (uint64_t m = t; m-- > t - period_ms;) {
        const uint64_t w = b.last[m % kSampleBins].load(std::memory_order_acquire);
        if (w >> (simcuda::kLastOffsetBits + simcuda::kLastPidBits) != (m & simcuda::kLastTagMask)) continue;
        sample.named = true;
        sample.pid = static_cast<int32_t>(w & ((1ull << simcuda::kLastPidBits) - 1));
        break;
      }
    }
    out.push_back(sample);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

// A recorded PID as the caller's namespace numbers it: through the live slot
// that recorded it; a PID with no live slot as recorded (the ring outlives
// processes).
std::vector<unsigned> caller_pids(const std::vector<int32_t>& recorded) {
  std::vector<std::pair<int32_t, unsigned long long>> live;
  {
    simcuda::Guard guard;
    simcuda::StateLock lock;
    for (auto& slot : simcuda::S()->slots)
      if (slot.state.load(std::memory_order_acquire) == simcuda::kSlotLive)
        live.emplace_back(slot.pid.load(std::memory_order_relaxed), slot.start_time.load(std::memory_order_relaxed));
  }
  std::vector<unsigned> out;
  for (int32_t pid : recorded) {
    unsigned mapped = static_cast<unsigned>(pid);
    for (const auto& [live_pid, start_time] : live)
      if (live_pid == pid) mapped = caller_pid(pid, start_time);
    out.push_back(mapped);
  }
  return out;
}

struct ProcessRecord {
  unsigned pid;
  unsigned long long stamp_us;
  unsigned sm_util;
};

// NVML's aggregation of the ring samples newer than `last_seen`: N = the
// samples naming any process; per named process, smUtil = floor(sum of the
// busy% of the samples naming it / N), stamped with its newest such sample.
std::vector<ProcessRecord> sampled_processes(int dev, const SamplingMode& mode, unsigned long long last_seen) {
  struct Acc {
    int32_t pid;
    unsigned long long sum, stamp;
  };
  std::vector<Acc> acc;
  unsigned long long named = 0;
  for (const RingSample& s : ring_samples(dev, mode.period_ms, mode.attribution, last_seen)) {
    if (s.stamp_us <= last_seen || !s.named) continue;
    ++named;
    auto it = std::find_if(acc.begin(), acc.end(), [&](const Acc& a) { return a.pid == s.pid; });
    if (it == acc.end()) it = acc.insert(acc.end(), Acc{s.pid, 0, 0});
    it->sum += s.busy_pct;
    it->stamp = s.stamp_us;
  }
  std::vector<int32_t> recorded;
  for (const Acc& a : acc) recorded.push_back(a.pid);
  const std::vector<unsigned> pids = caller_pids(recorded);
  std::vector<ProcessRecord> out;
  for (size_t i = 0; i < acc.size(); ++i)
    out.push_back({pids[i], acc[i].stamp, static_cast<unsigned>(acc[i].sum / named)});
  return out;
}

// The per-process calls in realistic mode. `info_call`: the R550+ call,
// which demands room for the whole ring (72 entries) before anything else.
template <typename Sample>
nvmlReturn_t sampled_utilization(nvmlDevice_t device, unsigned int* count, Sample* samples,
                                 unsigned long long last_seen, const SamplingMode& mode, bool info_call) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (info_call && (samples == nullptr || *count < kRingSamples)) {
    *count = kRingSamples;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  if (samples == nullptr) {  // size query: the ring's depth
    *count = kRingSamples;
    return NVML_SUCCESS;
  }
  const std::vector<ProcessRecord> records = sampled_processes(dev, mode, last_seen);
  if (records.empty()) {
    *count = 0;
    return NVML_ERROR_NOT_FOUND;
  }
  const unsigned capacity = *count;
  *count = static_cast<unsigned>(records.size());
  if (records.size() > capacity) return NVML_ERROR_INSUFFICIENT_SIZE;
  for (size_t i = 0; i < records.size(); ++i) {
    Sample sample{};
    sample.pid = records[i].pid;
    sample.timeStamp = records[i].stamp_us;
    sample.smUtil = records[i].sm_util;
    samples[i] = sample;
  }
  return NVML_SUCCESS;
}

nvmlReturn_t memory(nvmlDevice_t device, unsigned long long* total, unsigned long long* used) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  simcuda::Guard guard;
  simcuda::StateLock lock;
  *total = simcuda::S()->devices[dev].capacity;
  *used = std::min<unsigned long long>(simcuda::sum_live_locked(dev), *total);
  return NVML_SUCCESS;
}

// Event sets: Xid events are the fault file's "xid" lines, delivered in order
// once each per set (counted from the set's registration).
struct EventSet {
  bool registered[kMaxDevices] = {};
  size_t delivered[kMaxDevices] = {};
};

}  // namespace

extern "C" {

nvmlReturn_t nvmlInit_v2(void) {
  {
    simcuda::Guard guard;
    if (!simcuda::attach()) return NVML_ERROR_DRIVER_NOT_LOADED;  // bad SIMCUDA_DEVICES / state (the sim logged why)
  }
  if (read_faults().init_fail) return NVML_ERROR_DRIVER_NOT_LOADED;
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_init_count;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_init_count == 0) return NVML_ERROR_UNINITIALIZED;
  --g_init_count;
  return NVML_SUCCESS;
}

const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
  }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  return copy_string("simnvml", version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *count = static_cast<unsigned>(device_count());
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (device == nullptr || static_cast<int>(index) >= device_count()) return NVML_ERROR_INVALID_ARGUMENT;
  *device = reinterpret_cast<nvmlDevice_t>(&g_handles[index]);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (uuid == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (int d = 0; d < device_count(); ++d) {
    if (uuid_text(d) == uuid) {
      *device = reinterpret_cast<nvmlDevice_t>(&g_handles[d]);
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, nvmlDevice_t* device) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (bus_id == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (int d = 0; d < device_count(); ++d) {
    char text[32];
    std::snprintf(text, sizeof text, "0000:%02x:00.0", simcuda::S()->devices[d].pci_bus);
    if (strcasecmp(text, bus_id) == 0) {
      *device = reinterpret_cast<nvmlDevice_t>(&g_handles[d]);
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int* index) {
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, read_faults())) return rc;
  if (index == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *index = static_cast<unsigned>(dev);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, read_faults())) return rc;
  return copy_string(uuid_text(dev), uuid, length);
}

// Topology: every simulated GPU sits on one system bus, so each is at
// NVML_TOPOLOGY_SYSTEM from the others and near every CPU. The convention
// NVML documents: *count 0 asks how many; else up to *count handles.
namespace {
nvmlReturn_t device_set(int exclude, unsigned int* count, nvmlDevice_t* devices) {
  if (count == nullptr || (*count != 0 && devices == nullptr)) return NVML_ERROR_INVALID_ARGUMENT;
  unsigned n = 0;
  for (int d = 0; d < device_count(); ++d) {
    if (d == exclude) continue;
    if (*count != 0 && n < *count) devices[n] = reinterpret_cast<nvmlDevice_t>(&g_handles[d]);
    ++n;
  }
  *count = *count == 0 ? n : std::min(n, *count);
  return NVML_SUCCESS;
}
}  // namespace

nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level, unsigned int* count,
                                              nvmlDevice_t* devices) {
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, read_faults())) return rc;
  if (level < NVML_TOPOLOGY_SYSTEM) {  // nothing nearer than the system bus
    if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
  }
  return device_set(dev, count, devices);
}

nvmlReturn_t nvmlSystemGetTopologyGpuSet(unsigned int /*cpuNumber*/, unsigned int* count, nvmlDevice_t* devices) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  return device_set(-1, count, devices);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, read_faults())) return rc;
  return copy_string(simcuda::S()->devices[dev].name, name, length);
}

// The device's compute capability, except on the queue model: that models a
// GPU without compute preemption, whose contexts' work runs first come,
// first served (before Pascal, 6.0), so it reports a Maxwell's 5.2 and the
// daemon does not rely on the driver's time slices there (docs/sm-time.md).
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int* major, int* minor) {
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, read_faults())) return rc;
  if (major == nullptr || minor == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  const bool preempts = simcuda::timeslice_model();
  *major = preempts ? static_cast<int>(simcuda::S()->devices[dev].cc_major) : 5;
  *minor = preempts ? static_cast<int>(simcuda::S()->devices[dev].cc_minor) : 2;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* mem) {
  if (mem == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  unsigned long long total = 0, used = 0;
  if (nvmlReturn_t rc = memory(device, &total, &used)) return rc;
  mem->total = total;
  mem->used = used;
  mem->free = total - used;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* mem) {
  if (mem == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (mem->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  unsigned long long total = 0, used = 0;
  if (nvmlReturn_t rc = memory(device, &total, &used)) return rc;
  mem->total = total;
  mem->reserved = 0;
  mem->used = used;
  mem->free = total - used;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int* count,
                                                  nvmlProcessInfo_v1_t* infos) {
  return running_processes(device, count, infos);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* count,
                                                     nvmlProcessInfo_v2_t* infos) {
  return running_processes(device, count, infos);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* count,
                                                     nvmlProcessInfo_t* infos) {
  return running_processes(device, count, infos);
}

nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t* plist) {
  if (plist == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  if (plist->mode == NVML_PROCESS_MODE_COMPUTE)
    return running_processes(device, &plist->numProcArrayEntries, plist->procArray);
  if (plist->mode > NVML_PROCESS_MODE_MPS) return NVML_ERROR_INVALID_ARGUMENT;
  // Graphics and MPS: the sim has neither kind of process.
  unsigned none = 0;
  if (nvmlReturn_t rc = running_processes(device, &none, plist->procArray)) return rc;
  plist->numProcArrayEntries = 0;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t* utilization,
                                             unsigned int* count, unsigned long long lastSeenTimeStamp) {
  if (const SamplingMode mode = sampling_mode(); mode.period_ms > 0)
    return sampled_utilization(device, count, utilization, lastSeenTimeStamp, mode, false);
  return utilization_samples(device, count, utilization, lastSeenTimeStamp);
}

nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device, nvmlProcessesUtilizationInfo_t* info) {
  if (info == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (info->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  if (const SamplingMode mode = sampling_mode(); mode.period_ms > 0)
    return sampled_utilization(device, &info->processSamplesCount, info->procUtilArray, info->lastSeenTimeStamp, mode,
                               true);
  return utilization_samples(device, &info->processSamplesCount, info->procUtilArray, info->lastSeenTimeStamp);
}

// The device's GPU-utilization ring: the samples newer than lastSeen that
// are not 0 % (the ring runs dry while the GPU idles), oldest first. In
// exact mode (SIMNVML_SAMPLE_MS unset or 0) with a 2 ms period.
nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, nvmlSamplingType_t type, unsigned long long lastSeenTimeStamp,
                                  nvmlValueType_t* sampleValType, unsigned int* sampleCount, nvmlSample_t* samples) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (type != NVML_GPU_UTILIZATION_SAMPLES) return NVML_ERROR_NOT_SUPPORTED;
  if (sampleValType == nullptr || sampleCount == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
  if (samples == nullptr) {  // size query: the ring's depth
    *sampleCount = kRingSamples;
    return NVML_SUCCESS;
  }
  SamplingMode mode = sampling_mode();
  if (mode.period_ms == 0) mode.period_ms = kExactModeDeviceSampleMs;
  std::vector<RingSample> ring = ring_samples(dev, mode.period_ms, mode.attribution, lastSeenTimeStamp);
  std::erase_if(ring, [&](const RingSample& s) { return s.stamp_us <= lastSeenTimeStamp || s.busy_pct == 0; });
  if (ring.empty()) {
    *sampleCount = 0;
    return NVML_ERROR_NOT_FOUND;
  }
  const unsigned capacity = *sampleCount;
  *sampleCount = static_cast<unsigned>(ring.size());
  if (ring.size() > capacity) return NVML_ERROR_INSUFFICIENT_SIZE;
  for (size_t i = 0; i < ring.size(); ++i) {
    samples[i] = nvmlSample_t{};
    samples[i].timeStamp = ring[i].stamp_us;
    samples[i].sampleValue.uiVal =
        ring[i].busy_pct * static_cast<unsigned>(faults.device_samples_scale[dev] != 0 ? faults.device_samples_scale[dev] : 1);
  }
  return NVML_SUCCESS;
}

// The device's busy percent over the newest settled sampling period (the
// ring's period; 1 s in exact mode, NVML's longest), and a memory figure.
// The sim has no memory traffic: it reports half the busy percent, so the
// figure follows the load without claiming to model it.
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t* utilization) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (utilization == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  SamplingMode mode = sampling_mode();
  if (mode.period_ms == 0) mode.period_ms = std::min<uint64_t>(1000, kMaxSampleMs);
  // Only the newest one or two samples: those stamped in the last two periods.
  struct timespec real {};
  clock_gettime(CLOCK_REALTIME, &real);
  const unsigned long long now_us =
      static_cast<unsigned long long>(real.tv_sec) * 1'000'000ull + static_cast<unsigned long long>(real.tv_nsec) / 1000;
  const std::vector<RingSample> ring = ring_samples(dev, mode.period_ms, mode.attribution, now_us - 2 * mode.period_ms * 1000);
  const unsigned busy = ring.empty() ? 0 : std::min(ring.back().busy_pct, 100u);
  utilization->gpu = faults.utilization_gpu[dev] != 0 ? static_cast<unsigned>(faults.utilization_gpu[dev] - 1) : busy;
  utilization->memory =
      faults.utilization_memory[dev] != 0 ? static_cast<unsigned>(faults.utilization_memory[dev] - 1) : busy / 2;
  return NVML_SUCCESS;
}

// Accounting, as if accounting mode were on: a record for every live sim
// process on the device, its memory as the maximum it used.
nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t device, unsigned int* count, unsigned int* pids) {
  std::vector<std::pair<unsigned, unsigned long long>> list;
  unsigned capacity = 0;
  if (nvmlReturn_t rc = process_list(device, count, &capacity, &list)) return rc;
  if (list.size() > capacity || (!list.empty() && pids == nullptr)) return NVML_ERROR_INSUFFICIENT_SIZE;
  for (size_t i = 0; i < list.size(); ++i) pids[i] = list[i].first;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t device, unsigned int pid, nvmlAccountingStats_t* stats) {
  unsigned count = 0;
  unsigned capacity = 0;
  std::vector<std::pair<unsigned, unsigned long long>> list;
  if (nvmlReturn_t rc = process_list(device, &count, &capacity, &list)) return rc;
  if (stats == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (const auto& [listed, bytes] : list) {
    if (listed != pid) continue;
    *stats = nvmlAccountingStats_t{};
    stats->maxMemoryUsage = bytes;
    stats->isRunning = 1;
    return NVML_SUCCESS;
  }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensor, unsigned int* temp) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (sensor != NVML_TEMPERATURE_GPU || temp == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (faults.no_temperature[dev]) return NVML_ERROR_UNKNOWN;
  *temp = 40 + static_cast<unsigned>(dev);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int* power) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (power == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (faults.no_power[dev]) return NVML_ERROR_UNKNOWN;
  *power = 100000;  // 100 W
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t type, nvmlEccCounterType_t,
                                         unsigned long long* count) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *count = type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? faults.ecc[dev] : 0;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t* set) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (set == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *set = reinterpret_cast<nvmlEventSet_t>(new EventSet());
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
  const Faults faults = read_faults();
  int dev = 0;
  if (nvmlReturn_t rc = device_of(device, &dev, faults)) return rc;
  if (set == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if ((types & ~static_cast<unsigned long long>(nvmlEventTypeXidCriticalError)) != 0) return NVML_ERROR_NOT_SUPPORTED;
  auto* s = reinterpret_cast<EventSet*>(set);
  std::lock_guard<std::mutex> lock(g_mu);
  s->registered[dev] = true;
  s->delivered[dev] = faults.xids[dev].size();  // only Xids that happen from now on
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t* data, unsigned int timeoutms) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (set == nullptr || data == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  auto* s = reinterpret_cast<EventSet*>(set);
  timespec start{};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    const Faults faults = read_faults();
    {
      std::lock_guard<std::mutex> lock(g_mu);
      for (int d = 0; d < device_count(); ++d) {
        if (!s->registered[d] || s->delivered[d] >= faults.xids[d].size()) continue;
        *data = nvmlEventData_t{};
        data->device = reinterpret_cast<nvmlDevice_t>(&g_handles[d]);
        data->eventType = nvmlEventTypeXidCriticalError;
        data->eventData = faults.xids[d][s->delivered[d]++];
        data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
        return NVML_SUCCESS;
      }
    }
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const long long waited_ms = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000;
    if (waited_ms >= timeoutms) return NVML_ERROR_TIMEOUT;
    timespec step{0, 10 * 1000 * 1000};
    nanosleep(&step, nullptr);
  }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
  delete reinterpret_cast<EventSet*>(set);
  return NVML_SUCCESS;
}

}  // extern "C"

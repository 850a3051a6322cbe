// nvml_sampler: NVML's raw per-process utilization samples, polled fast, for
// calibrating what fracgpu (and the stand-in NVML of the tests) assume about
// them (docs/gpu-results.md, "Calibrating the stand-in NVML").
//
//   nvml_sampler --gpu INDEX|UUID [--interval-ms 2] [--seconds 20] [--out FILE]
//                [--start-file F | --start-ns NS] [--calls pu,pui,gs] [--lib PATH]
//
// Loads libnvidia-ml.so.1 (or --lib) with dlopen and calls it through typed
// pointers: nothing links against NVML. Every --interval-ms (CLOCK_MONOTONIC
// slots; a slot missed because a call ran long is skipped and counted) from
// the start (--start-ns / the CLOCK_MONOTONIC ns in --start-file once it
// exists / now) for --seconds it calls
//   pu   nvmlDeviceGetProcessUtilization with lastSeenTimeStamp = the newest
//        record stamp it has seen (0 until the first answer);
//   pui  nvmlDeviceGetProcessesUtilizationInfo (R550+; only if the library
//        exports it), a nvmlProcessesUtilizationInfo_v1 with its own lastSeen;
//   gs   nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) (device-wide, no
//        PIDs) with its own lastSeen
// and writes one JSON line per poll to --out (default stdout):
//   {"poll": i, "mono_ns": ..., "real_us": ...,
//    "pu":  {"rc": 6, "us": 41.2, "last_seen": T, "records": [{"pid", "ts", "sm", "mem"}...]},
//    "pui": {...same...}, "gs": {"rc", "us", "last_seen", "value_type", "records": [{"ts", "v"}...]}}
// after a {"header": {...}} line, and last a {"summary": {...}} line:
//   polls, their achieved gaps and window_s (the time polled, the
//   denominator of every fraction); per call: return codes, the NOT_FOUND
//   fraction, call time, the distinct sample stamps seen and the gaps between
//   consecutive ones (period_ms, min/median/max: the sampling period), how
//   many PIDs each new sample named (all / with smUtil > 0), and per PID the
//   integrated estimate sum(smUtil/100 x period covered) in seconds. An
//   answer covers newest stamp - the lastSeen passed (what NVML averaged
//   over), but at most the median period per distinct stamp in it (or the
//   time from the previous call to this one's return, where longer): a
//   longer gap holds samples that named no process, which NVML leaves out of
//   the average (uncapped_s: without that cap). For gs, the device's busy
//   seconds sum(util/100 x gap to the previous sample, capped at the median
//   period). The first answer (lastSeen 0: the driver's whole ring, mostly
//   from before the start) only sets lastSeen: it is logged but neither
//   integrated nor counted, nor is the gap after it. Records not newer than
//   the lastSeen passed ("stale") or with smUtil > 100 ("garbage", seen on
//   real drivers) are logged and counted, not integrated.
// A human-readable digest of the summary goes to stderr.
//
// Exit 0; 1 when NVML or the GPU cannot be opened (the log then holds the
// header with "error" and a summary saying so); 2 on a bad argument.
//
// NVML's declarations: include/fracgpu/nvml_abi.h (the CUDA toolkit ships no
// nvml.h); built with the project (bench/gpu/CMakeLists.txt) or by
// bench/gpu/build_tools.sh on a GPU machine.
#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fracgpu/nvml_abi.h"

namespace {

double sample_value(nvmlValueType_t type, const nvmlValue_t& v) {
  switch (type) {
    case NVML_VALUE_TYPE_DOUBLE: return v.dVal;
    case NVML_VALUE_TYPE_UNSIGNED_INT: return v.uiVal;
    case NVML_VALUE_TYPE_UNSIGNED_LONG: return static_cast<double>(v.ulVal);
    case NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: return static_cast<double>(v.ullVal);
    case NVML_VALUE_TYPE_SIGNED_LONG_LONG: return static_cast<double>(v.sllVal);
    case NVML_VALUE_TYPE_SIGNED_INT: return v.siVal;
    case NVML_VALUE_TYPE_UNSIGNED_SHORT: return v.usVal;
    default: return v.uiVal;
  }
}

struct Nvml {
  void* lib = nullptr;
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlShutdown) shutdown = nullptr;
  decltype(&nvmlErrorString) error_string = nullptr;
  decltype(&nvmlSystemGetDriverVersion) driver_version = nullptr;
  decltype(&nvmlDeviceGetHandleByIndex_v2) by_index = nullptr;
  decltype(&nvmlDeviceGetHandleByUUID) by_uuid = nullptr;
  decltype(&nvmlDeviceGetUUID) uuid = nullptr;
  decltype(&nvmlDeviceGetName) name = nullptr;
  decltype(&nvmlDeviceGetProcessUtilization) process_utilization = nullptr;
  decltype(&nvmlDeviceGetProcessesUtilizationInfo) processes_utilization_info = nullptr;
  decltype(&nvmlDeviceGetSamples) get_samples = nullptr;

  template <typename F>
  void sym(F* out, const char* symbol) {
    *out = reinterpret_cast<F>(dlsym(lib, symbol));
  }
  const char* err(nvmlReturn_t rc) const {
    const char* s = error_string != nullptr ? error_string(rc) : nullptr;
    return s != nullptr ? s : "?";
  }
};

uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

uint64_t real_us() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000ull + static_cast<uint64_t>(ts.tv_nsec) / 1000;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// min/median/max of a list, as a JSON object (nulls when empty).
std::string stats_json(std::vector<double> v, int precision = 3) {
  if (v.empty()) return "{\"n\": 0, \"min\": null, \"median\": null, \"max\": null}";
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double median = n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  char buf[160];
  snprintf(buf, sizeof buf, "{\"n\": %zu, \"min\": %.*f, \"median\": %.*f, \"max\": %.*f}", n, precision, v.front(),
           precision, median, precision, v.back());
  return buf;
}

std::string stats_text(std::vector<double> v) {
  if (v.empty()) return "n/a";
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double median = n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  char buf[96];
  snprintf(buf, sizeof buf, "%.1f/%.1f/%.1f", v.front(), median, v.back());
  return buf;
}

std::string histogram_json(const std::map<unsigned, uint64_t>& h) {
  std::string out = "{";
  for (const auto& [k, n] : h) {
    if (out.size() > 1) out += ", ";
    out += "\"" + std::to_string(k) + "\": " + std::to_string(n);
  }
  return out + "}";
}

// One answer with new records, kept for the integration at the end (which
// needs the sampling period, known only then).
struct Answer {
  unsigned long long passed = 0;                       // the lastSeen of the call
  unsigned long long newest = 0;                       // its newest new stamp
  unsigned stamps = 0;                                 // distinct new stamps in it
  double poll_gap_us = 0;                              // from the previous call's start to this one's end
  std::vector<std::pair<unsigned, unsigned>> records;  // (pid, smUtil) of its new records
};

struct PidStat {
  uint64_t records = 0;   // new records naming it
  double estimate_s = 0;  // sum of smUtil/100 x the period covered (capped)
  double uncapped_s = 0;  // the same with newest - lastSeen uncapped
  double sm_sum = 0;      // for the mean smUtil of its records
};

// One polled call's statistics.
struct Source {
  std::string key, function;
  bool enabled = false, available = false;
  std::string why;  // when not available
  uint64_t calls = 0, stale = 0, garbage = 0, insufficient_retries = 0;
  std::map<int, uint64_t> rc;
  std::vector<double> call_us;
  unsigned long long last_seen = 0;     // the argument of the next call
  uint64_t prev_call_us = 0;            // CLOCK_REALTIME (us) at the previous call's start
  bool primed = false;                  // an answer has set last_seen
  unsigned long long base = 0;          // last_seen after the priming answer (the driver's backlog)
  std::set<unsigned long long> stamps;  // distinct new sample stamps after the priming answer
  std::map<unsigned, uint64_t> pids_per_sample, busy_pids_per_sample;
  std::vector<Answer> answers;                                // pu, pui
  std::vector<std::pair<unsigned long long, double>> device;  // gs: (stamp, util) of new samples
  std::vector<double> lag_ms;                                 // poll time - newest stamp of an answer with new records
};

struct Record {
  unsigned pid;
  unsigned long long ts;
  unsigned sm, mem;
};

// Takes a per-process answer: NVML averaged each PID's samples newer than
// `passed` (the lastSeen of the call) up to the answer's newest stamp.
// call_end_us: CLOCK_REALTIME (us) when the call returned.
void take_processes(Source& s, unsigned long long passed, const std::vector<Record>& recs, uint64_t call_end_us) {
  unsigned long long newest = 0;
  for (const Record& r : recs) {
    if (r.ts > passed && r.sm <= 100) newest = std::max(newest, r.ts);
    if (r.ts <= passed && s.primed) ++s.stale;
    if (r.sm > 100) ++s.garbage;
  }
  if (newest == 0) return;
  if (!s.primed) {  // the driver's backlog (lastSeen 0): sets lastSeen only
    s.primed = true;
    s.base = s.last_seen = newest;
    return;
  }
  Answer a;
  a.passed = passed;
  a.newest = newest;
  a.poll_gap_us = s.prev_call_us != 0 ? static_cast<double>(call_end_us - s.prev_call_us) : 0.0;
  std::map<unsigned long long, std::pair<unsigned, unsigned>> per_stamp;  // stamp -> (pids, busy pids)
  for (const Record& r : recs) {
    if (r.ts <= passed || r.sm > 100) continue;
    a.records.emplace_back(r.pid, r.sm);
    auto& c = per_stamp[r.ts];
    ++c.first;
    if (r.sm > 0) ++c.second;
    s.stamps.insert(r.ts);
  }
  for (const auto& [ts, c] : per_stamp) {
    ++s.pids_per_sample[c.first];
    ++s.busy_pids_per_sample[c.second];
  }
  a.stamps = static_cast<unsigned>(per_stamp.size());
  s.answers.push_back(std::move(a));
  s.last_seen = newest;
  s.lag_ms.push_back((static_cast<double>(call_end_us) - static_cast<double>(newest)) / 1000.0);
}

void take_device(Source& s, unsigned long long passed, const std::vector<std::pair<unsigned long long, double>>& recs,
                 uint64_t call_end_us) {
  std::vector<std::pair<unsigned long long, double>> fresh;
  for (const auto& r : recs) {
    if (r.first > passed)
      fresh.push_back(r);
    else if (s.primed)
      ++s.stale;
  }
  if (fresh.empty()) return;
  std::sort(fresh.begin(), fresh.end());
  if (!s.primed) {
    s.primed = true;
    s.base = s.last_seen = fresh.back().first;
    return;
  }
  for (const auto& r : fresh) {
    if (s.stamps.insert(r.first).second) s.device.push_back(r);
  }
  s.last_seen = fresh.back().first;
  s.lag_ms.push_back((static_cast<double>(call_end_us) - static_cast<double>(s.last_seen)) / 1000.0);
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Gaps (ms) between consecutive distinct stamps seen after the priming answer
// (the gap from the backlog's newest stamp may span the warm-up: left out).
std::vector<double> gaps_ms(const Source& s) {
  std::vector<double> gaps;
  unsigned long long prev = 0;
  for (unsigned long long ts : s.stamps) {
    if (prev != 0) gaps.push_back((ts - prev) / 1000.0);
    prev = ts;
  }
  return gaps;
}

// The integration, once the period P (the median gap) is known. An answer
// covers newest - lastSeen, but at most P per distinct stamp in it, or the
// time from the previous call to this one's return where that is longer (the
// sampler stalled, or NVML answers every call afresh as the stand-in's exact
// mode does): a longer gap holds samples that named no process (NVML leaves
// them out of the average it reports), so the gap's time is not the reported
// figure's.
struct Integrated {
  std::map<unsigned, PidStat> pids;
  double device_busy_s = 0, covered_s = 0;
  std::vector<double> device_util;
};

Integrated integrate(const Source& s) {
  Integrated out;
  const double period_us = median_of(gaps_ms(s)) * 1000.0;
  for (const Answer& a : s.answers) {
    const double gap_us = static_cast<double>(a.newest - a.passed);
    const double covered_us = period_us > 0 ? std::min(gap_us, std::max(a.stamps * period_us, a.poll_gap_us)) : gap_us;
    out.covered_s += covered_us / 1e6;
    for (const auto& [pid, sm] : a.records) {
      PidStat& p = out.pids[pid];
      ++p.records;
      p.estimate_s += sm / 100.0 * covered_us / 1e6;
      p.uncapped_s += sm / 100.0 * gap_us / 1e6;
      p.sm_sum += sm;
    }
  }
  unsigned long long prev = s.base;
  for (const auto& [ts, v] : s.device) {
    const double gap_us = static_cast<double>(ts - prev);
    const double covered_us = period_us > 0 ? std::min(gap_us, period_us) : gap_us;
    out.device_busy_s += std::min(v, 100.0) / 100.0 * covered_us / 1e6;
    out.covered_s += covered_us / 1e6;
    out.device_util.push_back(v);
    prev = ts;
  }
  return out;
}

// window_s: the time polled, the denominator of every fraction.
std::string source_summary(const Source& s, double window_s) {
  std::string o = "{\"function\": " + json_string(s.function) + ", \"enabled\": " + (s.enabled ? "true" : "false") +
                  ", \"available\": " + (s.available ? "true" : "false");
  if (!s.available || !s.enabled) return o + ", \"why\": " + json_string(s.why) + "}";
  uint64_t not_found = 0;
  if (auto it = s.rc.find(NVML_ERROR_NOT_FOUND); it != s.rc.end()) not_found = it->second;
  char buf[320];
  snprintf(buf, sizeof buf, ", \"calls\": %" PRIu64 ", \"not_found_fraction\": %.4f", s.calls,
           s.calls ? static_cast<double>(not_found) / s.calls : 0.0);
  o += buf;
  o += ", \"rc\": {";
  bool first = true;
  for (const auto& [rc, n] : s.rc) {
    o += (first ? "\"" : ", \"") + std::to_string(rc) + "\": " + std::to_string(n);
    first = false;
  }
  o += "}, \"call_us\": " + stats_json(s.call_us, 1);
  const Integrated in = integrate(s);
  const auto frac = [&](double x) { return window_s > 0 ? std::to_string(x / window_s) : std::string("null"); };
  snprintf(buf, sizeof buf,
           ", \"primed\": %s, \"samples\": %zu, \"span_s\": %.6f, \"covered_s\": %.6f, \"stale\": %" PRIu64
           ", \"garbage\": %" PRIu64 ", \"insufficient_size_retries\": %" PRIu64,
           s.primed ? "true" : "false", s.stamps.size(), window_s, in.covered_s, s.stale, s.garbage,
           s.insufficient_retries);
  o += buf;
  o += ", \"period_ms\": " + stats_json(gaps_ms(s)) + ", \"lag_ms\": " + stats_json(s.lag_ms);
  if (s.key == "gs") {
    snprintf(buf, sizeof buf, ", \"busy_s\": %.6f, \"busy_fraction\": %s", in.device_busy_s,
             frac(in.device_busy_s).c_str());
    o += buf;
    o += ", \"util\": " + stats_json(in.device_util, 1);
    return o + "}";
  }
  o += ", \"pids_per_sample\": " + histogram_json(s.pids_per_sample) +
       ", \"busy_pids_per_sample\": " + histogram_json(s.busy_pids_per_sample) + ", \"pids\": {";
  first = true;
  for (const auto& [pid, p] : in.pids) {
    snprintf(buf, sizeof buf,
             "%s\"%u\": {\"records\": %" PRIu64
             ", \"estimate_s\": %.6f, \"fraction\": %s, \"uncapped_s\": %.6f, "
             "\"mean_sm\": %.2f}",
             first ? "" : ", ", pid, p.records, p.estimate_s, frac(p.estimate_s).c_str(), p.uncapped_s,
             p.records ? p.sm_sum / p.records : 0.0);
    o += buf;
    first = false;
  }
  return o + "}}";
}

std::string source_digest(const Source& s) {
  if (!s.enabled) return s.function + ": not polled";
  if (!s.available) return s.function + ": not available (" + s.why + ")";
  uint64_t not_found = 0;
  if (auto it = s.rc.find(NVML_ERROR_NOT_FOUND); it != s.rc.end()) not_found = it->second;
  const std::vector<double> gaps = gaps_ms(s);
  char buf[256];
  snprintf(buf, sizeof buf, "%s: %" PRIu64 " calls, NOT_FOUND %.3f, %zu samples, period ms min/median/max %s",
           s.function.c_str(), s.calls, s.calls ? static_cast<double>(not_found) / s.calls : 0.0, s.stamps.size(),
           stats_text(gaps).c_str());
  std::string o = buf;
  const Integrated in = integrate(s);
  if (s.key == "gs") {
    snprintf(buf, sizeof buf, ", device busy %.3f s", in.device_busy_s);
    return o + buf;
  }
  o += ", PIDs per sample";
  for (const auto& [k, n] : s.pids_per_sample) o += " " + std::to_string(k) + ":" + std::to_string(n);
  for (const auto& [pid, p] : in.pids) {
    snprintf(buf, sizeof buf, "; pid %u %.3f s", pid, p.estimate_s);
    o += buf;
  }
  return o;
}

struct Options {
  std::string gpu = "0", out, start_file, lib = "libnvidia-ml.so.1";
  double interval_ms = 2, seconds = 20;
  uint64_t start_ns = 0;
  bool pu = true, pui = true, gs = true;
};

int usage(const std::string& why) {
  fprintf(stderr,
          "nvml_sampler: %s\nusage: nvml_sampler --gpu INDEX|UUID [--interval-ms 2] [--seconds 20] [--out FILE]\n"
          "                    [--start-file F | --start-ns NS] [--calls pu,pui,gs] [--lib PATH]\n",
          why.c_str());
  return 2;
}

void sleep_until(uint64_t t) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(t / 1000000000ull);
  ts.tv_nsec = static_cast<long>(t % 1000000000ull);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      usage("polls NVML's per-process utilization");
      return 0;
    }
    if (i + 1 >= argc) return usage("missing value for " + a);
    const std::string v = argv[++i];
    char* end = nullptr;
    if (a == "--gpu") {
      o.gpu = v;
    } else if (a == "--out") {
      o.out = v;
    } else if (a == "--start-file") {
      o.start_file = v;
    } else if (a == "--lib") {
      o.lib = v;
    } else if (a == "--interval-ms") {
      o.interval_ms = strtod(v.c_str(), &end);
      if (*end != '\0' || !(o.interval_ms > 0)) return usage("--interval-ms takes a number above 0");
    } else if (a == "--seconds") {
      o.seconds = strtod(v.c_str(), &end);
      if (*end != '\0' || !(o.seconds > 0)) return usage("--seconds takes a number above 0");
    } else if (a == "--start-ns") {
      o.start_ns = strtoull(v.c_str(), &end, 10);
      if (*end != '\0') return usage("--start-ns takes CLOCK_MONOTONIC nanoseconds");
    } else if (a == "--calls") {
      o.pu = o.pui = o.gs = false;
      size_t pos = 0;
      while (pos <= v.size()) {
        const size_t comma = std::min(v.find(',', pos), v.size());
        const std::string c = v.substr(pos, comma - pos);
        if (c == "pu")
          o.pu = true;
        else if (c == "pui")
          o.pui = true;
        else if (c == "gs")
          o.gs = true;
        else
          return usage("--calls: unknown call \"" + c + "\" (pu, pui, gs)");
        pos = comma + 1;
      }
    } else {
      return usage("unknown option " + a);
    }
  }

  FILE* out = stdout;
  if (!o.out.empty()) {
    out = fopen(o.out.c_str(), "w");
    if (out == nullptr) {
      fprintf(stderr, "nvml_sampler: cannot write %s: %s\n", o.out.c_str(), strerror(errno));
      return 1;
    }
  }
  static char buffer[1 << 20];
  setvbuf(out, buffer, _IOFBF, sizeof buffer);

  Source src[3];
  src[0].key = "pu", src[0].function = "nvmlDeviceGetProcessUtilization", src[0].enabled = o.pu;
  src[1].key = "pui", src[1].function = "nvmlDeviceGetProcessesUtilizationInfo", src[1].enabled = o.pui;
  src[2].key = "gs", src[2].function = "nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES)", src[2].enabled = o.gs;
  for (Source& s : src) {
    if (!s.enabled) s.why = "not asked for (--calls)";
  }

  auto fail = [&](const std::string& why) {
    fprintf(out, "{\"header\": {\"tool\": \"nvml_sampler\", \"gpu\": %s, \"error\": %s}}\n", json_string(o.gpu).c_str(),
            json_string(why).c_str());
    fprintf(out, "{\"summary\": {\"error\": %s, \"polls\": 0}}\n", json_string(why).c_str());
    fflush(out);
    fprintf(stderr, "nvml_sampler: %s\n", why.c_str());
    return 1;
  };

  Nvml n;
  n.lib = dlopen(o.lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (n.lib == nullptr) {
    const char* e = dlerror();
    return fail("dlopen " + o.lib + ": " + (e != nullptr ? e : "?"));
  }
  n.sym(&n.init, "nvmlInit_v2");
  n.sym(&n.shutdown, "nvmlShutdown");
  n.sym(&n.error_string, "nvmlErrorString");
  n.sym(&n.driver_version, "nvmlSystemGetDriverVersion");
  n.sym(&n.by_index, "nvmlDeviceGetHandleByIndex_v2");
  n.sym(&n.by_uuid, "nvmlDeviceGetHandleByUUID");
  n.sym(&n.uuid, "nvmlDeviceGetUUID");
  n.sym(&n.name, "nvmlDeviceGetName");
  n.sym(&n.process_utilization, "nvmlDeviceGetProcessUtilization");
  n.sym(&n.processes_utilization_info, "nvmlDeviceGetProcessesUtilizationInfo");
  n.sym(&n.get_samples, "nvmlDeviceGetSamples");
  if (n.init == nullptr || n.by_index == nullptr || n.by_uuid == nullptr) {
    return fail(o.lib + " lacks nvmlInit_v2 or nvmlDeviceGetHandleBy*");
  }
  if (nvmlReturn_t rc = n.init(); rc != NVML_SUCCESS) return fail(std::string("nvmlInit_v2: ") + n.err(rc));
  nvmlDevice_t dev = nullptr;
  const bool by_uuid = o.gpu.rfind("GPU-", 0) == 0 || o.gpu.rfind("MIG-", 0) == 0;
  nvmlReturn_t rc = NVML_SUCCESS;
  if (by_uuid) {
    rc = n.by_uuid(o.gpu.c_str(), &dev);
  } else {
    char* end = nullptr;
    const unsigned long index = strtoul(o.gpu.c_str(), &end, 10);
    if (o.gpu.empty() || *end != '\0') return fail("--gpu takes an index or a UUID (GPU-...), not " + o.gpu);
    rc = n.by_index(static_cast<unsigned>(index), &dev);
  }
  if (rc != NVML_SUCCESS) return fail("no GPU " + o.gpu + ": " + n.err(rc));

  char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "", uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "",
       driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "";
  if (n.name != nullptr) n.name(dev, name, sizeof name);
  if (n.uuid != nullptr) n.uuid(dev, uuid, sizeof uuid);
  if (n.driver_version != nullptr) n.driver_version(driver, sizeof driver);

  src[0].available = n.process_utilization != nullptr;
  src[1].available = n.processes_utilization_info != nullptr;
  src[2].available = n.get_samples != nullptr;
  for (Source& s : src) {
    if (s.enabled && !s.available) s.why = "the library does not export it";
  }

  std::vector<nvmlProcessUtilizationSample_t> pu_buf(256);
  std::vector<nvmlProcessUtilizationInfo_v1_t> pui_buf(256);  // R555 wants >= 72 (its ring)
  std::vector<nvmlSample_t> gs_buf(256);
  if (src[2].enabled && src[2].available) {  // the ring's size, asked once
    unsigned count = 0;
    nvmlValueType_t type = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (n.get_samples(dev, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &count, nullptr) == NVML_SUCCESS &&
        count > gs_buf.size()) {
      gs_buf.resize(count + 16);
    }
  }

  // Start: given, from the start file once it holds a number, or now.
  uint64_t start = o.start_ns;
  if (!o.start_file.empty()) {
    for (;;) {
      FILE* f = fopen(o.start_file.c_str(), "r");
      unsigned long long v = 0;
      if (f != nullptr) {
        if (fscanf(f, "%llu", &v) == 1) start = v;
        fclose(f);
      }
      if (start != 0) break;
      usleep(2000);
    }
  }
  if (start == 0) start = mono_ns();
  const uint64_t m0 = mono_ns(), r0 = real_us(), m1 = mono_ns();
  const long long real_minus_mono_ns = static_cast<long long>(r0 * 1000ull) - static_cast<long long>((m0 + m1) / 2);

  std::string calls_list;
  for (const Source& s : src) {
    if (!s.enabled) continue;
    calls_list += std::string(calls_list.empty() ? "" : ", ") + json_string(s.key);
  }
  fprintf(
      out,
      "{\"header\": {\"tool\": \"nvml_sampler\", \"gpu\": %s, \"name\": %s, \"uuid\": %s, \"driver\": %s, "
      "\"library\": %s, \"interval_ms\": %.3f, \"seconds\": %.3f, \"start_mono_ns\": %" PRIu64
      ", \"realtime_minus_monotonic_ns\": %lld, \"pid\": %d, \"calls\": [%s], \"available\": {\"pu\": %s, "
      "\"pui\": %s, \"gs\": %s}, \"fields\": {\"pu\": \"pid, ts = timeStamp (CPU us), sm = smUtil, mem = memUtil\", "
      "\"gs\": \"ts = timeStamp (CPU us), v = sampleValue\"}}}\n",
      json_string(o.gpu).c_str(), json_string(name).c_str(), json_string(uuid).c_str(), json_string(driver).c_str(),
      json_string(o.lib).c_str(), o.interval_ms, o.seconds, start, real_minus_mono_ns, static_cast<int>(getpid()),
      calls_list.c_str(), src[0].available ? "true" : "false", src[1].available ? "true" : "false",
      src[2].available ? "true" : "false");

  const uint64_t interval = static_cast<uint64_t>(o.interval_ms * 1e6);
  const uint64_t end = start + static_cast<uint64_t>(o.seconds * 1e9);
  uint64_t slot = start, polls = 0, missed = 0, prev_poll = 0, first_poll = 0;
  std::vector<double> poll_gaps_ms;
  std::vector<Record> recs;
  std::vector<std::pair<unsigned long long, double>> dev_recs;
  std::string line;
  line.reserve(4096);
  char buf[256];

  auto timed = [](auto&& call, double* us) {
    const uint64_t t0 = mono_ns();
    nvmlReturn_t r = call();
    *us = (mono_ns() - t0) / 1000.0;
    return r;
  };

  while (slot < end) {
    sleep_until(slot);
    const uint64_t pm = mono_ns(), pr = real_us();
    if (prev_poll != 0) poll_gaps_ms.push_back((pm - prev_poll) / 1e6);
    prev_poll = pm;
    if (first_poll == 0) first_poll = pm;
    snprintf(buf, sizeof buf, "{\"poll\": %" PRIu64 ", \"mono_ns\": %" PRIu64 ", \"real_us\": %" PRIu64, polls, pm, pr);
    line = buf;

    for (Source& s : src) {
      if (!s.enabled || !s.available) continue;
      const unsigned long long passed = s.last_seen;
      const uint64_t call_start_us = real_us();
      double us = 0;
      nvmlReturn_t r = NVML_SUCCESS;
      recs.clear();
      dev_recs.clear();
      nvmlValueType_t value_type = NVML_VALUE_TYPE_COUNT;  // unset: logged as -1
      for (int attempt = 0; attempt < 2; ++attempt) {
        if (s.key == "pu") {
          unsigned count = static_cast<unsigned>(pu_buf.size());
          r = timed([&] { return n.process_utilization(dev, pu_buf.data(), &count, passed); }, &us);
          if (r == NVML_ERROR_INSUFFICIENT_SIZE && count > pu_buf.size() && attempt == 0) {
            pu_buf.resize(count + 16);
            ++s.insufficient_retries;
            continue;
          }
          if (r == NVML_SUCCESS) {
            for (unsigned i = 0; i < std::min<size_t>(count, pu_buf.size()); ++i) {
              const auto& x = pu_buf[i];
              recs.push_back({x.pid, x.timeStamp, x.smUtil, x.memUtil});
            }
          }
        } else if (s.key == "pui") {
          nvmlProcessesUtilizationInfo_v1_t info{};
          info.version = nvmlProcessesUtilizationInfo_v1;
          info.processSamplesCount = static_cast<unsigned>(pui_buf.size());
          info.lastSeenTimeStamp = passed;
          info.procUtilArray = pui_buf.data();
          r = timed([&] { return n.processes_utilization_info(dev, &info); }, &us);
          if (r == NVML_ERROR_INSUFFICIENT_SIZE && info.processSamplesCount > pui_buf.size() && attempt == 0) {
            pui_buf.resize(info.processSamplesCount + 16);
            ++s.insufficient_retries;
            continue;
          }
          if (r == NVML_SUCCESS) {
            for (unsigned i = 0; i < std::min<size_t>(info.processSamplesCount, pui_buf.size()); ++i) {
              const auto& x = pui_buf[i];
              recs.push_back({x.pid, x.timeStamp, x.smUtil, x.memUtil});
            }
          }
        } else {
          unsigned count = static_cast<unsigned>(gs_buf.size());
          r = timed(
              [&] {
                return n.get_samples(dev, NVML_GPU_UTILIZATION_SAMPLES, passed, &value_type, &count, gs_buf.data());
              },
              &us);
          if (r == NVML_ERROR_INSUFFICIENT_SIZE && count > gs_buf.size() && attempt == 0) {
            gs_buf.resize(count + 16);
            ++s.insufficient_retries;
            continue;
          }
          if (r == NVML_SUCCESS) {
            for (unsigned i = 0; i < std::min<size_t>(count, gs_buf.size()); ++i) {
              dev_recs.emplace_back(gs_buf[i].timeStamp, sample_value(value_type, gs_buf[i].sampleValue));
            }
          }
        }
        break;
      }
      ++s.calls;
      ++s.rc[static_cast<int>(r)];
      s.call_us.push_back(us);
      snprintf(buf, sizeof buf, ", \"%s\": {\"rc\": %d, \"us\": %.1f, \"last_seen\": %llu", s.key.c_str(),
               static_cast<int>(r), us, passed);
      line += buf;
      if (s.key == "gs") {
        snprintf(buf, sizeof buf, ", \"value_type\": %d, \"records\": [",
                 value_type == NVML_VALUE_TYPE_COUNT ? -1 : static_cast<int>(value_type));
        line += buf;
        for (size_t i = 0; i < dev_recs.size(); ++i) {
          snprintf(buf, sizeof buf, "%s{\"ts\": %llu, \"v\": %.6g}", i ? ", " : "", dev_recs[i].first,
                   dev_recs[i].second);
          line += buf;
        }
        take_device(s, passed, dev_recs, real_us());
      } else {
        line += ", \"records\": [";
        for (size_t i = 0; i < recs.size(); ++i) {
          snprintf(buf, sizeof buf, "%s{\"pid\": %u, \"ts\": %llu, \"sm\": %u, \"mem\": %u}", i ? ", " : "",
                   recs[i].pid, recs[i].ts, recs[i].sm, recs[i].mem);
          line += buf;
        }
        take_processes(s, passed, recs, real_us());
      }
      s.prev_call_us = call_start_us;
      line += "]}";
    }
    line += "}\n";
    fputs(line.c_str(), out);
    ++polls;

    // The next slot; slots already past (a slow call) are skipped, counted.
    slot += interval;
    const uint64_t now = mono_ns();
    if (now > slot) {
      const uint64_t behind = (now - slot) / interval + 1;
      missed += behind;
      slot += behind * interval;
    }
  }

  snprintf(
      buf, sizeof buf,
      "{\"summary\": {\"gpu\": %s, \"uuid\": %s, \"name\": %s, \"driver\": %s, \"interval_ms\": %.3f, \"seconds\": "
      "%.3f, \"polls\": %" PRIu64 ", \"missed_slots\": %" PRIu64 ", ",
      json_string(o.gpu).c_str(), json_string(uuid).c_str(), json_string(name).c_str(), json_string(driver).c_str(),
      o.interval_ms, o.seconds, polls, missed);
  std::string summary = buf;
  // The time polled: first poll to last, plus the last one's slot.
  const double window_s = polls ? (prev_poll - first_poll + interval) / 1e9 : 0.0;
  snprintf(buf, sizeof buf, "\"window_s\": %.6f, ", window_s);
  summary += buf;
  summary += "\"poll_gap_ms\": " + stats_json(poll_gaps_ms) + ", \"calls\": {";
  for (int i = 0; i < 3; ++i) {
    summary += std::string(i ? ", " : "") + "\"" + src[i].key + "\": " + source_summary(src[i], window_s);
  }
  summary += "}}}\n";
  fputs(summary.c_str(), out);
  fflush(out);
  if (out != stdout) fclose(out);

  fprintf(stderr,
          "nvml_sampler: GPU %s (%s, driver %s): %" PRIu64 " polls every %.1f ms over %.1f s, %" PRIu64
          " slots missed, poll gap ms min/median/max %s\n",
          uuid, name, driver, polls, o.interval_ms, o.seconds, missed, stats_text(poll_gaps_ms).c_str());
  for (const Source& s : src) fprintf(stderr, "nvml_sampler: %s\n", source_digest(s).c_str());
  if (n.shutdown != nullptr) n.shutdown();
  return 0;
}

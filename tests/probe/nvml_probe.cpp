// A small NVML client for the tests of NVML inside the tenant: runs the
// commands on its command line in order and prints `key=value` lines. It
// links libnvidia-ml.so.1 (the tests' stand-in, tests/simnvml) for the
// "direct" path, and reaches the same functions through
// dlopen("libnvidia-ml.so.1") + dlsym for the "dlsym" path, the way
// nvidia-smi does. Under LD_PRELOAD=libfracgpu.so both must reach the hooks.
//
//   init                         nvmlInit_v2
//   mem DEV PATH                 nvmlDeviceGetMemoryInfo     -> mem_PATH_DEV_{rc,total,used,free}
//   mem2 DEV PATH                nvmlDeviceGetMemoryInfo_v2  -> mem2_PATH_DEV_{rc,total,reserved,used,free}
//   procs DEV VERSION PATH       nvmlDeviceGetComputeRunningProcesses{,_v2,_v3}
//                                -> procsV_PATH_DEV_{sized_rc,rc,count} and ..._list=pid:bytes,... (by pid)
//   graphics DEV                 nvmlDeviceGetGraphicsRunningProcesses_v3 found by dlsym(RTLD_DEFAULT):
//                                the stand-in NVML lacks it, so only the interposer's export can answer
//                                -> graphics_DEV_rc ("none": no such symbol anywhere)
//   detail DEV MODE PATH         nvmlDeviceGetRunningProcessDetailList, MODE 0/1/2 = compute/graphics/MPS
//                                -> detailMODE_PATH_DEV_{sized_rc,rc,count,list} as procs
//   util DEV PATH                nvmlDeviceGetProcessUtilization -> util_PATH_DEV_{sized_rc,rc,count,list}
//   utilinfo DEV PATH            nvmlDeviceGetProcessesUtilizationInfo -> utilinfo_PATH_DEV_{...} as util
//                                (util lists are pid:smUtil,...; sized_rc: the call with no array)
//   acct DEV PATH                nvmlDeviceGetAccountingPids -> acct_PATH_DEV_{rc,count,list} (list: pid:0,...)
//   acctstats DEV PID PATH       nvmlDeviceGetAccountingStats -> acctstats_PATH_DEV_PID_{rc,mem}
//   rates DEV PATH               nvmlDeviceGetUtilizationRates -> rates_PATH_DEV_{rc,gpu,memory}
//   samples DEV TYPE PATH        nvmlDeviceGetSamples of sampling type TYPE (a number), all of them ->
//                                samples_PATH_DEV_TYPE_{sized_rc,sized_count,rc,count}
//   which NAME                   which library dlsym(NVML handle, NAME) lands in -> which_NAME=<file>
//   gpus PATH                    nvmlDeviceGetCount_v2, then each index's handle (nvmlDeviceGetHandleByIndex_v2),
//                                UUID and nvmlDeviceGetIndex -> gpus_PATH_{rc,count,past_end_rc},
//                                gpus_PATH_I_{uuid,index}; past_end: the handle at index count
//   byuuid UUID PATH             nvmlDeviceGetHandleByUUID -> byuuid_PATH_UUID_rc
//   bypci BUSID PATH             nvmlDeviceGetHandleByPciBusId_v2 -> bypci_PATH_BUSID_rc
//   nearest DEV PATH             nvmlDeviceGetTopologyNearestGpus at NVML_TOPOLOGY_SYSTEM, and
//   gpuset PATH                  nvmlSystemGetTopologyGpuSet of CPU 0 -> nearest_PATH_DEV_... / gpuset_PATH_...
//                                {sized_rc,sized_count,rc,count,uuids}: the size query, then the handles' UUIDs
// PATH is "direct" or "dlsym"; DEV an NVML index. Bad usage exits 64.
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fracgpu/nvml_abi.h"

namespace {

[[noreturn]] void usage(const char* what) {
  fprintf(stderr, "nvml_probe: %s\n", what);
  exit(64);
}

void* nvml_handle() {
  static void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  return handle;
}

// The function `name` by the chosen path: our own linked reference, or dlsym.
template <class Fn>
Fn pick(const std::string& path, Fn linked, const char* name) {
  if (path == "direct") return linked;
  if (path == "dlsym") return reinterpret_cast<Fn>(dlsym(nvml_handle(), name));
  usage("path is direct or dlsym");
}

void print(const std::string& key, unsigned long long value) {
  printf("%s=%llu\n", key.c_str(), value);
  fflush(stdout);
}

nvmlDevice_t device(const char* index) {
  nvmlDevice_t d = nullptr;
  if (nvmlDeviceGetHandleByIndex_v2(static_cast<unsigned>(atoi(index)), &d) != NVML_SUCCESS) usage("no such device");
  return d;
}

// prefix_list=pid:value,... sorted by pid, from the first n records.
template <class Record, class Value>
void print_list(const std::string& prefix, unsigned n, const Record* records, Value value) {
  std::vector<std::pair<unsigned, unsigned long long>> rows;
  for (unsigned i = 0; i < n; ++i) rows.emplace_back(records[i].pid, value(records[i]));
  std::sort(rows.begin(), rows.end());
  std::string list;
  for (const auto& [pid, v] : rows) list += (list.empty() ? "" : ",") + std::to_string(pid) + ":" + std::to_string(v);
  printf("%s_list=%s\n", prefix.c_str(), list.c_str());
  fflush(stdout);
}

// How many records of the caller's whole buffer, past the `n` returned,
// still hold something (`key`: a PID, or 1 for a filled sample): a filter
// that moves the kept records forward must not leave the others behind.
template <class Record, class Key>
void print_left_over(const std::string& prefix, unsigned n, const std::vector<Record>& buffer, Key key) {
  unsigned left = 0;
  for (size_t i = n; i < buffer.size(); ++i) left += key(buffer[i]) != 0;
  printf("%s_left_over=%u\n", prefix.c_str(), left);
  fflush(stdout);
}

template <class Info>
void processes(const std::string& prefix, nvmlDevice_t dev,
               nvmlReturn_t (*fn)(nvmlDevice_t, unsigned int*, Info*)) {
  if (fn == nullptr) {
    printf("%s_rc=none\n", prefix.c_str());
    return;
  }
  unsigned count = 0;
  print(prefix + "_sized_rc", fn(dev, &count, nullptr));  // NVML's way of asking for the count
  std::vector<Info> infos(count + 8);
  count = static_cast<unsigned>(infos.size());
  const nvmlReturn_t rc = fn(dev, &count, infos.data());
  print(prefix + "_rc", rc);
  print(prefix + "_count", count);
  print_list(prefix, rc == NVML_SUCCESS ? count : 0, infos.data(), [](const Info& r) { return r.usedGpuMemory; });
}

// nvmlDeviceGetRunningProcessDetailList: asked for the count, then filled.
void detail_list(const std::string& prefix, nvmlDevice_t dev, unsigned mode,
                 nvmlReturn_t (*fn)(nvmlDevice_t, nvmlProcessDetailList_t*)) {
  if (fn == nullptr) {
    printf("%s_rc=none\n", prefix.c_str());
    return;
  }
  nvmlProcessDetailList_t list{};
  list.version = nvmlProcessDetailList_v1;
  list.mode = mode;
  print(prefix + "_sized_rc", fn(dev, &list));
  std::vector<nvmlProcessDetail_v1_t> rows(list.numProcArrayEntries + 8);
  for (auto& r : rows) r.usedGpuCcProtectedMemory = 777;  // a value the callee must overwrite
  list.numProcArrayEntries = static_cast<unsigned>(rows.size());
  list.procArray = rows.data();
  const nvmlReturn_t rc = fn(dev, &list);
  print(prefix + "_rc", rc);
  print(prefix + "_count", list.numProcArrayEntries);
  const unsigned n = rc == NVML_SUCCESS ? list.numProcArrayEntries : 0;
  for (unsigned i = 0; i < n; ++i)
    if (rows[i].usedGpuCcProtectedMemory != 0) print(prefix + "_cc_memory", rows[i].usedGpuCcProtectedMemory);
  print_list(prefix, n, rows.data(), [](const nvmlProcessDetail_v1_t& r) { return r.usedGpuMemory; });
}

}  // namespace

int main(int argc, char** argv) {
  int i = 1;
  auto arg = [&]() -> const char* {
    if (i >= argc) usage("missing argument");
    return argv[i++];
  };
  while (i < argc) {
    const std::string cmd = arg();
    if (cmd == "init") {
      print("init", nvmlInit_v2());
    } else if (cmd == "mem") {
      const char* index = arg();
      const std::string path = arg();
      auto fn = pick(path, &nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo");
      const std::string p = "mem_" + path + "_" + index;
      nvmlMemory_t m{};
      print(p + "_rc", fn(device(index), &m));
      print(p + "_total", m.total);
      print(p + "_used", m.used);
      print(p + "_free", m.free);
    } else if (cmd == "mem2") {
      const char* index = arg();
      const std::string path = arg();
      auto fn = pick(path, &nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2");
      const std::string p = "mem2_" + path + "_" + index;
      nvmlMemory_v2_t m{};
      m.version = nvmlMemory_v2;
      m.reserved = 12345;  // a value the hook must overwrite
      print(p + "_rc", fn(device(index), &m));
      print(p + "_total", m.total);
      print(p + "_reserved", m.reserved);
      print(p + "_used", m.used);
      print(p + "_free", m.free);
    } else if (cmd == "procs") {
      const char* index = arg();
      const std::string version = arg();
      const std::string path = arg();
      const std::string p = "procs" + version + "_" + path + "_" + index;
      if (version == "1")
        processes(p, device(index), pick(path, &nvmlDeviceGetComputeRunningProcesses, "nvmlDeviceGetComputeRunningProcesses"));
      else if (version == "2")
        processes(p, device(index),
                  pick(path, &nvmlDeviceGetComputeRunningProcesses_v2, "nvmlDeviceGetComputeRunningProcesses_v2"));
      else if (version == "3")
        processes(p, device(index),
                  pick(path, &nvmlDeviceGetComputeRunningProcesses_v3, "nvmlDeviceGetComputeRunningProcesses_v3"));
      else
        usage("version is 1, 2 or 3");
    } else if (cmd == "detail") {
      const char* index = arg();
      const std::string mode = arg();
      const std::string path = arg();
      detail_list("detail" + mode + "_" + path + "_" + index, device(index), static_cast<unsigned>(atoi(mode.c_str())),
                  pick(path, &nvmlDeviceGetRunningProcessDetailList, "nvmlDeviceGetRunningProcessDetailList"));
    } else if (cmd == "util") {
      const char* index = arg();
      const std::string path = arg();
      const std::string p = "util_" + path + "_" + index;
      auto fn = pick(path, &nvmlDeviceGetProcessUtilization, "nvmlDeviceGetProcessUtilization");
      unsigned count = 0;
      print(p + "_sized_rc", fn(device(index), nullptr, &count, 0));
      std::vector<nvmlProcessUtilizationSample_t> samples(count + 8);
      count = static_cast<unsigned>(samples.size());
      const nvmlReturn_t rc = fn(device(index), samples.data(), &count, 0);
      print(p + "_rc", rc);
      print(p + "_count", count);
      print_list(p, rc == NVML_SUCCESS ? count : 0, samples.data(),
                 [](const nvmlProcessUtilizationSample_t& r) { return r.smUtil; });
      print_left_over(p, rc == NVML_SUCCESS ? count : 0, samples, [](const auto& r) { return r.pid; });
    } else if (cmd == "acct") {
      const char* index = arg();
      const std::string path = arg();
      const std::string p = "acct_" + path + "_" + index;
      auto fn = pick(path, &nvmlDeviceGetAccountingPids, "nvmlDeviceGetAccountingPids");
      std::vector<unsigned> pids(64);
      unsigned count = static_cast<unsigned>(pids.size());
      const nvmlReturn_t rc = fn(device(index), &count, pids.data());
      print(p + "_rc", rc);
      print(p + "_count", count);
      struct Pid {
        unsigned pid;
      };
      std::vector<Pid> records;
      for (unsigned i = 0; rc == NVML_SUCCESS && i < count; ++i) records.push_back({pids[i]});
      print_list(p, static_cast<unsigned>(records.size()), records.data(), [](const Pid&) { return 0u; });
      print_left_over(p, static_cast<unsigned>(records.size()), pids, [](unsigned pid) { return pid; });
    } else if (cmd == "acctstats") {
      const char* index = arg();
      const std::string pid = arg();
      const std::string path = arg();
      const std::string p = "acctstats_" + path + "_" + index + "_" + pid;
      auto fn = pick(path, &nvmlDeviceGetAccountingStats, "nvmlDeviceGetAccountingStats");
      nvmlAccountingStats_t stats{};
      print(p + "_rc", fn(device(index), static_cast<unsigned>(atoi(pid.c_str())), &stats));
      print(p + "_mem", stats.maxMemoryUsage);
    } else if (cmd == "utilinfo") {
      const char* index = arg();
      const std::string path = arg();
      const std::string p = "utilinfo_" + path + "_" + index;
      auto fn = pick(path, &nvmlDeviceGetProcessesUtilizationInfo, "nvmlDeviceGetProcessesUtilizationInfo");
      nvmlProcessesUtilizationInfo_t info{};
      info.version = nvmlProcessesUtilizationInfo_v1;
      print(p + "_sized_rc", fn(device(index), &info));
      std::vector<nvmlProcessUtilizationInfo_v1_t> samples(info.processSamplesCount + 8);
      info.processSamplesCount = static_cast<unsigned>(samples.size());
      info.procUtilArray = samples.data();
      const nvmlReturn_t rc = fn(device(index), &info);
      print(p + "_rc", rc);
      print(p + "_count", info.processSamplesCount);
      print_list(p, rc == NVML_SUCCESS ? info.processSamplesCount : 0, samples.data(),
                 [](const nvmlProcessUtilizationInfo_v1_t& r) { return r.smUtil; });
      print_left_over(p, rc == NVML_SUCCESS ? info.processSamplesCount : 0, samples, [](const auto& r) { return r.pid; });
    } else if (cmd == "rates") {
      const char* index = arg();
      const std::string path = arg();
      const std::string p = "rates_" + path + "_" + index;
      auto fn = pick(path, &nvmlDeviceGetUtilizationRates, "nvmlDeviceGetUtilizationRates");
      nvmlUtilization_t u{777, 777};  // values the callee must overwrite
      print(p + "_rc", fn(device(index), &u));
      print(p + "_gpu", u.gpu);
      print(p + "_memory", u.memory);
    } else if (cmd == "samples") {
      const char* index = arg();
      const std::string type = arg();
      const std::string path = arg();
      const std::string p = "samples_" + path + "_" + index + "_" + type;
      auto fn = pick(path, &nvmlDeviceGetSamples, "nvmlDeviceGetSamples");
      const auto sampling = static_cast<nvmlSamplingType_t>(atoi(type.c_str()));
      nvmlValueType_t value_type{};
      unsigned count = 0;
      print(p + "_sized_rc", fn(device(index), sampling, 0, &value_type, &count, nullptr));
      print(p + "_sized_count", count);
      std::vector<nvmlSample_t> samples(count + 8);
      count = static_cast<unsigned>(samples.size());
      print(p + "_rc", fn(device(index), sampling, 0, &value_type, &count, samples.data()));
      print(p + "_count", count);
      print_left_over(p, count, samples, [](const nvmlSample_t& r) { return static_cast<unsigned>(r.timeStamp != 0); });
    } else if (cmd == "graphics") {
      const char* index = arg();
      using Fn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*);
      auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "nvmlDeviceGetGraphicsRunningProcesses_v3"));
      const std::string p = std::string("graphics_") + index;
      if (fn == nullptr) {
        printf("%s_rc=none\n", p.c_str());
        fflush(stdout);
        continue;
      }
      unsigned count = 4;
      nvmlProcessInfo_t infos[4];
      print(p + "_rc", fn(device(index), &count, infos));
      print(p + "_count", count);
    } else if (cmd == "gpus") {
      const std::string path = arg();
      const std::string p = "gpus_" + path;
      auto count_fn = pick(path, &nvmlDeviceGetCount_v2, "nvmlDeviceGetCount_v2");
      auto handle_fn = pick(path, &nvmlDeviceGetHandleByIndex_v2, "nvmlDeviceGetHandleByIndex_v2");
      auto index_fn = pick(path, &nvmlDeviceGetIndex, "nvmlDeviceGetIndex");
      unsigned count = 0;
      print(p + "_rc", count_fn(&count));
      print(p + "_count", count);
      for (unsigned i = 0; i < count; ++i) {
        nvmlDevice_t d = nullptr;
        char uuid[96] = "";
        unsigned index = 999;
        if (handle_fn(i, &d) == NVML_SUCCESS) {
          nvmlDeviceGetUUID(d, uuid, sizeof uuid);
          index_fn(d, &index);
        }
        printf("%s_%u_uuid=%s\n", p.c_str(), i, uuid);
        print(p + "_" + std::to_string(i) + "_index", index);
      }
      nvmlDevice_t past = nullptr;
      print(p + "_past_end_rc", handle_fn(count, &past));
    } else if (cmd == "byuuid") {
      const std::string uuid = arg();
      const std::string path = arg();
      auto fn = pick(path, &nvmlDeviceGetHandleByUUID, "nvmlDeviceGetHandleByUUID");
      nvmlDevice_t d = nullptr;
      print("byuuid_" + path + "_" + uuid + "_rc", fn(uuid.c_str(), &d));
    } else if (cmd == "bypci") {
      const std::string bus = arg();
      const std::string path = arg();
      auto fn = pick(path, &nvmlDeviceGetHandleByPciBusId_v2, "nvmlDeviceGetHandleByPciBusId_v2");
      nvmlDevice_t d = nullptr;
      print("bypci_" + path + "_" + bus + "_rc", fn(bus.c_str(), &d));
    } else if (cmd == "nearest" || cmd == "gpuset") {
      const bool nearest = cmd == "nearest";
      const char* index = nearest ? arg() : nullptr;
      const std::string path = arg();
      const std::string p = cmd + "_" + path + (nearest ? std::string("_") + index : std::string());
      auto near_fn = pick(path, &nvmlDeviceGetTopologyNearestGpus, "nvmlDeviceGetTopologyNearestGpus");
      auto set_fn = pick(path, &nvmlSystemGetTopologyGpuSet, "nvmlSystemGetTopologyGpuSet");
      const nvmlDevice_t dev = nearest ? device(index) : nullptr;
      const auto ask = [&](unsigned* count, nvmlDevice_t* devices) {
        return nearest ? near_fn(dev, NVML_TOPOLOGY_SYSTEM, count, devices) : set_fn(0, count, devices);
      };
      unsigned count = 0;
      print(p + "_sized_rc", ask(&count, nullptr));
      print(p + "_sized_count", count);
      std::vector<nvmlDevice_t> devices(16);
      count = static_cast<unsigned>(devices.size());
      const nvmlReturn_t rc = ask(&count, devices.data());
      print(p + "_rc", rc);
      print(p + "_count", count);
      std::string uuids;
      for (unsigned i = 0; rc == NVML_SUCCESS && i < count && i < devices.size(); ++i) {
        char uuid[96] = {};
        nvmlDeviceGetUUID(devices[i], uuid, sizeof uuid);
        uuids += (uuids.empty() ? "" : ",") + std::string(uuid);
      }
      printf("%s_uuids=%s\n", p.c_str(), uuids.c_str());
      fflush(stdout);
    } else if (cmd == "which") {
      const char* name = arg();
      Dl_info info{};
      void* address = dlsym(nvml_handle(), name);
      const char* file = address != nullptr && dladdr(address, &info) != 0 && info.dli_fname ? info.dli_fname : "none";
      const char* base = strrchr(file, '/');
      printf("which_%s=%s\n", name, base ? base + 1 : file);
      fflush(stdout);
    } else {
      usage(("unknown command " + cmd).c_str());
    }
  }
  return 0;
}

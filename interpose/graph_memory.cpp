// Graph memory accounting (graph_memory.h says what and when). None of this
// runs unless the process instantiated a graph with allocation nodes.
#include "graph_memory.h"

#include <vector>

#include "hook_table.h"
#include "log.h"
#include "memory_hooks.h"
#include "tenant.h"

namespace fracgpu::interpose {

std::atomic<uint32_t> g_graph_execs_with_memory{0};

namespace {

// The driver's allocation granularity for graph memory is not documented;
// rounding each node up to 2 MiB (the pools' granularity) keeps the
// reservation at least what the driver can take. The charge itself follows
// the driver's own figure (settle_device).
constexpr uint64_t kGraphGranularity = 2ull << 20;
// Devices one exec may allocate on. Graphs that allocate on more are refused
// rather than left uncharged.
constexpr int kDevicesPerExec = 4;
constexpr size_t kMaxExecs = 1024;  // power of two
// Child graphs nest; deeper than this is refused (none is known to exist).
constexpr int kMaxGraphDepth = 16;

constexpr uint64_t kEmpty = 0;
constexpr uint64_t kTombstone = 1;
constexpr uint64_t kBusy = 2;

// An open-addressing table keyed by exec handle. The keys sit apart from the
// records so that a lookup that misses (a graph launch of an exec without
// graph memory) reads a dense 8 KiB array at worst: destroyed entries stay
// tombstones until reused, so a long-lived process's misses may probe far.
std::atomic<uint64_t> g_exec_keys[kMaxExecs];  // CUgraphExec, or kEmpty / kTombstone / kBusy

struct ExecMemory {
  int devices;
  CUdevice device[kDevicesPerExec];
  uint64_t bytes[kDevicesPerExec];
  // trim epoch + 1 once a launch or upload succeeded: the driver then keeps
  // the exec's memory until the next trim, so relaunching takes nothing new.
  std::atomic<uint64_t> backed_epoch;
};

// Per device ordinal: what this process charged for the driver's graph
// memory cache there, and reservations of launches still in the driver.
struct DeviceGraphCharge {
  std::atomic<int> gpu{kNotGranted};
  std::atomic<uint64_t> charged{0};
  std::atomic<uint64_t> inflight{0};
};

ExecMemory g_execs[kMaxExecs];  // the record of g_exec_keys[i]
DeviceGraphCharge g_devices[kMaxDevices];
std::atomic<uint64_t> g_trim_epoch{0};

size_t home_slot(uint64_t exec) { return static_cast<size_t>((exec * 0x9E3779B97F4A7C15ull) >> 54) & (kMaxExecs - 1); }

int find_exec(uint64_t exec) {
  size_t i = home_slot(exec);
  for (size_t probes = 0; probes < kMaxExecs; ++probes, i = (i + 1) & (kMaxExecs - 1)) {
    const uint64_t key = g_exec_keys[i].load(std::memory_order_acquire);
    if (key == exec) return static_cast<int>(i);
    if (key == kEmpty) return -1;
  }
  return -1;
}

// Claims a free entry for `exec` and leaves it kBusy: the caller fills it and
// publishes it with publish_exec.
int claim_entry(uint64_t exec) {
  size_t i = home_slot(exec);
  for (size_t probes = 0; probes < kMaxExecs; ++probes, i = (i + 1) & (kMaxExecs - 1)) {
    uint64_t key = g_exec_keys[i].load(std::memory_order_acquire);
    if ((key == kEmpty || key == kTombstone) &&
        g_exec_keys[i].compare_exchange_strong(key, kBusy, std::memory_order_acq_rel))
      return static_cast<int>(i);
  }
  return -1;
}

void publish_exec(int index, uint64_t exec) {
  g_exec_keys[index].store(exec, std::memory_order_release);
  g_graph_execs_with_memory.fetch_add(1, std::memory_order_relaxed);
}

bool valid_device(CUdevice device) { return device >= 0 && device < kMaxDevices; }

bool device_graph_attribute(CUdevice device, CUgraphMem_attribute attr, uint64_t* bytes) {
  cuuint64_t value = 0;
  if (g_driver.cuDeviceGetGraphMemAttribute == nullptr ||
      g_driver.cuDeviceGetGraphMemAttribute(device, attr, &value) != CUDA_SUCCESS)
    return false;
  *bytes = value;
  return true;
}

// Memory the device's graph cache holds but no graph is using: a newly
// launched exec is backed from it before the cache grows.
uint64_t device_graph_slack(CUdevice device) {
  uint64_t reserved = 0, used = 0;
  if (!device_graph_attribute(device, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) ||
      !device_graph_attribute(device, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used))
    return 0;
  return reserved > used ? reserved - used : 0;
}

// Brings the device's graph memory charge to what the driver's cache holds.
bool settle_device(CUdevice device) {
  DeviceGraphCharge& d = g_devices[device];
  const int gpu = d.gpu.load(std::memory_order_acquire);
  if (gpu == kNotGranted) return true;
  // inflight before the driver's figure: a launch that finishes between the
  // two reads is counted twice (safe), never zero times.
  const uint64_t inflight = d.inflight.load(std::memory_order_seq_cst);
  uint64_t holds = 0;
  if (!device_graph_attribute(device, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &holds)) return true;
  return settle_charge(d.charged, gpu, holds, inflight);
}

struct Demand {
  int devices = 0;
  CUdevice device[kDevicesPerExec] = {};
  uint64_t bytes[kDevicesPerExec] = {};
};

enum class Scan { kOk, kUnreadable, kTooManyDevices, kTooDeep };

Scan add_node_demand(CUgraph graph, int depth, Demand* demand) {
  if (depth > kMaxGraphDepth) return Scan::kTooDeep;
  size_t count = 0;
  if (g_driver.cuGraphGetNodes == nullptr || g_driver.cuGraphNodeGetType == nullptr ||
      g_driver.cuGraphGetNodes(graph, nullptr, &count) != CUDA_SUCCESS)
    return Scan::kUnreadable;
  if (count == 0) return Scan::kOk;
  std::vector<CUgraphNode> nodes(count);
  if (g_driver.cuGraphGetNodes(graph, nodes.data(), &count) != CUDA_SUCCESS) return Scan::kUnreadable;
  nodes.resize(std::min(count, nodes.size()));
  for (CUgraphNode node : nodes) {
    CUgraphNodeType type;
    if (g_driver.cuGraphNodeGetType(node, &type) != CUDA_SUCCESS) return Scan::kUnreadable;
    if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
      CUgraph child = nullptr;
      if (g_driver.cuGraphChildGraphNodeGetGraph == nullptr ||
          g_driver.cuGraphChildGraphNodeGetGraph(node, &child) != CUDA_SUCCESS)
        return Scan::kUnreadable;
      if (Scan s = add_node_demand(child, depth + 1, demand); s != Scan::kOk) return s;
      continue;
    }
    if (type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) continue;
    CUDA_MEM_ALLOC_NODE_PARAMS params{};
    if (g_driver.cuGraphMemAllocNodeGetParams == nullptr ||
        g_driver.cuGraphMemAllocNodeGetParams(node, &params) != CUDA_SUCCESS)
      return Scan::kUnreadable;
    const CUdevice device = params.poolProps.location.id;
    if (!valid_device(device)) return Scan::kUnreadable;
    const uint64_t bytes = (params.bytesize + kGraphGranularity - 1) / kGraphGranularity * kGraphGranularity;
    int k = 0;
    while (k < demand->devices && demand->device[k] != device) ++k;
    if (k == demand->devices) {
      if (k == kDevicesPerExec) return Scan::kTooManyDevices;
      demand->device[k] = device;
      demand->devices++;
    }
    demand->bytes[k] += bytes;
  }
  return Scan::kOk;
}

// Ends the reservations claimed for the first `count` devices of an exec:
// after a successful call by settling each device to what its cache holds
// (false if the quota could not cover that), else by giving them back.
bool release_reservations(const ExecMemory& e, const uint64_t* reserved, int count, bool settle) {
  bool covered = true;
  for (int k = 0; k < count; ++k) {
    DeviceGraphCharge& d = g_devices[e.device[k]];
    d.inflight.fetch_sub(reserved[k], std::memory_order_seq_cst);
    if (settle) {
      covered &= settle_device(e.device[k]);
    } else if (reserved[k] != 0) {
      d.charged.fetch_sub(reserved[k], std::memory_order_seq_cst);
      unreserve(d.gpu.load(std::memory_order_relaxed), reserved[k]);
    }
  }
  return covered;
}

}  // namespace

CUresult note_graph_exec(CUgraphExec exec, CUgraph graph) {
  Demand demand;
  switch (add_node_demand(graph, 0, &demand)) {
    case Scan::kOk:
      break;
    case Scan::kUnreadable:
      // The driver answered the instantiation but not questions about the
      // graph it instantiated: nothing to go on. Let it run uncharged rather
      // than break the application, and say so.
      FRACGPU_LOG_ONCE(LogLevel::kWarn, "could not read a graph's nodes: its graph memory (if any) is not charged");
      return CUDA_SUCCESS;
    case Scan::kTooManyDevices:
      FRACGPU_LOG_ONCE(LogLevel::kError, "a graph allocates memory on more than %d devices: refused", kDevicesPerExec);
      return CUDA_ERROR_NOT_SUPPORTED;
    case Scan::kTooDeep:
      FRACGPU_LOG_ONCE(LogLevel::kError, "a graph nests child graphs more than %d deep: refused", kMaxGraphDepth);
      return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (demand.devices == 0) return CUDA_SUCCESS;
  const auto key = reinterpret_cast<uint64_t>(exec);
  const int index = claim_entry(key);
  if (index < 0) {
    FRACGPU_LOG_ONCE(LogLevel::kError, "more than %zu graphs with memory nodes instantiated: further ones are refused",
                     kMaxExecs);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  ExecMemory& e = g_execs[index];
  e.devices = demand.devices;
  for (int k = 0; k < demand.devices; ++k) {
    e.device[k] = demand.device[k];
    e.bytes[k] = demand.bytes[k];
    // A device ordinal's GPU entry is fixed for the life of the process.
    int unset = kNotGranted;
    g_devices[e.device[k]].gpu.compare_exchange_strong(unset, gpu_entry_for_device(demand.device[k]),
                                                        std::memory_order_acq_rel);
  }
  e.backed_epoch.store(0, std::memory_order_relaxed);
  publish_exec(index, key);
  return CUDA_SUCCESS;
}

ForgottenGraphExec forget_graph_exec(CUgraphExec exec) {
  ForgottenGraphExec forgotten;
  if (g_graph_execs_with_memory.load(std::memory_order_relaxed) == 0) return forgotten;
  const auto key = reinterpret_cast<uint64_t>(exec);
  const int index = find_exec(key);
  if (index < 0) return forgotten;
  uint64_t expected = key;
  // Busy, not yet a tombstone: the entry's contents stay ours until
  // graph_exec_destroyed decides.
  if (!g_exec_keys[index].compare_exchange_strong(expected, kBusy, std::memory_order_acq_rel)) return forgotten;
  g_graph_execs_with_memory.fetch_sub(1, std::memory_order_relaxed);
  forgotten.index = index;
  return forgotten;
}

void graph_exec_destroyed(CUgraphExec exec, ForgottenGraphExec forgotten, bool destroyed) {
  if (forgotten.index < 0) return;
  ExecMemory& e = g_execs[forgotten.index];
  if (!destroyed) {
    publish_exec(forgotten.index, reinterpret_cast<uint64_t>(exec));
    return;
  }
  // The driver may give the exec's memory back now or keep it cached until
  // a trim: its own figure decides.
  for (int k = 0; k < e.devices; ++k) settle_device(e.device[k]);
  g_exec_keys[forgotten.index].store(kTombstone, std::memory_order_release);
}

CUresult run_with_graph_memory(CUgraphExec exec, CUstream stream, CUresult (*call)(CUgraphExec, CUstream)) {
  if (call == nullptr) return CUDA_ERROR_NOT_FOUND;
  const int index = find_exec(reinterpret_cast<uint64_t>(exec));
  if (index < 0) return call(exec, stream);
  ExecMemory& e = g_execs[index];
  const uint64_t epoch = g_trim_epoch.load(std::memory_order_acquire);
  const bool backed = e.backed_epoch.load(std::memory_order_acquire) == epoch + 1;
  uint64_t reserved[kDevicesPerExec] = {};
  for (int k = 0; k < e.devices; ++k) {
    const int gpu = g_devices[e.device[k]].gpu.load(std::memory_order_relaxed);
    if (gpu == kNotGranted) continue;  // the driver refuses work there
    // The most this call can make the cache grow: the whole exec. If the
    // quota refuses that (reserve() has settled every cache first), what
    // the cache holds unused is taken first, and an exec the driver already
    // backs takes nothing new. Concurrent launches may count the same
    // unused memory: the settle after the call charges what really grew.
    uint64_t want = e.bytes[k];
    if (!reserve(gpu, want)) {
      const uint64_t slack = device_graph_slack(e.device[k]);
      want = backed ? 0 : want > slack ? want - slack : 0;
      if (want != 0 && !reserve(gpu, want)) {
        release_reservations(e, reserved, k, false);
        return CUDA_ERROR_OUT_OF_MEMORY;
      }
    }
    DeviceGraphCharge& d = g_devices[e.device[k]];
    d.charged.fetch_add(want, std::memory_order_seq_cst);
    d.inflight.fetch_add(want, std::memory_order_seq_cst);
    reserved[k] = want;
  }
  const CUresult result = call(exec, stream);
  if (result == CUDA_SUCCESS) e.backed_epoch.store(epoch + 1, std::memory_order_release);
  if (!release_reservations(e, reserved, e.devices, result == CUDA_SUCCESS)) {
    // The cache grew past what the quota lets us charge, although the
    // reservation allowed for the whole exec (another thread's graph grew
    // it meanwhile, or the driver rounds more than we assume). The launch
    // cannot be taken back; the rest is charged at the next settle that
    // fits. Say so once: it should not happen.
    FRACGPU_LOG_ONCE(LogLevel::kWarn, "graph memory exceeds what the quota could charge");
  }
  return result;
}

void graph_memory_trimmed(CUdevice device) {
  g_trim_epoch.fetch_add(1, std::memory_order_acq_rel);
  if (valid_device(device)) settle_device(device);
}

void settle_all_graph_memory() {
  for (CUdevice device = 0; device < kMaxDevices; ++device)
    if (g_devices[device].gpu.load(std::memory_order_relaxed) != kNotGranted) settle_device(device);
}

void reset_graph_memory_state() {
  for (auto& key : g_exec_keys) key.store(kEmpty, std::memory_order_relaxed);
  for (auto& d : g_devices) {
    d.gpu.store(kNotGranted, std::memory_order_relaxed);
    d.charged.store(0, std::memory_order_relaxed);
    d.inflight.store(0, std::memory_order_relaxed);
  }
  g_graph_execs_with_memory.store(0, std::memory_order_relaxed);
}

}  // namespace fracgpu::interpose

// Graph memory accounting (graph_memory.h says what and when). None of this
// runs unless the process instantiated a graph with allocation nodes.
#include "graph_memory.h"

#include <sched.h>

#include <cstdint>
#include <cstdlib>

#include "hook_table.h"
#include "log.h"
#include "memory_held.h"
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
// memory cache there (memory_held.h: settled, and reservations of launches
// still in the driver).
struct DeviceGraphCharge {
  std::atomic<int> gpu{kNotGranted};
  HeldCharge charge;
};

ExecMemory g_execs[kMaxExecs];  // the record of g_exec_keys[i]
DeviceGraphCharge g_devices[kMaxDevices];
std::atomic<uint64_t> g_trim_epoch{0};

// An exec the driver backs (launched since the last trim) relaunches without
// taking memory, so a launch the quota refuses may still run it: unreserved.
// That is exact only while no trim can unback it during the call, so such
// launches and trims exclude each other: a launch counts itself, then looks
// for trims; a trim counts itself, then waits for the launches to end (all
// sequentially consistent, so of a racing pair one sees the other). Only
// refused launches and trims, both slow paths, ever wait or back off.
std::atomic<int64_t> g_unreserved_launches{0};
std::atomic<int> g_trims{0};

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

bool device_graph_holds(const void* arg, uint64_t* bytes) {
  const auto device = static_cast<CUdevice>(static_cast<const DeviceGraphCharge*>(arg) - g_devices);
  return device_graph_attribute(device, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, bytes);
}

// Brings the device's graph memory charge to what the driver's cache holds.
HeldCharge::Settled settle_device(CUdevice device, bool wait) {
  DeviceGraphCharge& d = g_devices[device];
  const int gpu = d.gpu.load(std::memory_order_acquire);
  if (gpu == kNotGranted) return HeldCharge::Settled::kDone;
  return d.charge.settle(gpu, device_graph_holds, &d, wait);
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
  // malloc, not a container: an allocation that fails must come back as an
  // error, never as an exception through the application's call.
  const size_t listed = count;
  auto* nodes = count <= SIZE_MAX / sizeof(CUgraphNode)
                    ? static_cast<CUgraphNode*>(malloc(count * sizeof(CUgraphNode)))
                    : nullptr;
  if (nodes == nullptr) return Scan::kUnreadable;
  const struct FreeNodes {
    CUgraphNode* nodes;
    ~FreeNodes() { free(nodes); }
  } free_nodes{nodes};
  if (g_driver.cuGraphGetNodes(graph, nodes, &count) != CUDA_SUCCESS) return Scan::kUnreadable;
  for (size_t i = 0; i < std::min(count, listed); ++i) {
    const CUgraphNode node = nodes[i];
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

void unreserve_exec(const ExecMemory& e, const uint64_t* reserved) {
  for (int k = 0; k < e.devices; ++k)
    unreserve(g_devices[e.device[k]].gpu.load(std::memory_order_relaxed), reserved[k]);
}

void trim_begin() {
  g_trims.fetch_add(1, std::memory_order_seq_cst);
  while (g_unreserved_launches.load(std::memory_order_seq_cst) != 0) sched_yield();
}

void trim_end(CUdevice device, bool trimmed) {
  if (trimmed) g_trim_epoch.fetch_add(1, std::memory_order_seq_cst);
  g_trims.fetch_sub(1, std::memory_order_seq_cst);
  if (trimmed && valid_device(device)) settle_device(device, /*wait=*/false);
}

// Memory the device's graph cache holds that no exec is backed by.
uint64_t device_graph_unused(CUdevice device) {
  uint64_t reserved = 0, used = 0;
  if (!device_graph_attribute(device, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) ||
      !device_graph_attribute(device, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used))
    return 0;
  return reserved > used ? reserved - used : 0;
}

// Reserves what each of the exec's devices may have to add to its cache
// (the whole exec: the most a launch can take). trim: where the quota
// refuses and the cache holds memory no exec uses, first give it back to the
// device (a trim: unused cached memory is charged, but cannot stand in for a
// reservation, since the driver may grow the cache anyway), settle, and try
// again. A trim also takes their memory from execs not running (the driver
// backs them again at their next launch).
bool reserve_exec(const ExecMemory& e, uint64_t* reserved, bool trim) {
  for (int k = 0; k < e.devices; ++k) {
    const CUdevice device = e.device[k];
    const int gpu = g_devices[device].gpu.load(std::memory_order_relaxed);
    bool ok = reserve(gpu, e.bytes[k]);
    if (!ok && trim && gpu != kNotGranted && real<HookId::cuDeviceGraphMemTrim>() != nullptr &&
        device_graph_unused(device) != 0) {
      trim_begin();
      trim_end(device, real<HookId::cuDeviceGraphMemTrim>()(device) == CUDA_SUCCESS);
      settle_device(device, /*wait=*/true);
      ok = reserve(gpu, e.bytes[k]);
    }
    if (!ok) {
      unreserve_exec(e, reserved);
      for (int j = 0; j < k; ++j) reserved[j] = 0;
      return false;
    }
    reserved[k] = e.bytes[k];
  }
  return true;
}

// Runs the exec without a reservation if the driver backs it and no trim
// can take that away during the call. False if it could not (not run).
bool run_backed(const ExecMemory& e, CUgraphExec exec, CUstream stream, CUresult (*call)(CUgraphExec, CUstream),
                CUresult* result) {
  g_unreserved_launches.fetch_add(1, std::memory_order_seq_cst);
  const bool backed = g_trims.load(std::memory_order_seq_cst) == 0 &&
                      e.backed_epoch.load(std::memory_order_seq_cst) ==
                          g_trim_epoch.load(std::memory_order_seq_cst) + 1;
  if (backed) *result = call(exec, stream);
  g_unreserved_launches.fetch_sub(1, std::memory_order_seq_cst);
  return backed;
}

}  // namespace

CUresult note_graph_exec(CUgraphExec exec, CUgraph graph) {
  Demand demand;
  switch (add_node_demand(graph, 0, &demand)) {
    case Scan::kOk:
      break;
    case Scan::kUnreadable:
      // The driver answered the instantiation but not questions about the
      // graph it instantiated: what it allocates is unknown, and an exec
      // that could take memory uncharged is not let through.
      FRACGPU_LOG_ONCE(LogLevel::kError, "could not read a graph's nodes to charge its memory: refused");
      return CUDA_ERROR_NOT_SUPPORTED;
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
  for (int k = 0; k < e.devices; ++k) settle_device(e.device[k], /*wait=*/false);
  g_exec_keys[forgotten.index].store(kTombstone, std::memory_order_release);
}

CUresult run_with_graph_memory(CUgraphExec exec, CUstream stream, CUresult (*call)(CUgraphExec, CUstream)) {
  if (call == nullptr) return CUDA_ERROR_NOT_FOUND;
  const int index = find_exec(reinterpret_cast<uint64_t>(exec));
  if (index < 0) return call(exec, stream);
  ExecMemory& e = g_execs[index];
  uint64_t reserved[kDevicesPerExec] = {};
  CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
  if (!reserve_exec(e, reserved, /*trim=*/false)) {
    // At the quota's edge: an exec the driver backs needs nothing new;
    // anything else needs room made for its whole demand, or is refused
    // (CUDA_ERROR_OUT_OF_MEMORY: the driver's own answer when it cannot back
    // a graph), and nothing runs.
    if (run_backed(e, exec, stream, call, &result)) return result;
    if (!reserve_exec(e, reserved, /*trim=*/true)) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const uint64_t epoch = g_trim_epoch.load(std::memory_order_seq_cst);
  for (int k = 0; k < e.devices; ++k) g_devices[e.device[k]].charge.begin(reserved[k]);
  result = call(exec, stream);
  if (result == CUDA_SUCCESS) e.backed_epoch.store(epoch + 1, std::memory_order_seq_cst);
  bool covered = true;
  for (int k = 0; k < e.devices; ++k) {
    DeviceGraphCharge& d = g_devices[e.device[k]];
    d.charge.end(reserved[k], result == CUDA_SUCCESS, d.gpu.load(std::memory_order_relaxed));
    covered &= settle_device(e.device[k], /*wait=*/false) == HeldCharge::Settled::kDone;
  }
  // The cache grew past the whole exec's reservation and the quota (the
  // driver rounds more than we assume). A launch cannot be taken back: the
  // memory is charged over the quota, and further reservations are refused
  // until it is given back.
  if (!covered) FRACGPU_LOG_ONCE(LogLevel::kError, "graph memory exceeds what the quota could charge");
  return result;
}

GraphTrim graph_trim_begin() {
  trim_begin();
  return GraphTrim{};
}

void graph_trim_end(GraphTrim, CUdevice device, bool trimmed) { trim_end(device, trimmed); }

void settle_all_graph_memory(bool wait) {
  for (CUdevice device = 0; device < kMaxDevices; ++device)
    if (g_devices[device].gpu.load(std::memory_order_relaxed) != kNotGranted) settle_device(device, wait);
}

void reset_graph_memory_state() {
  for (auto& key : g_exec_keys) key.store(kEmpty, std::memory_order_relaxed);
  for (auto& d : g_devices) {
    d.gpu.store(kNotGranted, std::memory_order_relaxed);
    d.charge.reset();
  }
  g_graph_execs_with_memory.store(0, std::memory_order_relaxed);
  g_unreserved_launches.store(0, std::memory_order_relaxed);
  g_trims.store(0, std::memory_order_relaxed);
}

}  // namespace fracgpu::interpose

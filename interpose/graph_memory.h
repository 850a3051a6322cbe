// CUDA graph memory: what memory-allocation nodes take (cuGraphAddMemAllocNode,
// or cuMemAllocAsync into a capturing stream), charged to the tenant.
//
// A graph's allocations are only addresses until the graph is launched or
// uploaded; then the driver backs them with physical memory from a per-device
// graph memory cache, keeps it across launches, and gives it back at
// cuDeviceGraphMemTrim. So:
//   instantiate: note how much each exec's allocation nodes ask for, per device;
//   launch/upload of such an exec: reserve that much before the driver call
//     (the most its first launch can take), then settle the device's charge to
//     what the cache really holds (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), as
//     a HeldCharge (memory_held.h: exact under any interleaving);
//   trim, exec destroy: settle again.
// A reservation the quota refuses: an exec the driver still backs relaunches
// without one (trims held off meanwhile); otherwise the cache's unused memory
// is trimmed and the reservation tried again; otherwise the launch is refused
// with CUDA_ERROR_OUT_OF_MEMORY, which is what the driver itself returns when
// it cannot back a graph.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

namespace fracgpu::interpose {

// Instantiated execs that allocate graph memory, in this process. Graph
// launches look at nothing else while it is 0.
extern std::atomic<uint32_t> g_graph_execs_with_memory;

// After a successful instantiation (managed mode): records what the exec's
// allocation nodes ask for. Returns CUDA_SUCCESS, or the error the caller
// must refuse the instantiation with (the exec cannot be accounted for).
CUresult note_graph_exec(CUgraphExec exec, CUgraph graph);

// Around cuGraphExecDestroy: forget before the call (the handle may be reused
// as soon as it is destroyed); if the call fails, the record is put back.
struct ForgottenGraphExec {
  int index = -1;  // -1: the exec had no graph memory
};
ForgottenGraphExec forget_graph_exec(CUgraphExec exec);
void graph_exec_destroyed(CUgraphExec exec, ForgottenGraphExec forgotten, bool destroyed);

// Runs a launch or upload of `exec` (`call`: the real cuGraphLaunch or
// cuGraphUpload variant) with its graph memory reserved first and settled
// after.
CUresult run_with_graph_memory(CUgraphExec exec, CUstream stream, CUresult (*call)(CUgraphExec, CUstream));

// Around cuDeviceGraphMemTrim: a trim waits for launches running without a
// reservation (an exec the driver backs, launched at the quota's edge) and
// holds new ones off, since it unbacks them.
struct GraphTrim {};
GraphTrim graph_trim_begin();
void graph_trim_end(GraphTrim trim, CUdevice device, bool trimmed);

// Brings every device's graph memory charge to what its cache holds. wait:
// returns only after settles started after the call have ended.
void settle_all_graph_memory(bool wait);

// Forgets everything (a forked child inherits its parent's copy).
void reset_graph_memory_state();

}  // namespace fracgpu::interpose

// Launch hooks: every path that puts kernels on the GPU asks the launch gate
// (launch_gate.h) first. The common case is one atomic load and one compare,
// then the real call; everything else is wait_for_gpu's business.
//
// Copies and memsets are not gated: they use the copy engines, not the SMs
// whose time the shares divide (docs/sm-time.md).
#pragma once

#include <cuda.h>

#include "graph_memory.h"
#include "hook_table.h"
#include "launch_gate.h"

namespace fracgpu::interpose {

// Every launch hook is split in two. The hook itself (pass_or) checks the
// thread's pass and that the driver has the function, then jumps to the
// real function with its own arguments untouched. Everything else is in a
// separate, never-inlined gated function with the same signature, so that
// the hook is a tail jump on either path: inlined, the slow path made the
// hook save six registers and copy its stack arguments on every launch
// (docs/performance.md, "the launch path").
template <HookId id, auto gated, class... Args>
[[gnu::always_inline]] inline CUresult pass_or(Args... args) {
  if (launch_may_pass()) [[likely]]
    if (const auto fn = real<id>(); fn != nullptr) [[likely]]
      return fn(args...);
  return gated(args...);
}

// The gated path: the real function, or CUDA_ERROR_NOT_FOUND if the driver
// lacks it (the gate never loads the driver on the fast path: a pass implies
// it is loaded), or the gate's refusal.
// A paced launch (launch_gate.h: a latency tenant shares the GPU) is
// tracked once made; `kernel` (its function or graph exec) names what it
// runs, for the pacer's estimate of its GPU time.
#define FRACGPU_GATED_LAUNCH(id, stream, kernel, ...)                          \
  do {                                                                         \
    bool paced = false;                                                        \
    if (!launch_may_pass())                                                    \
      if (const CUresult refused = wait_for_gpu(stream, &paced, kernel); refused != CUDA_SUCCESS) \
        return refused;                                                        \
    auto fn = real<id>();                                                      \
    if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;                            \
    const CUresult result = fn(__VA_ARGS__);                                   \
    if (paced && result == CUDA_SUCCESS) paced_launch_done(stream);            \
    return result;                                                             \
  } while (0)

template <HookId id>
[[gnu::noinline]] CUresult launch_kernel_gated(CUfunction f, unsigned int grid_x, unsigned int grid_y,
                                               unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                               unsigned int block_z, unsigned int shared_bytes, CUstream stream,
                                               void** params, void** extra) {
  FRACGPU_GATED_LAUNCH(id, stream, f, f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, stream,
                       params, extra);
}

template <HookId id>
CUresult launch_kernel(CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                       unsigned int block_x, unsigned int block_y, unsigned int block_z, unsigned int shared_bytes,
                       CUstream stream, void** params, void** extra) {
  return pass_or<id, launch_kernel_gated<id>>(f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes,
                                              stream, params, extra);
}

template <HookId id>
[[gnu::noinline]] CUresult launch_kernel_ex_gated(const CUlaunchConfig* config, CUfunction f, void** params,
                                                  void** extra) {
  FRACGPU_GATED_LAUNCH(id, config != nullptr ? config->hStream : nullptr, f, config, f, params, extra);
}

template <HookId id>
CUresult launch_kernel_ex(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  return pass_or<id, launch_kernel_ex_gated<id>>(config, f, params, extra);
}

template <HookId id>
[[gnu::noinline]] CUresult launch_cooperative_gated(CUfunction f, unsigned int grid_x, unsigned int grid_y,
                                                    unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                                    unsigned int block_z, unsigned int shared_bytes,
                                                    CUstream stream, void** params) {
  FRACGPU_GATED_LAUNCH(id, stream, f, f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, stream,
                       params);
}

template <HookId id>
CUresult launch_cooperative(CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                            unsigned int block_x, unsigned int block_y, unsigned int block_z,
                            unsigned int shared_bytes, CUstream stream, void** params) {
  return pass_or<id, launch_cooperative_gated<id>>(f, grid_x, grid_y, grid_z, block_x, block_y, block_z,
                                                   shared_bytes, stream, params);
}

// One kernel per device, each on a stream of that device's context: wait for
// each GPU in turn, always. A thread's pass is for its current context's GPU
// only, so it says nothing about the others. The GPUs are not held together
// (docs/sm-time.md).
template <HookId id>
CUresult launch_cooperative_multi_device(CUDA_LAUNCH_PARAMS* launches, unsigned int device_count, unsigned int flags) {
  for (unsigned int i = 0; launches != nullptr && i < device_count; ++i)
    if (const CUresult refused = wait_for_gpu_of_stream(launches[i].hStream); refused != CUDA_SUCCESS) return refused;
  auto fn = real<id>();
  return fn != nullptr ? fn(launches, device_count, flags) : CUDA_ERROR_NOT_FOUND;
}

// A graph whose allocation nodes take memory has it reserved first
// (graph_memory.h); every other graph launches as a kernel does. Either way
// a launch is paced beside a latency tenant.
template <HookId id>
[[gnu::noinline]] CUresult graph_launch_gated(CUgraphExec graph, CUstream stream) {
  if (g_graph_execs_with_memory.load(std::memory_order_relaxed) != 0) {
    bool paced = false;
    if (!launch_may_pass())
      if (const CUresult refused = wait_for_gpu(stream, &paced, graph); refused != CUDA_SUCCESS) return refused;
    const CUresult result = run_with_graph_memory(graph, stream, real<id>());
    if (paced && result == CUDA_SUCCESS) paced_launch_done(stream);
    return result;
  }
  FRACGPU_GATED_LAUNCH(id, stream, graph, graph, stream);
}

template <HookId id>
CUresult graph_launch(CUgraphExec graph, CUstream stream) {
  if (g_graph_execs_with_memory.load(std::memory_order_relaxed) != 0) [[unlikely]]
    return graph_launch_gated<id>(graph, stream);
  return pass_or<id, graph_launch_gated<id>>(graph, stream);
}

template <HookId id, class... Grid>
[[gnu::noinline]] CUresult legacy_launch_gated(CUfunction f, Grid... grid) {
  FRACGPU_GATED_LAUNCH(id, nullptr, f, f, grid...);
}

template <HookId id, class... Grid>
CUresult legacy_launch(CUfunction f, Grid... grid) {
  return pass_or<id, legacy_launch_gated<id, Grid...>>(f, grid...);
}

template <HookId id>
[[gnu::noinline]] CUresult legacy_launch_async_gated(CUfunction f, int grid_x, int grid_y, CUstream stream) {
  FRACGPU_GATED_LAUNCH(id, stream, f, f, grid_x, grid_y, stream);
}

template <HookId id>
CUresult legacy_launch_async(CUfunction f, int grid_x, int grid_y, CUstream stream) {
  return pass_or<id, legacy_launch_async_gated<id>>(f, grid_x, grid_y, stream);
}

#undef FRACGPU_GATED_LAUNCH

// A thread's launch pass is for the context current when it was issued.
template <HookId id, class Arg>
CUresult ctx_switch(Arg ctx) {
  invalidate_launch_pass();
  auto fn = real<id>();
  if (fn == nullptr && !load_real_driver()) return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
  fn = real<id>();
  return fn != nullptr ? fn(ctx) : CUDA_ERROR_NOT_FOUND;
}

}  // namespace fracgpu::interpose

// Memory quota hooks. Each is a template over the HookId it serves, so one
// implementation covers every versioned variant (v1 32-bit, _v2, _ptsz) and
// still calls exactly that variant's real function.
//
// The pattern everywhere: reserve in the ledger first, then allocate, then
// settle to what the driver really took; a refusal or a failed allocation
// leaves nothing charged. See docs/architecture.md.
#pragma once

#include <cuda.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "graph_memory.h"
#include "hook_table.h"
#include "launch_gate.h"
#include "tenant.h"

namespace fracgpu::interpose {

// Returned when the driver library cannot be loaded at all.
inline constexpr CUresult kNoDriver = CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
// Returned for GPU work in a process whose tenant ledger was refused.
inline constexpr CUresult kDenied = CUDA_ERROR_NOT_PERMITTED;

// Calls the real function of `id` with the hook's own arguments: for hooks
// with nothing to enforce in this process (unmanaged, passthrough).
#define FRACGPU_PASS(id, ...) (real<id>() ? real<id>()(__VA_ARGS__) : CUDA_ERROR_NOT_FOUND)

// ---- out-of-line helpers (memory.cpp) ----

// Records a charge; if the table is full, the caller must undo the allocation.
bool record_pointer(uint64_t key, const ChargeRecord& record);
bool record_handle(uint64_t key, const ChargeRecord& record);
bool forget_pointer(uint64_t key, ChargeRecord* out);
bool forget_handle(uint64_t key, ChargeRecord* out);
// Gives back every record of a destroyed context (the driver freed them).
void release_context_records(uint64_t ctx);

// Reserve `reserved` before the call; after it, make the charge `actual`.
// False if growing to `actual` was refused (the caller then undoes).
bool settle(int gpu, uint64_t reserved, uint64_t actual);

// Stream-ordered pool accounting (memory_pools.cpp explains the method).
CUresult pooled_alloc(CUmemoryPool pool, int gpu, size_t bytes, CUdeviceptr* dptr, CUstream stream,
                      CUresult (*alloc)(void*), void* alloc_state);
void pooled_free_done(const ChargeRecord& record);
void pool_settle(CUmemoryPool pool);
// Remembers where a created pool's memory lives (a GPU entry, or the host).
void pool_created(CUmemoryPool pool, const CUmemPoolProps& props);
// Around cuMemPoolDestroy: settles of the pool are held off during the call
// (its handle may name a new pool as soon as it returns); its charge goes
// back once no allocation from it is outstanding.
struct PoolDestroy {
  int index = -1;
};
PoolDestroy pool_destroy_begin(CUmemoryPool pool);
void pool_destroy_end(PoolDestroy destroy, bool destroyed);
bool pools_dirty();
// Settles the pools a free marked, and graph memory; never waits.
void settle_dirty_pools();
void reset_pools();

// VMM physical allocations (memory_vmm.cpp): charged while their handle or
// any mapping of them is alive.
bool vmm_created(CUmemGenericAllocationHandle handle, uint64_t bytes, int gpu);
bool vmm_ref(CUmemGenericAllocationHandle handle);
void vmm_unref(CUmemGenericAllocationHandle handle);
// After cuMemMap: records the mapping (false if it cannot, the caller undoes).
bool vmm_record_mapping(CUdeviceptr va, size_t bytes, CUmemGenericAllocationHandle handle);
// Before cuMemUnmap: takes up to `capacity` mapping records from *va on,
// advancing *va past them.
struct VmmMapping {
  CUdeviceptr va;
  ChargeRecord record;
};
int vmm_forget_mappings(CUdeviceptr* va, CUdeviceptr end, VmmMapping* out, int capacity);
void reset_vmm();

// Arrays: bytes the driver says the array takes, or 0 if it cannot tell.
uint64_t array_real_bytes(CUarray array, CUdevice device);
uint64_t mipmapped_real_bytes(CUmipmappedArray array, CUdevice device);
uint64_t array_estimate_bytes(const CUDA_ARRAY_DESCRIPTOR_v1& d);
uint64_t array_estimate_bytes(const CUDA_ARRAY_DESCRIPTOR& d);
uint64_t array_estimate_bytes(const CUDA_ARRAY3D_DESCRIPTOR_v1& d);
uint64_t array_estimate_bytes(const CUDA_ARRAY3D_DESCRIPTOR& d, unsigned levels = 1);

// cuCtxAttach's usage counts: context_attached counts one (false if there is
// no room to); context_detach_keeps takes one if any is left (the detach then
// leaves the context alive); context_attaches_forget drops a destroyed one's.
bool context_attached(CUcontext ctx);
bool context_detach_keeps(CUcontext ctx);
void context_attaches_forget(CUcontext ctx);

// Primary contexts: our own count of retains per device ordinal.
bool primary_retain_charge(CUdevice device, int gpu);
void primary_retain_failed(CUdevice device, int gpu);
void primary_retained(CUdevice device, CUcontext ctx);
void primary_released(CUdevice device, bool reset);

// Where enforcement is off, returns the passthrough/deny verdict; kManaged
// means go on and enforce.
inline TenantMode gate() {
  if (!load_real_driver()) [[unlikely]]
    return TenantMode::kDenied;
  return tenant_mode();
}

// The real call, then, if it succeeded in managed mode, `note(args...)`:
// for calls whose effect we only need to hear of (trims and destroys that
// give memory back, green contexts that make or free context handles).
template <HookId id, class Note, class... Args>
CUresult pass_then_note(Note note, Args... args) {
  TenantMode mode = gate();
  if (mode == TenantMode::kDenied) return kDenied;
  CUresult result = FRACGPU_PASS(id, args...);
  if (mode == TenantMode::kManaged && result == CUDA_SUCCESS) note(args...);
  return result;
}

// ---- linear memory ----

template <HookId id, class Ptr, class Size>
CUresult mem_alloc(Ptr* dptr, Size bytes) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr, bytes);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (!current_gpu_entry(&ctx, &device, &gpu)) return FRACGPU_PASS(id, dptr, bytes);  // driver reports it
  if (dptr == nullptr || bytes == 0) return FRACGPU_PASS(id, dptr, bytes);
  if (!reserve(gpu, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, dptr, bytes);
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, bytes);
    return result;
  }
  if (!record_pointer(*dptr, {bytes, reinterpret_cast<uint64_t>(ctx), static_cast<uint32_t>(gpu), ChargeKind::kLinear})) {
    real<HookId::cuMemFree_v2>()(*dptr);
    unreserve(gpu, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

template <HookId id, class Ptr, class Size>
CUresult mem_alloc_pitch(Ptr* dptr, Size* pitch, Size width, Size height, unsigned int element_bytes) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr, pitch, width, height, element_bytes);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (!current_gpu_entry(&ctx, &device, &gpu) || dptr == nullptr || pitch == nullptr || width == 0 || height == 0)
    return FRACGPU_PASS(id, dptr, pitch, width, height, element_bytes);
  // The pitch is the driver's choice: reserve a row padded to 512 bytes (the
  // largest texture pitch alignment in use), then settle to pitch * height.
  const uint64_t estimate = ((static_cast<uint64_t>(width) + 511) / 512) * 512 * height;
  if (!reserve(gpu, estimate)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, dptr, pitch, width, height, element_bytes);
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, estimate);
    return result;
  }
  const uint64_t actual = static_cast<uint64_t>(*pitch) * height;
  const bool settled = settle(gpu, estimate, actual);
  if (!settled ||
      !record_pointer(*dptr, {actual, reinterpret_cast<uint64_t>(ctx), static_cast<uint32_t>(gpu), ChargeKind::kLinear})) {
    real<HookId::cuMemFree_v2>()(*dptr);
    unreserve(gpu, settled ? actual : estimate);  // settle() moved the charge to `actual`; refusing, it left it
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

template <HookId id>
CUresult mem_alloc_managed(CUdeviceptr* dptr, size_t bytes, unsigned int flags) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr, bytes, flags);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (!current_gpu_entry(&ctx, &device, &gpu) || dptr == nullptr || bytes == 0) return FRACGPU_PASS(id, dptr, bytes, flags);
  uint32_t policy_flags = 0;
  if (gpu >= 0 && read_committed_gpu(gpu, [&](const ledger::GpuPolicy& e) {
        policy_flags = e.flags.load(std::memory_order_acquire);
      }) && !(policy_flags & ledger::kCountManagedMemory))
    return FRACGPU_PASS(id, dptr, bytes, flags);
  if (!reserve(gpu, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, dptr, bytes, flags);
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, bytes);
    return result;
  }
  if (!record_pointer(*dptr, {bytes, reinterpret_cast<uint64_t>(ctx), static_cast<uint32_t>(gpu), ChargeKind::kManaged})) {
    real<HookId::cuMemFree_v2>()(*dptr);
    unreserve(gpu, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

template <HookId id, class Ptr>
CUresult mem_free(Ptr dptr) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr);
  // Forget before freeing: once freed, the driver may hand the same address
  // to another thread, whose record must not be confused with ours.
  ChargeRecord record;
  const bool charged = forget_pointer(dptr, &record);
  CUresult result = FRACGPU_PASS(id, dptr);
  if (!charged) return result;
  if (result != CUDA_SUCCESS) {
    record_pointer(dptr, record);  // still allocated
    return result;
  }
  if (record.kind == ChargeKind::kAsync)
    pooled_free_done(record);
  else
    unreserve(static_cast<int>(record.gpu), record.bytes);
  return result;
}

// ---- stream-ordered allocation ----

// Into a capturing stream, a stream-ordered allocation becomes an allocation
// node of the graph: no pool grows, and the memory is charged when the graph
// is launched (graph_memory.h).
inline bool captures_graph_memory(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return g_driver.cuStreamIsCapturing != nullptr && g_driver.cuStreamIsCapturing(stream, &status) == CUDA_SUCCESS &&
         status == CU_STREAM_CAPTURE_STATUS_ACTIVE;
}

// The stream's context made current for a scope, where it is not already
// (a stream created in another context): the driver serves an allocation
// on a stream from the pool of the stream's device, not the current one's.
class StreamContextScope {
 public:
  explicit StreamContextScope(CUstream stream) {
    CUcontext current = nullptr, of_stream = nullptr;
    if (stream == nullptr || g_driver.cuStreamGetCtx == nullptr || g_driver.cuCtxGetCurrent == nullptr ||
        g_driver.cuCtxPushCurrent_v2 == nullptr || g_driver.cuCtxPopCurrent_v2 == nullptr ||
        g_driver.cuStreamGetCtx(stream, &of_stream) != CUDA_SUCCESS || of_stream == nullptr ||
        g_driver.cuCtxGetCurrent(&current) != CUDA_SUCCESS || current == of_stream)
      return;
    pushed_ = g_driver.cuCtxPushCurrent_v2(of_stream) == CUDA_SUCCESS;
  }
  ~StreamContextScope() {
    CUcontext popped = nullptr;
    if (pushed_) g_driver.cuCtxPopCurrent_v2(&popped);
  }
  StreamContextScope(const StreamContextScope&) = delete;
  StreamContextScope& operator=(const StreamContextScope&) = delete;

 private:
  bool pushed_ = false;
};

template <HookId id>
CUresult mem_alloc_async(CUdeviceptr* dptr, size_t bytes, CUstream stream) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr, bytes, stream);
  // Charged on the GPU whose pool serves it: the stream's.
  const StreamContextScope on_the_streams_context(stream);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  CUmemoryPool pool = nullptr;
  // (A driver without the call: FRACGPU_PASS answers CUDA_ERROR_NOT_FOUND.)
  if (real<id>() == nullptr || !current_gpu_entry(&ctx, &device, &gpu) || dptr == nullptr || bytes == 0 ||
      captures_graph_memory(stream))
    return FRACGPU_PASS(id, dptr, bytes, stream);
  // The pool the driver will allocate from: without it, nothing would say
  // what the allocation costs, so it is refused rather than let through.
  if (g_driver.cuDeviceGetMemPool == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  if (CUresult r = g_driver.cuDeviceGetMemPool(&pool, device); r != CUDA_SUCCESS) return r;
  struct Call {
    CUdeviceptr* dptr;
    size_t bytes;
    CUstream stream;
  } call{dptr, bytes, stream};
  return pooled_alloc(pool, gpu, bytes, dptr, stream, [](void* state) -> CUresult {
    auto* c = static_cast<Call*>(state);
    return real<id>()(c->dptr, c->bytes, c->stream);
  }, &call);
}

template <HookId id>
CUresult mem_alloc_from_pool_async(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr, bytes, pool, stream);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (real<id>() == nullptr || !current_gpu_entry(&ctx, &device, &gpu) || dptr == nullptr || bytes == 0 ||
      pool == nullptr || captures_graph_memory(stream))
    return FRACGPU_PASS(id, dptr, bytes, pool, stream);
  // The driver has no query for a pool's location: we note it when the pool
  // is created, and fall back to the current device for pools we did not see
  // (pooled_alloc).
  struct Call {
    CUdeviceptr* dptr;
    size_t bytes;
    CUmemoryPool pool;
    CUstream stream;
  } call{dptr, bytes, pool, stream};
  return pooled_alloc(pool, gpu, bytes, dptr, stream, [](void* state) -> CUresult {
    auto* c = static_cast<Call*>(state);
    return real<id>()(c->dptr, c->bytes, c->pool, c->stream);
  }, &call);
}

template <HookId id>
CUresult mem_free_async(CUdeviceptr dptr, CUstream stream) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, dptr, stream);
  ChargeRecord record;
  const bool charged = forget_pointer(dptr, &record);
  CUresult result = FRACGPU_PASS(id, dptr, stream);
  if (!charged) return result;
  if (result != CUDA_SUCCESS) {
    record_pointer(dptr, record);
    return result;
  }
  if (record.kind == ChargeKind::kAsync)
    pooled_free_done(record);
  else
    unreserve(static_cast<int>(record.gpu), record.bytes);  // cuMemFreeAsync of cuMemAlloc memory
  return result;
}

template <HookId id>
CUresult mem_pool_create(CUmemoryPool* pool, const CUmemPoolProps* props) {
  TenantMode mode = gate();
  if (mode == TenantMode::kDenied) return kDenied;
  CUresult result = FRACGPU_PASS(id, pool, props);
  if (mode == TenantMode::kManaged && result == CUDA_SUCCESS && props != nullptr) pool_created(*pool, *props);
  return result;
}

template <HookId id>
CUresult mem_pool_trim_to(CUmemoryPool pool, size_t keep_bytes) {
  return pass_then_note<id>([](CUmemoryPool p, size_t) { pool_settle(p); }, pool, keep_bytes);
}

template <HookId id>
CUresult mem_pool_destroy(CUmemoryPool pool) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, pool);
  const PoolDestroy destroy = pool_destroy_begin(pool);
  CUresult result = FRACGPU_PASS(id, pool);
  pool_destroy_end(destroy, result == CUDA_SUCCESS);
  return result;
}

// ---- graph memory (graph_memory.h) ----

template <HookId id, class... Rest>
CUresult graph_instantiate(CUgraphExec* exec, CUgraph graph, Rest... rest) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, exec, graph, rest...);
  CUresult result = FRACGPU_PASS(id, exec, graph, rest...);
  if (result != CUDA_SUCCESS || exec == nullptr) return result;
  const CUresult refusal = note_graph_exec(*exec, graph);
  if (refusal != CUDA_SUCCESS) {
    if (real<HookId::cuGraphExecDestroy>() != nullptr) real<HookId::cuGraphExecDestroy>()(*exec);
    *exec = nullptr;
    return refusal;
  }
  return result;
}

template <HookId id>
CUresult graph_upload(CUgraphExec exec, CUstream stream) {
  // Uploading backs the exec's allocations without running it.
  if (!load_real_driver()) [[unlikely]]
    return kNoDriver;
  if (g_graph_execs_with_memory.load(std::memory_order_relaxed) == 0) return FRACGPU_PASS(id, exec, stream);
  return run_with_graph_memory(exec, stream, real<id>());
}

template <HookId id>
CUresult graph_exec_destroy(CUgraphExec exec) {
  if (!load_real_driver()) [[unlikely]]
    return kNoDriver;
  const ForgottenGraphExec forgotten = forget_graph_exec(exec);
  CUresult result = FRACGPU_PASS(id, exec);
  graph_exec_destroyed(exec, forgotten, result == CUDA_SUCCESS);
  return result;
}

// CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD makes the driver upload the exec at
// once, backing its allocation nodes before anything here reserved them:
// the exec is instantiated without the flag, then uploaded as cuGraphUpload
// is (reserved first; past the quota refused, and no exec is left).
template <HookId id>
CUresult graph_instantiate_with_params(CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  if (params == nullptr || (params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) == 0 || gate() != TenantMode::kManaged)
    return graph_instantiate<id>(exec, graph, params);
  CUDA_GRAPH_INSTANTIATE_PARAMS plain = *params;
  plain.flags &= ~static_cast<cuuint64_t>(CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD);
  CUresult result = graph_instantiate<id>(exec, graph, &plain);
  params->hErrNode_out = plain.hErrNode_out;
  params->result_out = plain.result_out;
  if (result != CUDA_SUCCESS || exec == nullptr) return result;
  constexpr HookId upload =
      id == HookId::cuGraphInstantiateWithParams_ptsz ? HookId::cuGraphUpload_ptsz : HookId::cuGraphUpload;
  result = graph_upload<upload>(*exec, params->hUploadStream);
  if (result != CUDA_SUCCESS) {
    graph_exec_destroy<HookId::cuGraphExecDestroy>(*exec);
    *exec = nullptr;
    params->result_out = CUDA_GRAPH_INSTANTIATE_ERROR;
  }
  return result;
}

template <HookId id>
CUresult graph_mem_trim(CUdevice device) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, device);
  const GraphTrim trim = graph_trim_begin();
  CUresult result = FRACGPU_PASS(id, device);
  graph_trim_end(trim, device, result == CUDA_SUCCESS);
  return result;
}

template <HookId id, class... Args>
CUresult synchronize(Args... args) {
  // A thread waiting for its own kernels keeps its process active: the GPU
  // is busy with its work, so the GPU is not handed on as idle.
  g_threads_in_sync.fetch_add(1, std::memory_order_relaxed);
  CUresult result = FRACGPU_PASS(id, args...);
  g_threads_in_sync.fetch_sub(1, std::memory_order_relaxed);
  if (result == CUDA_SUCCESS && g_unsynced.load(std::memory_order_relaxed)) [[unlikely]]
    g_unsynced.store(false, std::memory_order_relaxed);
  if (g_latency_held.load(std::memory_order_relaxed)) [[unlikely]]
    kick_pacer();
  // Pools release memory above their threshold when synchronized: give the
  // charge back now. One relaxed load when no pool has anything to settle.
  if (result == CUDA_SUCCESS && pools_dirty()) [[unlikely]]
    settle_dirty_pools();
  return result;
}

// ---- virtual memory management ----

template <HookId id>
CUresult mem_create(CUmemGenericAllocationHandle* handle, size_t bytes, const CUmemAllocationProp* prop,
                    unsigned long long flags) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, handle, bytes, prop, flags);
  // Only device memory counts; host-located physical memory is not a GPU's.
  if (handle == nullptr || prop == nullptr || bytes == 0 || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return FRACGPU_PASS(id, handle, bytes, prop, flags);
  const int gpu = gpu_entry_for_device(prop->location.id);
  if (gpu < 0 && !device_exists(prop->location.id)) return FRACGPU_PASS(id, handle, bytes, prop, flags);  // its error
  if (!reserve(gpu, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, handle, bytes, prop, flags);
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, bytes);
    return result;
  }
  if (!vmm_created(*handle, bytes, gpu)) {
    real<HookId::cuMemRelease>()(*handle);
    unreserve(gpu, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

// The charge stays while a mapping or another reference keeps the memory.
template <HookId id>
CUresult mem_release(CUmemGenericAllocationHandle handle) {
  return pass_then_note<id>([](CUmemGenericAllocationHandle h) { vmm_unref(h); }, handle);
}

template <HookId id>
CUresult mem_retain_allocation_handle(CUmemGenericAllocationHandle* handle, void* addr) {
  return pass_then_note<id>([](CUmemGenericAllocationHandle* h, void*) { vmm_ref(*h); }, handle, addr);
}

template <HookId id>
CUresult mem_map(CUdeviceptr va, size_t bytes, size_t offset, CUmemGenericAllocationHandle handle,
                 unsigned long long flags) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, va, bytes, offset, handle, flags);
  CUresult result = FRACGPU_PASS(id, va, bytes, offset, handle, flags);
  if (result != CUDA_SUCCESS || vmm_record_mapping(va, bytes, handle)) return result;
  // Untracked, the mapping would keep memory alive after its charge went.
  real<HookId::cuMemUnmap>()(va, bytes);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

template <HookId id>
CUresult mem_unmap(CUdeviceptr va, size_t bytes) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, va, bytes);
  // Forget before unmapping (once unmapped, the addresses may be mapped
  // again by another thread); put back if the driver refuses.
  constexpr int kBatch = 64;
  VmmMapping taken[kBatch];
  CUdeviceptr next = va;
  const CUdeviceptr end = va + bytes;
  const int n = vmm_forget_mappings(&next, end, taken, kBatch);
  CUresult result = FRACGPU_PASS(id, va, bytes);
  if (result != CUDA_SUCCESS) {
    for (int i = 0; i < n; ++i) record_pointer(taken[i].va, taken[i].record);
    return result;
  }
  for (int i = 0; i < n; ++i) vmm_unref(static_cast<CUmemGenericAllocationHandle>(taken[i].record.owner));
  // More mappings than one batch: the rest are taken after the call.
  for (int more = n == kBatch ? kBatch : 0; more == kBatch;) {
    more = vmm_forget_mappings(&next, end, taken, kBatch);
    for (int i = 0; i < more; ++i) vmm_unref(static_cast<CUmemGenericAllocationHandle>(taken[i].record.owner));
  }
  return result;
}

// Tiles of sparse arrays mapped onto a physical allocation: an unmap names
// no handle, so a handle mapped this way stays charged for the process's
// life (never less than the driver holds).
template <HookId id>
CUresult mem_map_array_async(CUarrayMapInfo* infos, unsigned int count, CUstream stream) {
  return pass_then_note<id>(
      [](CUarrayMapInfo* list, unsigned int n, CUstream) {
        for (unsigned int i = 0; list != nullptr && i < n; ++i)
          if (list[i].memOperationType == CU_MEM_OPERATION_TYPE_MAP &&
              list[i].memHandleType == CU_MEM_HANDLE_TYPE_GENERIC)
            vmm_ref(list[i].memHandle.memHandle);
      },
      infos, count, stream);
}

// ---- arrays ----

template <HookId id, class Descriptor>
CUresult array_create(CUarray* array, const Descriptor* desc) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, array, desc);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (!current_gpu_entry(&ctx, &device, &gpu) || array == nullptr || desc == nullptr) return FRACGPU_PASS(id, array, desc);
  const uint64_t estimate = array_estimate_bytes(*desc);
  if (!reserve(gpu, estimate)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, array, desc);
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, estimate);
    return result;
  }
  uint64_t actual = array_real_bytes(*array, device);
  if (actual == 0) actual = estimate;
  const bool settled = settle(gpu, estimate, actual);
  if (!settled || !record_handle(reinterpret_cast<uint64_t>(*array),
                                 {actual, reinterpret_cast<uint64_t>(ctx), static_cast<uint32_t>(gpu), ChargeKind::kArray})) {
    real<HookId::cuArrayDestroy>()(*array);
    unreserve(gpu, settled ? actual : estimate);  // as in mem_alloc_pitch
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

template <HookId id, class Handle>
CUresult release_handle(Handle handle) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, handle);
  ChargeRecord record;
  const bool charged = forget_handle(reinterpret_cast<uint64_t>(handle), &record);
  CUresult result = FRACGPU_PASS(id, handle);
  if (!charged) return result;
  if (result != CUDA_SUCCESS) {
    record_handle(reinterpret_cast<uint64_t>(handle), record);
    return result;
  }
  unreserve(static_cast<int>(record.gpu), record.bytes);
  return result;
}

template <HookId id>
CUresult array_destroy(CUarray array) {
  return release_handle<id>(array);
}

template <HookId id>
CUresult mipmapped_array_create(CUmipmappedArray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc, unsigned int levels) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, array, desc, levels);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (!current_gpu_entry(&ctx, &device, &gpu) || array == nullptr || desc == nullptr || levels == 0)
    return FRACGPU_PASS(id, array, desc, levels);
  const uint64_t estimate = array_estimate_bytes(*desc, levels);
  if (!reserve(gpu, estimate)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, array, desc, levels);
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, estimate);
    return result;
  }
  uint64_t actual = mipmapped_real_bytes(*array, device);
  if (actual == 0) actual = estimate;
  const bool settled = settle(gpu, estimate, actual);
  if (!settled || !record_handle(reinterpret_cast<uint64_t>(*array), {actual, reinterpret_cast<uint64_t>(ctx),
                                                                      static_cast<uint32_t>(gpu), ChargeKind::kMipmapped})) {
    real<HookId::cuMipmappedArrayDestroy>()(*array);
    unreserve(gpu, settled ? actual : estimate);  // as in mem_alloc_pitch
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

template <HookId id>
CUresult mipmapped_array_destroy(CUmipmappedArray array) {
  return release_handle<id>(array);
}

// ---- contexts ----

// Every cuCtxCreate variant takes the device last.
template <class Last>
Last last_of(Last last) {
  return last;
}
template <class First, class... Rest>
auto last_of(First, Rest... rest) {
  return last_of(rest...);
}

template <HookId id, class... Args>
CUresult ctx_create(CUcontext* ctx, Args... args) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, ctx, args...);
  const CUdevice device = last_of(args...);
  const int gpu = gpu_entry_for_device(device);
  if (gpu < 0 && device_denied(device)) return kDenied;  // two tenants grant it
  if (ctx == nullptr || (gpu < 0 && !device_exists(device))) return FRACGPU_PASS(id, ctx, args...);
  const uint64_t footprint = gpu >= 0 ? gpu_policy(gpu).context_memory : 0;
  if (!reserve(gpu, footprint)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, ctx, args...);
  note_contexts_changed();
  if (result != CUDA_SUCCESS) {
    unreserve(gpu, footprint);
    return result;
  }
  if (!record_handle(reinterpret_cast<uint64_t>(*ctx), {footprint, reinterpret_cast<uint64_t>(*ctx),
                                                        static_cast<uint32_t>(gpu), ChargeKind::kContext})) {
    real<HookId::cuCtxDestroy_v2>()(*ctx);
    note_contexts_changed();
    unreserve(gpu, footprint);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

template <HookId id>
CUresult ctx_destroy(CUcontext ctx) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, ctx);
  gputime_forget_context(ctx);  // the pacer must not drain it any more
  ChargeRecord record;
  const bool charged = forget_handle(reinterpret_cast<uint64_t>(ctx), &record);
  CUresult result = FRACGPU_PASS(id, ctx);
  note_contexts_changed();
  if (result == CUDA_SUCCESS) context_attaches_forget(ctx);  // its handle may come back
  if (!charged) return result;
  if (result != CUDA_SUCCESS) {
    record_handle(reinterpret_cast<uint64_t>(ctx), record);
    return result;
  }
  unreserve(static_cast<int>(record.gpu), record.bytes);
  release_context_records(reinterpret_cast<uint64_t>(ctx));
  return result;
}

// cuCtxAttach raises a context's usage count, cuCtxDetach lowers it and
// destroys the context at zero: a detach of a context attached more often
// than detached leaves it alive (and charged), any other is a destroy.
template <HookId id>
CUresult ctx_attach(CUcontext* ctx, unsigned int flags) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, ctx, flags);
  CUresult result = FRACGPU_PASS(id, ctx, flags);
  if (result != CUDA_SUCCESS || ctx == nullptr || context_attached(*ctx)) return result;
  // Uncounted, a later detach would be taken for a destroy: undo.
  if (real<HookId::cuCtxDetach>() != nullptr) real<HookId::cuCtxDetach>()(*ctx);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

template <HookId id>
CUresult ctx_detach(CUcontext ctx) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, ctx);
  if (!context_detach_keeps(ctx)) return ctx_destroy<id>(ctx);
  CUresult result = FRACGPU_PASS(id, ctx);
  if (result != CUDA_SUCCESS) context_attached(ctx);  // still attached
  return result;
}

template <HookId id>
CUresult primary_ctx_retain(CUcontext* ctx, CUdevice device) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, ctx, device);
  if (ctx == nullptr || device < 0 || device >= kMaxDevices) return FRACGPU_PASS(id, ctx, device);
  const int gpu = gpu_entry_for_device(device);
  if (gpu < 0 && device_denied(device)) return kDenied;  // two tenants grant it
  if (gpu < 0 && !device_exists(device)) return FRACGPU_PASS(id, ctx, device);  // the driver's error
  if (!primary_retain_charge(device, gpu)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult result = FRACGPU_PASS(id, ctx, device);
  note_contexts_changed();
  if (result != CUDA_SUCCESS) {
    primary_retain_failed(device, gpu);
    return result;
  }
  primary_retained(device, *ctx);
  return result;
}

template <HookId id>
CUresult primary_ctx_release(CUdevice device) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, device);
  gputime_forget_device(device);  // the last release destroys the context; the next launch notes it again
  CUresult result = FRACGPU_PASS(id, device);
  note_contexts_changed();
  if (result == CUDA_SUCCESS && device >= 0 && device < kMaxDevices) primary_released(device, false);
  return result;
}

template <HookId id>
CUresult primary_ctx_reset(CUdevice device) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, device);
  gputime_forget_device(device);
  CUresult result = FRACGPU_PASS(id, device);
  note_contexts_changed();
  if (result == CUDA_SUCCESS && device >= 0 && device < kMaxDevices) primary_released(device, true);
  return result;
}

// Green contexts are not charged a footprint: what one takes on the device
// (on top of the primary context the driver retains for it) is unknown and
// has not been measured, and a configured guess would be charged on every
// create. They still make and free CUcontext handles (cuCtxFromGreenCtx),
// which the per-thread context -> device cache and the pacer must hear of.
template <HookId id>
CUresult green_ctx_create(CUgreenCtx* green, CUdevResourceDesc desc, CUdevice device, unsigned int flags) {
  return pass_then_note<id>([](auto...) { note_contexts_changed(); }, green, desc, device, flags);
}

template <HookId id>
CUresult green_ctx_destroy(CUgreenCtx green) {
  CUcontext ctx = nullptr;
  if (gate() == TenantMode::kManaged && g_driver.cuCtxFromGreenCtx != nullptr &&
      g_driver.cuCtxFromGreenCtx(&ctx, green) == CUDA_SUCCESS)
    gputime_forget_context(ctx);  // the pacer must not drain it any more
  return pass_then_note<id>([](CUgreenCtx) { note_contexts_changed(); }, green);
}

// ---- what the tenant sees ----

// Quota as total; quota minus the tenant's use as free, never more than the
// device really has free. No quota: the real figures. No grant: nothing.
bool tenant_memory_view(int gpu, uint64_t real_free, uint64_t real_total, uint64_t* free_bytes, uint64_t* total_bytes);

template <class T>
T clamp_to(uint64_t v) {
  if constexpr (sizeof(T) < sizeof(uint64_t)) return v > UINT_MAX ? static_cast<T>(UINT_MAX) : static_cast<T>(v);
  return static_cast<T>(v);
}

template <HookId id, class Size>
CUresult mem_get_info(Size* free_bytes, Size* total_bytes) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, free_bytes, total_bytes);
  // Ask the driver in 64 bits, whatever width the caller uses.
  size_t real_free = 0, real_total = 0;
  CUresult result = real<HookId::cuMemGetInfo_v2>() ? real<HookId::cuMemGetInfo_v2>()(&real_free, &real_total)
                                                    : CUDA_ERROR_NOT_FOUND;
  if (result != CUDA_SUCCESS) return FRACGPU_PASS(id, free_bytes, total_bytes);
  CUcontext ctx;
  CUdevice device;
  int gpu;
  if (!current_gpu_entry(&ctx, &device, &gpu)) return FRACGPU_PASS(id, free_bytes, total_bytes);
  if (pools_dirty()) settle_dirty_pools();
  uint64_t free64 = real_free, total64 = real_total;
  tenant_memory_view(gpu, real_free, real_total, &free64, &total64);
  if (free_bytes) *free_bytes = clamp_to<Size>(free64);
  if (total_bytes) *total_bytes = clamp_to<Size>(total64);
  return CUDA_SUCCESS;
}

template <HookId id, class Size>
CUresult device_total_mem(Size* bytes, CUdevice device) {
  TenantMode mode = gate();
  if (mode != TenantMode::kManaged) [[unlikely]]
    return mode == TenantMode::kDenied ? kDenied : FRACGPU_PASS(id, bytes, device);
  size_t real_total = 0;
  CUresult result = real<HookId::cuDeviceTotalMem_v2>() ? real<HookId::cuDeviceTotalMem_v2>()(&real_total, device)
                                                        : CUDA_ERROR_NOT_FOUND;
  if (result != CUDA_SUCCESS || bytes == nullptr) return FRACGPU_PASS(id, bytes, device);
  uint64_t free64 = 0, total64 = real_total;
  tenant_memory_view(gpu_entry_for_device(device), real_total, real_total, &free64, &total64);
  *bytes = clamp_to<Size>(total64);
  return CUDA_SUCCESS;
}

}  // namespace fracgpu::interpose

// Device memory: linear allocations, copies, stream-ordered pools, VMM, arrays.
// Every byte charged here goes through charge()/uncharge() (state.cpp), the
// sim's own books and the tests' ground truth.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>

#include "sim_internal.h"

using namespace simcuda;

namespace {

// a*b, or false on overflow.
bool mul_ok(uint64_t a, uint64_t b, uint64_t& out) {
  if (a != 0 && b > UINT64_MAX / a) return false;
  out = a * b;
  return true;
}

// ---------------------------------------------------------------------------
// Linear allocations
// ---------------------------------------------------------------------------

CUresult alloc_linear(CUdeviceptr* out, uint64_t size, uint64_t charged, AllocKind kind, bool va32) {
  Process& P = proc();
  if (out == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  if (CUresult r = charge(c->dev, charged)) return r;
  CUdeviceptr p = va32 ? reserve_va32(size) : reserve_va(size, kPtrAlign);
  if (p == 0) {
    uncharge(c->dev, charged);
    // The 32-bit entry points can only hand out addresses below 4 GiB.
    return va32 ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_OUT_OF_MEMORY;
  }
  Alloc a;
  a.size = size;
  a.charged = charged;
  a.dev = c->dev;
  a.kind = kind;
  a.ctx = c;
  P.allocs[p] = a;
  *out = p;
  return CUDA_SUCCESS;
}

CUresult free_at(CUdeviceptr p) {
  Process& P = proc();
  auto it = P.allocs.find(p);
  if (p == 0 || it == P.allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  Alloc a = it->second;
  P.allocs.erase(it);
  if (a.kind == AllocKind::PoolBlock) pool_free_block(a.pool, a.block);
  else uncharge(a.dev, a.charged);
  return CUDA_SUCCESS;
}

// The allocation containing p, or null.
const std::pair<const CUdeviceptr, Alloc>* find_containing(CUdeviceptr p) {
  Process& P = proc();
  auto it = P.allocs.upper_bound(p);
  if (it == P.allocs.begin()) return nullptr;
  --it;
  if (p - it->first < it->second.size) return &*it;
  return nullptr;
}

const std::pair<const CUdeviceptr, Mapping>* find_mapping(CUdeviceptr p) {
  Process& P = proc();
  auto it = P.mappings.upper_bound(p);
  if (it == P.mappings.begin()) return nullptr;
  --it;
  if (p - it->first < it->second.size) return &*it;
  return nullptr;
}

// [p, p+n) lies inside one allocation or one VMM mapping.
bool device_range_ok(CUdeviceptr p, uint64_t n) {
  if (const auto* a = find_containing(p)) return n <= a->second.size - (p - a->first);
  if (const auto* m = find_mapping(p)) return n <= m->second.size - (p - m->first);
  return false;
}

CUresult mem_get_info(uint64_t& free_bytes, uint64_t& total) {
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  StateLock lock;
  total = S()->devices[c->dev].capacity;
  uint64_t used = sum_live_locked(c->dev);
  free_bytes = used >= total ? 0 : total - used;
  return CUDA_SUCCESS;
}

CUresult get_address_range(CUdeviceptr p, uint64_t& base, uint64_t& size) {
  if (const auto* a = find_containing(p)) {
    base = a->first;
    size = a->second.size;
    return CUDA_SUCCESS;
  }
  if (const auto* m = find_mapping(p)) {
    base = m->first;
    size = m->second.size;
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_NOT_FOUND;
}

CUresult check_advise(CUdeviceptr p, size_t count, CUmem_advise advice) {
  if (count == 0 || advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY)
    return CUDA_ERROR_INVALID_VALUE;
  const auto* a = find_containing(p);
  // Advice applies to managed memory only.
  if (a == nullptr || a->second.kind != AllocKind::Managed || count > a->second.size - (p - a->first))
    return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// ---- Copies and memsets: validated, timed on the stream, no data moves ----

CUresult copy_op(Guard& guard, CUdeviceptr dptr, const void* host, uint64_t bytes, CUstream stream, bool ptds,
                 bool wait) {
  if (bytes == 0) return CUDA_SUCCESS;
  if (host == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!device_range_ok(dptr, bytes)) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, ptds, t)) return r;
  guard.unlock();
  const Mark end = enqueue_copy(t, copy_duration_ns(bytes));
  if (wait) wait_mark(t.dev, end);  // synchronous copies return when the stream's work is done
  return CUDA_SUCCESS;
}

CUresult memset_op(Guard& guard, CUdeviceptr dptr, uint64_t bytes, unsigned align, bool ptds) {
  if (dptr % align != 0) return CUDA_ERROR_INVALID_VALUE;
  if (bytes == 0) return CUDA_SUCCESS;
  if (!device_range_ok(dptr, bytes)) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(nullptr, ptds, t)) return r;
  guard.unlock();
  enqueue_copy(t, copy_duration_ns(bytes));  // async with respect to the host, like the driver
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Pools
// ---------------------------------------------------------------------------

Pool* new_pool(int dev, bool is_default) {
  Process& P = proc();
  auto p = std::make_unique<Pool>();
  p->dev = dev;
  p->is_default = is_default;
  Pool* raw = p.get();
  P.pools[raw] = std::move(p);
  return raw;
}

// Releases reserved-but-unused chunks down to `target` bytes (a multiple of
// kChunk); the reservation never drops below the chunks live blocks need.
void pool_shrink(Pool* p, uint64_t target) {
  uint64_t keep = std::max(round_up(p->used, kChunk), target);
  if (keep < p->reserved) {
    uncharge(p->dev, p->reserved - keep);
    p->reserved = keep;
  }
}

void pool_erase(Pool* p) {
  Process& P = proc();
  uncharge(p->dev, p->reserved);
  P.pools.erase(p);
}

CUresult pool_alloc(Pool* pool, uint64_t bytes, CUdeviceptr* out) {
  Process& P = proc();
  uint64_t block = round_up(bytes, kPtrAlign);
  if (block < bytes) return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t need = pool->used + block;
  if (need < pool->used) return CUDA_ERROR_OUT_OF_MEMORY;
  CUdeviceptr p = reserve_va(block, kPtrAlign);
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (need > pool->reserved) {
    // Grow the reservation to the next chunk boundary of what is in use.
    uint64_t grown = round_up(need, kChunk);
    if (grown < need || (pool->max_size != 0 && grown > pool->max_size)) return CUDA_ERROR_OUT_OF_MEMORY;
    if (CUresult r = charge(pool->dev, grown - pool->reserved)) return r;
    pool->reserved = grown;
    pool->reserved_high = std::max(pool->reserved_high, grown);
  }
  pool->used = need;
  pool->used_high = std::max(pool->used_high, need);
  Alloc a;
  a.size = bytes;
  a.block = block;
  a.dev = pool->dev;
  a.kind = AllocKind::PoolBlock;
  a.pool = pool;
  P.allocs[p] = a;
  *out = p;
  return CUDA_SUCCESS;
}

// On a capturing stream an allocation becomes a memory-alloc node of the
// capture graph, on the stream's device (whatever pool was named): no pool
// changes and nothing is charged until an exec of the graph runs.
CUresult capture_alloc(Graph* capture, int dev, uint64_t bytes, CUdeviceptr* out) {
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = dev;
  GraphNode* n = add_mem_alloc_node(capture, props, bytes);
  if (n == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  *out = n->alloc.dptr;
  return CUDA_SUCCESS;
}

CUresult alloc_async(CUdeviceptr* dptr, size_t bytes, Pool* pool, CUstream stream, bool ptds) {
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, ptds, t)) return r;
  if (Graph* capture = t.capture_graph()) return capture_alloc(capture, t.dev, bytes, dptr);
  if (pool == nullptr) pool = current_pool(t.dev);
  return pool_alloc(pool, bytes, dptr);
}

CUresult free_async(CUdeviceptr dptr, CUstream stream, bool ptds) {
  StreamTarget t;
  if (CUresult r = resolve_stream(stream, ptds, t)) return r;
  if (is_graph_allocation(dptr)) {
    // Captured, a memory-free node. Outside a capture there is nothing to
    // do: graph memory belongs to execs, not to the allocation, in the sim.
    if (Graph* capture = t.capture_graph()) add_mem_free_node(capture, dptr);
    return CUDA_SUCCESS;
  }
  // Freed blocks return to their pool at once (the sim has no stream-ordered
  // reuse hazards to model); linear memory may be freed this way too.
  return free_at(dptr);
}

bool valid_mem_location(const CUmemLocation& loc, int& dev) {
  dev = -1;
  switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      dev = loc.id;
      return take_ordinal(dev);
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      return true;
    default:
      return false;
  }
}

// ---------------------------------------------------------------------------
// VMM
// ---------------------------------------------------------------------------

CUresult check_alloc_prop(const CUmemAllocationProp* prop, int& dev) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_mem_location(prop->location, dev))
    return prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// Physical memory goes with the last reference: released and unmapped.
void phys_maybe_free(CUmemGenericAllocationHandle h) {
  Process& P = proc();
  auto it = P.phys.find(h);
  if (it == P.phys.end() || !it->second.released || it->second.maps != 0) return;
  if (it->second.dev >= 0) {
    uncharge(it->second.dev, it->second.charged);
    P.dev[it->second.dev].vmm_bytes -= it->second.charged;
  }
  P.phys.erase(it);
}

void phys_unmap(CUmemGenericAllocationHandle h) {
  Process& P = proc();
  auto it = P.phys.find(h);
  if (it == P.phys.end()) return;
  if (it->second.maps > 0) --it->second.maps;
  phys_maybe_free(h);
}

// Mappings overlapping [p, p+size): they must lie fully inside and cover it
// exactly, or the call is invalid.
bool mappings_cover(CUdeviceptr p, uint64_t size, std::vector<CUdeviceptr>& found) {
  Process& P = proc();
  found.clear();
  uint64_t end = p + size;
  if (end < p) return false;
  auto it = P.mappings.upper_bound(p);
  if (it != P.mappings.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.size > p) it = prev;
  }
  uint64_t cursor = p;
  for (; it != P.mappings.end() && it->first < end; ++it) {
    if (it->first != cursor || it->second.size > end - it->first) return false;
    found.push_back(it->first);
    cursor += it->second.size;
  }
  return cursor == end && !found.empty();
}

// ---------------------------------------------------------------------------
// Arrays
// ---------------------------------------------------------------------------

// Bytes of one component, or 0 for a format the sim does not model.
// `channels_fixed` is set for the packed formats whose name fixes the count.
uint64_t component_bytes(CUarray_format f, unsigned& channels_fixed) {
  channels_fixed = 0;
  switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X1: channels_fixed = 1; return 1;
    case CU_AD_FORMAT_UNORM_INT8X2:
    case CU_AD_FORMAT_SNORM_INT8X2: channels_fixed = 2; return 1;
    case CU_AD_FORMAT_UNORM_INT8X4:
    case CU_AD_FORMAT_SNORM_INT8X4: channels_fixed = 4; return 1;
    case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1: channels_fixed = 1; return 2;
    case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X2: channels_fixed = 2; return 2;
    case CU_AD_FORMAT_UNORM_INT16X4:
    case CU_AD_FORMAT_SNORM_INT16X4: channels_fixed = 4; return 2;
    default: return 0;
  }
}

// The array size rule (README): the sum over mipmap levels of
// width*height*depth*channels*component_bytes (height/depth 0 count as 1;
// each level halves width/height, and depth unless layered or cubemap,
// never below 1), rounded up to 2 MiB. A plain array is one level.
CUresult array_size(const CUDA_ARRAY3D_DESCRIPTOR& d, unsigned levels, uint64_t& bytes) {
  if (d.Width == 0) return CUDA_ERROR_INVALID_VALUE;
  unsigned fixed = 0;
  uint64_t comp = component_bytes(d.Format, fixed);
  if (comp == 0) return CUDA_ERROR_NOT_SUPPORTED;
  if (d.NumChannels != 1 && d.NumChannels != 2 && d.NumChannels != 4) return CUDA_ERROR_INVALID_VALUE;
  if (fixed != 0 && d.NumChannels != fixed) return CUDA_ERROR_INVALID_VALUE;
  if (d.Height == 0 && d.Depth != 0 && (d.Flags & CUDA_ARRAY3D_LAYERED) == 0) return CUDA_ERROR_INVALID_VALUE;
  if (d.Flags & CUDA_ARRAY3D_CUBEMAP) {
    bool layered = (d.Flags & CUDA_ARRAY3D_LAYERED) != 0;
    if (d.Width != d.Height || d.Depth == 0 || (layered ? d.Depth % 6 != 0 : d.Depth != 6))
      return CUDA_ERROR_INVALID_VALUE;
  }
  bool depth_halves = (d.Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) == 0;
  uint64_t total = 0;
  for (unsigned l = 0; l < levels; ++l) {
    uint64_t w = std::max<uint64_t>(d.Width >> l, 1);
    uint64_t h = d.Height == 0 ? 1 : std::max<uint64_t>(d.Height >> l, 1);
    uint64_t z = d.Depth == 0 ? 1 : (depth_halves ? std::max<uint64_t>(d.Depth >> l, 1) : d.Depth);
    uint64_t v = 0;
    if (!mul_ok(w, h, v) || !mul_ok(v, z, v) || !mul_ok(v, d.NumChannels * comp, v) || total + v < total)
      return CUDA_ERROR_OUT_OF_MEMORY;
    total += v;
  }
  bytes = round_up(total, kChunk);
  if (bytes < total) return CUDA_ERROR_OUT_OF_MEMORY;
  return CUDA_SUCCESS;
}

unsigned max_mip_levels(const CUDA_ARRAY3D_DESCRIPTOR& d) {
  uint64_t m = std::max<uint64_t>(d.Width, d.Height);
  bool depth_counts = (d.Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) == 0;
  if (depth_counts) m = std::max<uint64_t>(m, d.Depth);
  unsigned n = 0;
  while (m > 0) {
    ++n;
    m >>= 1;
  }
  return n;
}

CUresult array_create(std::unordered_map<const void*, std::unique_ptr<Array>>& table, void** out,
                      const CUDA_ARRAY3D_DESCRIPTOR& desc, bool is3d, unsigned levels) {
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  auto a = std::make_unique<Array>();
  a->desc = desc;
  a->is3d = is3d;
  a->levels = levels;
  a->dev = c->dev;
  a->ctx = c;
  if (CUresult r = array_size(desc, levels, a->bytes)) return r;
  // Sparse and deferred-mapping arrays own no memory until mapped.
  bool backed = (desc.Flags & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING)) == 0;
  a->charged = backed ? a->bytes : 0;
  if (CUresult r = charge(c->dev, a->charged)) return r;
  *out = a.get();
  table[a.get()] = std::move(a);
  return CUDA_SUCCESS;
}

CUresult array_create_2d(CUarray* out, size_t w, size_t h, CUarray_format f, unsigned ch) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = w;
  d.Height = h;
  d.Format = f;
  d.NumChannels = ch;
  void* h_out = nullptr;
  CUresult r = array_create(proc().arrays, &h_out, d, false, 1);
  if (r == CUDA_SUCCESS) *out = static_cast<CUarray>(h_out);
  return r;
}

CUresult array_create_3d(CUarray* out, const CUDA_ARRAY3D_DESCRIPTOR& d) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  void* h_out = nullptr;
  CUresult r = array_create(proc().arrays, &h_out, d, true, 1);
  if (r == CUDA_SUCCESS) *out = static_cast<CUarray>(h_out);
  return r;
}

Array* find_array(CUarray a) {
  auto& t = proc().arrays;
  auto it = t.find(key(a));
  return it == t.end() ? nullptr : it->second.get();
}

Array* find_mipmap(CUmipmappedArray a) {
  auto& t = proc().mipmaps;
  auto it = t.find(key(a));
  return it == t.end() ? nullptr : it->second.get();
}

CUresult destroy_in(std::unordered_map<const void*, std::unique_ptr<Array>>& table, const void* h) {
  auto it = table.find(h);
  if (it == table.end()) return CUDA_ERROR_INVALID_HANDLE;
  uncharge(it->second->dev, it->second->charged);
  table.erase(it);
  return CUDA_SUCCESS;
}

CUresult fill_requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS* req, const Array* a, CUdevice dev) {
  if (req == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (a == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::memset(req, 0, sizeof *req);
  req->size = a->bytes;
  req->alignment = kChunk;
  return CUDA_SUCCESS;
}

}  // namespace

namespace simcuda {

Pool* default_pool(int dev) {
  Process& P = proc();
  if (P.dev[dev].default_pool == nullptr) P.dev[dev].default_pool = new_pool(dev, true);
  return P.dev[dev].default_pool;
}

Pool* current_pool(int dev) {
  Process& P = proc();
  return P.dev[dev].current_pool != nullptr ? P.dev[dev].current_pool : default_pool(dev);
}

Pool* find_pool(CUmemoryPool h) {
  Process& P = proc();
  auto it = P.pools.find(key(h));
  if (it == P.pools.end() || it->second->destroyed) return nullptr;
  return it->second.get();
}

void pool_free_block(Pool* pool, uint64_t block) {
  pool->used -= std::min(pool->used, block);
  if (pool->destroyed) {
    // A destroyed pool gives memory back as soon as blocks come back.
    pool_shrink(pool, 0);
    if (pool->used == 0) pool_erase(pool);
  }
}

// At cuStreamSynchronize / cuEventSynchronize / cuCtxSynchronize: every pool
// of this process on the device releases reserved-but-unused chunks while it
// holds more than its release threshold.
void pools_release_at_sync(int dev) {
  Process& P = proc();
  for (auto& [h, p] : P.pools) {
    if (p->dev != dev || p->destroyed || p->reserved <= p->release_threshold) continue;
    pool_shrink(p.get(), round_down(p->release_threshold, kChunk));
  }
}

// Per device: take what the graph memory pool has reserved but unused,
// charge the rest. All or nothing: on OUT_OF_MEMORY the devices already
// grown give their growth back.
CUresult back_graph_exec(GraphExec* e) {
  Process& P = proc();
  if (e->backed) return CUDA_SUCCESS;
  uint64_t grown[kMaxDevices] = {};
  for (int d = 0; d < kMaxDevices; ++d) {
    GraphMemPool& pool = P.dev[d].graph_mem;
    uint64_t need = e->graph_mem[d];
    uint64_t grow = need - std::min(need, pool.reserved - pool.used);
    if (CUresult r = charge(d, grow)) {
      for (int g = 0; g < d; ++g) {
        uncharge(g, grown[g]);
        P.dev[g].graph_mem.reserved -= grown[g];
      }
      return r;
    }
    grown[d] = grow;
    pool.reserved += grow;
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    GraphMemPool& pool = P.dev[d].graph_mem;
    pool.used += e->graph_mem[d];
    pool.used_high = std::max(pool.used_high, pool.used);
    pool.reserved_high = std::max(pool.reserved_high, pool.reserved);
  }
  e->backed = true;
  return CUDA_SUCCESS;
}

void unback_graph_exec(GraphExec* e) {
  Process& P = proc();
  if (!e->backed) return;
  for (int d = 0; d < kMaxDevices; ++d) {
    GraphMemPool& pool = P.dev[d].graph_mem;
    pool.used -= std::min(pool.used, e->graph_mem[d]);
  }
  e->backed = false;
}

}  // namespace simcuda

extern "C" {

// ---------------------------------------------------------------------------
// Linear memory
// ---------------------------------------------------------------------------

CUresult cuMemAlloc(CUdeviceptr_v1* dptr, unsigned int bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemAlloc);
  if (dptr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr p = 0;
  CUresult r = alloc_linear(&p, bytes, bytes, AllocKind::Linear32, true);
  if (r == CUDA_SUCCESS) *dptr = static_cast<CUdeviceptr_v1>(p);
  return r;
}

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemAlloc_v2);
  return alloc_linear(dptr, bytes, bytes, AllocKind::Linear, false);
}

CUresult cuMemAllocPitch(CUdeviceptr_v1* dptr, unsigned int* pitch, unsigned int width, unsigned int height,
                         unsigned int element_bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocPitch);
  if (dptr == nullptr || pitch == nullptr || width == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
  if (element_bytes != 4 && element_bytes != 8 && element_bytes != 16) return CUDA_ERROR_INVALID_VALUE;
  uint64_t p = round_up(width, kPitchAlign), bytes = 0;
  if (!mul_ok(p, height, bytes) || p > UINT_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
  CUdeviceptr out = 0;
  CUresult r = alloc_linear(&out, bytes, bytes, AllocKind::Linear32, true);
  if (r != CUDA_SUCCESS) return r;
  *dptr = static_cast<CUdeviceptr_v1>(out);
  *pitch = static_cast<unsigned int>(p);
  return CUDA_SUCCESS;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch, size_t width, size_t height,
                            unsigned int element_bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocPitch_v2);
  if (dptr == nullptr || pitch == nullptr || width == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
  if (element_bytes != 4 && element_bytes != 8 && element_bytes != 16) return CUDA_ERROR_INVALID_VALUE;
  uint64_t p = round_up(width, kPitchAlign), bytes = 0;
  if (p < width || !mul_ok(p, height, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult r = alloc_linear(dptr, bytes, bytes, AllocKind::Pitch, false);
  if (r == CUDA_SUCCESS) *pitch = p;
  return r;
}

CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytes, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocManaged);
  if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
  // Charged in full to the current device, as if resident there.
  return alloc_linear(dptr, bytes, bytes, AllocKind::Managed, false);
}

CUresult cuMemFree(CUdeviceptr_v1 dptr) {
  SIMCUDA_LOCKED_ENTRY(cuMemFree);
  return free_at(dptr);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  SIMCUDA_LOCKED_ENTRY(cuMemFree_v2);
  return free_at(dptr);
}

CUresult cuMemGetInfo(unsigned int* free_bytes, unsigned int* total_bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemGetInfo);
  if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  uint64_t f = 0, t = 0;
  if (CUresult r = mem_get_info(f, t)) return r;
  *free_bytes = static_cast<unsigned int>(std::min<uint64_t>(f, UINT_MAX));  // 32-bit ABI saturates
  *total_bytes = static_cast<unsigned int>(std::min<uint64_t>(t, UINT_MAX));
  return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemGetInfo_v2);
  if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  uint64_t f = 0, t = 0;
  if (CUresult r = mem_get_info(f, t)) return r;
  *free_bytes = f;
  *total_bytes = t;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange(CUdeviceptr_v1* base, unsigned int* size, CUdeviceptr_v1 dptr) {
  SIMCUDA_LOCKED_ENTRY(cuMemGetAddressRange);
  uint64_t b = 0, s = 0;
  if (CUresult r = get_address_range(dptr, b, s)) return r;
  if (base != nullptr) *base = static_cast<CUdeviceptr_v1>(b);
  if (size != nullptr) *size = static_cast<unsigned int>(std::min<uint64_t>(s, UINT_MAX));
  return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr dptr) {
  SIMCUDA_LOCKED_ENTRY(cuMemGetAddressRange_v2);
  uint64_t b = 0, s = 0;
  if (CUresult r = get_address_range(dptr, b, s)) return r;
  if (base != nullptr) *base = b;
  if (size != nullptr) *size = s;
  return CUDA_SUCCESS;
}

CUresult cuMemAdvise(CUdeviceptr dptr, size_t count, CUmem_advise advice, CUdevice device) {
  SIMCUDA_LOCKED_ENTRY(cuMemAdvise);
  if (CUresult r = check_advise(dptr, count, advice)) return r;
  if (device != CU_DEVICE_CPU && !take_ordinal(device)) return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

CUresult cuMemAdvise_v2(CUdeviceptr dptr, size_t count, CUmem_advise advice, CUmemLocation location) {
  SIMCUDA_LOCKED_ENTRY(cuMemAdvise_v2);
  if (CUresult r = check_advise(dptr, count, advice)) return r;
  bool needs_location = advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION || advice == CU_MEM_ADVISE_SET_ACCESSED_BY ||
                        advice == CU_MEM_ADVISE_UNSET_ACCESSED_BY;
  int dev = -1;
  if (needs_location && !valid_mem_location(location, dev))
    return location.type == CU_MEM_LOCATION_TYPE_DEVICE ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Copies and memsets
// ---------------------------------------------------------------------------

CUresult cuMemcpyHtoD(CUdeviceptr_v1 dst, const void* src, unsigned int bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyHtoD);
  return copy_op(guard_, dst, src, bytes, nullptr, false, true);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyHtoD_v2);
  return copy_op(guard_, dst, src, bytes, nullptr, false, true);
}

CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void* src, size_t bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyHtoD_v2_ptds);
  return copy_op(guard_, dst, src, bytes, nullptr, true, true);
}

CUresult cuMemcpyDtoH(void* dst, CUdeviceptr_v1 src, unsigned int bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyDtoH);
  return copy_op(guard_, src, dst, bytes, nullptr, false, true);
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyDtoH_v2);
  return copy_op(guard_, src, dst, bytes, nullptr, false, true);
}

CUresult cuMemcpyDtoH_v2_ptds(void* dst, CUdeviceptr src, size_t bytes) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyDtoH_v2_ptds);
  return copy_op(guard_, src, dst, bytes, nullptr, true, true);
}

CUresult cuMemcpyHtoDAsync(CUdeviceptr_v1 dst, const void* src, unsigned int bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyHtoDAsync);
  return copy_op(guard_, dst, src, bytes, stream, false, false);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyHtoDAsync_v2);
  return copy_op(guard_, dst, src, bytes, stream, false, false);
}

CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyHtoDAsync_v2_ptsz);
  return copy_op(guard_, dst, src, bytes, stream, true, false);
}

CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr_v1 src, unsigned int bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyDtoHAsync);
  return copy_op(guard_, src, dst, bytes, stream, false, false);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyDtoHAsync_v2);
  return copy_op(guard_, src, dst, bytes, stream, false, false);
}

CUresult cuMemcpyDtoHAsync_v2_ptsz(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemcpyDtoHAsync_v2_ptsz);
  return copy_op(guard_, src, dst, bytes, stream, true, false);
}

CUresult cuMemsetD8(CUdeviceptr_v1 dst, unsigned char, unsigned int n) {
  SIMCUDA_LOCKED_ENTRY(cuMemsetD8);
  return memset_op(guard_, dst, n, 1, false);
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char, size_t n) {
  SIMCUDA_LOCKED_ENTRY(cuMemsetD8_v2);
  return memset_op(guard_, dst, n, 1, false);
}

CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char, size_t n) {
  SIMCUDA_LOCKED_ENTRY(cuMemsetD8_v2_ptds);
  return memset_op(guard_, dst, n, 1, true);
}

CUresult cuMemsetD32(CUdeviceptr_v1 dst, unsigned int, unsigned int n) {
  SIMCUDA_LOCKED_ENTRY(cuMemsetD32);
  return memset_op(guard_, dst, static_cast<uint64_t>(n) * 4, 4, false);
}

CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int, size_t n) {
  SIMCUDA_LOCKED_ENTRY(cuMemsetD32_v2);
  if (n > UINT64_MAX / 4) return CUDA_ERROR_INVALID_VALUE;
  return memset_op(guard_, dst, static_cast<uint64_t>(n) * 4, 4, false);
}

CUresult cuMemsetD32_v2_ptds(CUdeviceptr dst, unsigned int, size_t n) {
  SIMCUDA_LOCKED_ENTRY(cuMemsetD32_v2_ptds);
  if (n > UINT64_MAX / 4) return CUDA_ERROR_INVALID_VALUE;
  return memset_op(guard_, dst, static_cast<uint64_t>(n) * 4, 4, true);
}

// ---------------------------------------------------------------------------
// Pools and the stream-ordered allocator
// ---------------------------------------------------------------------------

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetDefaultMemPool);
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *pool = reinterpret_cast<CUmemoryPool>(default_pool(dev));
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetMemPool);
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *pool = reinterpret_cast<CUmemoryPool>(current_pool(dev));
  return CUDA_SUCCESS;
}

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceSetMemPool);
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Pool* p = find_pool(pool);
  if (p == nullptr || p->dev != dev) return CUDA_ERROR_INVALID_VALUE;
  proc().dev[dev].current_pool = p;
  return CUDA_SUCCESS;
}

CUresult cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  SIMCUDA_LOCKED_ENTRY(cuMemPoolCreate);
  if (pool == nullptr || props == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_NOT_SUPPORTED;
  if (props->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    int ignored = 0;
    // Host pools exist on newer drivers; the sim models device pools only.
    return valid_mem_location(props->location, ignored) ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
  }
  int dev = props->location.id;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Pool* p = new_pool(dev, false);
  p->max_size = props->maxSize;
  *pool = reinterpret_cast<CUmemoryPool>(p);
  return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  SIMCUDA_LOCKED_ENTRY(cuMemPoolDestroy);
  Process& P = proc();
  Pool* p = find_pool(pool);
  if (p == nullptr || p->is_default) return CUDA_ERROR_INVALID_VALUE;
  if (P.dev[p->dev].current_pool == p) P.dev[p->dev].current_pool = nullptr;
  if (p->used == 0) {
    pool_erase(p);
  } else {
    // Outstanding blocks: the pool lives on until they are freed, holding
    // only the chunks they need.
    p->destroyed = true;
    pool_shrink(p, 0);
  }
  return CUDA_SUCCESS;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
  SIMCUDA_LOCKED_ENTRY(cuMemPoolTrimTo);
  Pool* p = find_pool(pool);
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  uint64_t target = keep > UINT64_MAX - kChunk ? UINT64_MAX : round_up(keep, kChunk);
  pool_shrink(p, target);
  return CUDA_SUCCESS;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  SIMCUDA_LOCKED_ENTRY(cuMemPoolSetAttribute);
  Pool* p = find_pool(pool);
  if (p == nullptr || value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES] = *static_cast<int*>(value);
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
      p->release_threshold = *static_cast<cuuint64_t*>(value);  // applies at the next synchronization
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;  // only resets
      p->reserved_high = p->reserved;
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      p->used_high = p->used;
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE;  // read-only or unknown
  }
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  SIMCUDA_LOCKED_ENTRY(cuMemPoolGetAttribute);
  Pool* p = find_pool(pool);
  if (p == nullptr || value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto u64 = static_cast<cuuint64_t*>(value);
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      *static_cast<int*>(value) = p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *u64 = p->release_threshold; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *u64 = p->reserved; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *u64 = p->reserved_high; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *u64 = p->used; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *u64 = p->used_high; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocAsync);
  return alloc_async(dptr, bytes, nullptr, stream, false);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytes, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocAsync_ptsz);
  return alloc_async(dptr, bytes, nullptr, stream, true);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocFromPoolAsync);
  Pool* p = find_pool(pool);
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return alloc_async(dptr, bytes, p, stream, false);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemAllocFromPoolAsync_ptsz);
  Pool* p = find_pool(pool);
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return alloc_async(dptr, bytes, p, stream, true);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemFreeAsync);
  return free_async(dptr, stream, false);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
  SIMCUDA_LOCKED_ENTRY(cuMemFreeAsync_ptsz);
  return free_async(dptr, stream, true);
}

// ---------------------------------------------------------------------------
// Graph memory (the nodes are in api_exec.cpp)
// ---------------------------------------------------------------------------

// Releases the device's whole graph memory pool. The sim does not track which
// graphs are still executing, so every exec holding memory here gives it up
// (on all its devices) and takes it again at its next launch or upload.
CUresult cuDeviceGraphMemTrim(CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGraphMemTrim);
  Process& P = proc();
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  for (auto& [h, e] : P.graph_execs)
    if (e->graph_mem[dev] != 0) unback_graph_exec(e.get());
  GraphMemPool& pool = P.dev[dev].graph_mem;
  uncharge(dev, pool.reserved);
  pool.reserved = 0;
  pool.used = 0;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void* value) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetGraphMemAttribute);
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const GraphMemPool& pool = proc().dev[dev].graph_mem;
  auto u64 = static_cast<cuuint64_t*>(value);
  switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: *u64 = pool.used; return CUDA_SUCCESS;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: *u64 = pool.used_high; return CUDA_SUCCESS;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *u64 = pool.reserved; return CUDA_SUCCESS;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: *u64 = pool.reserved_high; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

// Only the high-water marks can be set, and only reset (to the current value).
CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void* value) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceSetGraphMemAttribute);
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (value == nullptr || *static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
  GraphMemPool& pool = proc().dev[dev].graph_mem;
  switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: pool.used_high = pool.used; return CUDA_SUCCESS;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: pool.reserved_high = pool.reserved; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

// ---------------------------------------------------------------------------
// Virtual memory management
// ---------------------------------------------------------------------------

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  SIMCUDA_LOCKED_ENTRY(cuMemGetAllocationGranularity);
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return CUDA_ERROR_INVALID_VALUE;
  int dev = -1;
  if (CUresult r = check_alloc_prop(prop, dev)) return r;
  *granularity = kChunk;
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  SIMCUDA_LOCKED_ENTRY(cuMemCreate);
  Process& P = proc();
  if (handle == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  int dev = -1;
  if (CUresult r = check_alloc_prop(prop, dev)) return r;
  if (size == 0 || size % kChunk != 0) return CUDA_ERROR_INVALID_VALUE;
  PhysAlloc pa;
  pa.prop = *prop;
  pa.size = size;
  pa.dev = dev;
  if (dev >= 0) {  // host-located physical memory is not device memory
    if (CUresult r = charge(dev, size)) return r;
    pa.charged = size;
    P.dev[dev].vmm_bytes += size;
  }
  CUmemGenericAllocationHandle h = P.next_handle++;
  P.phys[h] = pa;
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  SIMCUDA_LOCKED_ENTRY(cuMemRelease);
  Process& P = proc();
  auto it = P.phys.find(handle);
  if (it == P.phys.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  if (it->second.retains > 0) {
    --it->second.retains;
    return CUDA_SUCCESS;
  }
  it->second.released = true;
  // Still mapped: the memory stays until the last cuMemUnmap, like the driver.
  phys_maybe_free(handle);
  return CUDA_SUCCESS;
}

// The handle behind a mapped address, with one more reference to release.
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  SIMCUDA_LOCKED_ENTRY(cuMemRetainAllocationHandle);
  Process& P = proc();
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const auto* m = find_mapping(reinterpret_cast<CUdeviceptr>(addr));
  if (m == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto it = P.phys.find(m->second.handle);
  if (it == P.phys.end()) return CUDA_ERROR_INVALID_VALUE;
  // A released handle whose memory is still mapped gets a reference again.
  if (it->second.released)
    it->second.released = false;
  else
    ++it->second.retains;
  *handle = m->second.handle;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  SIMCUDA_LOCKED_ENTRY(cuMemAddressReserve);
  (void)addr;  // a hint; the sim always picks the address
  if (ptr == nullptr || flags != 0 || size == 0 || size % kChunk != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment != 0 && (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr p = reserve_va(size, std::max<uint64_t>(alignment, kChunk));
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  proc().reservations[p] = size;
  *ptr = p;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  SIMCUDA_LOCKED_ENTRY(cuMemAddressFree);
  Process& P = proc();
  auto it = P.reservations.find(ptr);
  if (it == P.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  // Whatever is still mapped inside is unmapped with the range.
  for (auto m = P.mappings.lower_bound(ptr); m != P.mappings.end() && m->first < ptr + size;) {
    CUmemGenericAllocationHandle h = m->second.handle;
    m = P.mappings.erase(m);
    phys_unmap(h);
  }
  P.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  SIMCUDA_LOCKED_ENTRY(cuMemMap);
  Process& P = proc();
  if (flags != 0 || size == 0 || size % kChunk != 0 || offset % kChunk != 0) return CUDA_ERROR_INVALID_VALUE;
  auto ph = P.phys.find(handle);
  if (ph == P.phys.end() || ph->second.released) return CUDA_ERROR_INVALID_HANDLE;
  if (offset > ph->second.size || size > ph->second.size - offset) return CUDA_ERROR_INVALID_VALUE;
  // The range must lie inside one reservation and overlap no mapping.
  auto r = P.reservations.upper_bound(ptr);
  if (r == P.reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
  --r;
  if (ptr - r->first >= r->second || size > r->second - (ptr - r->first)) return CUDA_ERROR_INVALID_VALUE;
  auto next = P.mappings.lower_bound(ptr);
  if (next != P.mappings.end() && next->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (find_mapping(ptr) != nullptr) return CUDA_ERROR_INVALID_VALUE;
  P.mappings[ptr] = Mapping{size, handle};
  ++ph->second.maps;
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  SIMCUDA_LOCKED_ENTRY(cuMemUnmap);
  Process& P = proc();
  std::vector<CUdeviceptr> found;
  if (size == 0 || !mappings_cover(ptr, size, found)) return CUDA_ERROR_INVALID_VALUE;
  for (CUdeviceptr va : found) {
    CUmemGenericAllocationHandle h = P.mappings[va].handle;
    P.mappings.erase(va);
    phys_unmap(h);
  }
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  SIMCUDA_LOCKED_ENTRY(cuMemSetAccess);
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  std::vector<CUdeviceptr> found;
  if (!mappings_cover(ptr, size, found)) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i) {
    int dev = -1;
    if (!valid_mem_location(desc[i].location, dev))
      return desc[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE ? CUDA_ERROR_INVALID_DEVICE
                                                                  : CUDA_ERROR_INVALID_VALUE;
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  SIMCUDA_LOCKED_ENTRY(cuMemGetAllocationPropertiesFromHandle);
  Process& P = proc();
  if (prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto it = P.phys.find(handle);
  if (it == P.phys.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  *prop = it->second.prop;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Arrays
// ---------------------------------------------------------------------------

CUresult cuArrayCreate(CUarray* array, const CUDA_ARRAY_DESCRIPTOR_v1* desc) {
  SIMCUDA_LOCKED_ENTRY(cuArrayCreate);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return array_create_2d(array, desc->Width, desc->Height, desc->Format, desc->NumChannels);
}

CUresult cuArrayCreate_v2(CUarray* array, const CUDA_ARRAY_DESCRIPTOR* desc) {
  SIMCUDA_LOCKED_ENTRY(cuArrayCreate_v2);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return array_create_2d(array, desc->Width, desc->Height, desc->Format, desc->NumChannels);
}

CUresult cuArray3DCreate(CUarray* array, const CUDA_ARRAY3D_DESCRIPTOR_v1* desc) {
  SIMCUDA_LOCKED_ENTRY(cuArray3DCreate);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = desc->Width;
  d.Height = desc->Height;
  d.Depth = desc->Depth;
  d.Format = desc->Format;
  d.NumChannels = desc->NumChannels;
  d.Flags = desc->Flags;
  return array_create_3d(array, d);
}

CUresult cuArray3DCreate_v2(CUarray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc) {
  SIMCUDA_LOCKED_ENTRY(cuArray3DCreate_v2);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return array_create_3d(array, *desc);
}

CUresult cuArrayDestroy(CUarray array) {
  SIMCUDA_LOCKED_ENTRY(cuArrayDestroy);
  return destroy_in(proc().arrays, key(array));
}

CUresult cuArrayGetDescriptor(CUDA_ARRAY_DESCRIPTOR_v1* desc, CUarray array) {
  SIMCUDA_LOCKED_ENTRY(cuArrayGetDescriptor);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const Array* a = find_array(array);
  if (a == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  desc->Width = static_cast<unsigned int>(a->desc.Width);
  desc->Height = static_cast<unsigned int>(a->desc.Height);
  desc->Format = a->desc.Format;
  desc->NumChannels = a->desc.NumChannels;
  return CUDA_SUCCESS;
}

CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR* desc, CUarray array) {
  SIMCUDA_LOCKED_ENTRY(cuArrayGetDescriptor_v2);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const Array* a = find_array(array);
  if (a == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  desc->Width = a->desc.Width;
  desc->Height = a->desc.Height;
  desc->Format = a->desc.Format;
  desc->NumChannels = a->desc.NumChannels;
  return CUDA_SUCCESS;
}

CUresult cuArray3DGetDescriptor(CUDA_ARRAY3D_DESCRIPTOR_v1* desc, CUarray array) {
  SIMCUDA_LOCKED_ENTRY(cuArray3DGetDescriptor);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const Array* a = find_array(array);
  if (a == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  desc->Width = static_cast<unsigned int>(a->desc.Width);
  desc->Height = static_cast<unsigned int>(a->desc.Height);
  desc->Depth = static_cast<unsigned int>(a->desc.Depth);
  desc->Format = a->desc.Format;
  desc->NumChannels = a->desc.NumChannels;
  desc->Flags = a->desc.Flags;
  return CUDA_SUCCESS;
}

CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR* desc, CUarray array) {
  SIMCUDA_LOCKED_ENTRY(cuArray3DGetDescriptor_v2);
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const Array* a = find_array(array);
  if (a == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *desc = a->desc;
  return CUDA_SUCCESS;
}

CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS* req, CUarray array, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuArrayGetMemoryRequirements);
  return fill_requirements(req, find_array(array), dev);
}

CUresult cuMipmappedArrayCreate(CUmipmappedArray* handle, const CUDA_ARRAY3D_DESCRIPTOR* desc, unsigned int levels) {
  SIMCUDA_LOCKED_ENTRY(cuMipmappedArrayCreate);
  if (handle == nullptr || desc == nullptr || desc->Width == 0) return CUDA_ERROR_INVALID_VALUE;
  if (levels == 0 || levels > max_mip_levels(*desc)) return CUDA_ERROR_INVALID_VALUE;
  void* out = nullptr;
  CUresult r = array_create(proc().mipmaps, &out, *desc, true, levels);
  if (r == CUDA_SUCCESS) *handle = static_cast<CUmipmappedArray>(out);
  return r;
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray array) {
  SIMCUDA_LOCKED_ENTRY(cuMipmappedArrayDestroy);
  return destroy_in(proc().mipmaps, key(array));
}

CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS* req, CUmipmappedArray array,
                                               CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuMipmappedArrayGetMemoryRequirements);
  return fill_requirements(req, find_mipmap(array), dev);
}

}  // extern "C"

// ---------------------------------------------------------------------------
// Control API pieces that read process-local memory objects
// ---------------------------------------------------------------------------

extern "C" {

uint64_t simcuda_pool_reserved_bytes(int ordinal) {
  Guard guard;
  uint64_t total = 0;
  for (auto& [h, p] : proc().pools)
    if (p->dev == ordinal) total += p->reserved;
  return total;
}

uint64_t simcuda_pool_reserved(CUmemoryPool pool) {
  Guard guard;
  auto& pools = proc().pools;
  auto it = pools.find(key(pool));
  return it == pools.end() ? 0 : it->second->reserved;
}

uint64_t simcuda_pool_used(CUmemoryPool pool) {
  Guard guard;
  auto& pools = proc().pools;
  auto it = pools.find(key(pool));
  return it == pools.end() ? 0 : it->second->used;
}

uint64_t simcuda_array_bytes(CUarray array) {
  Guard guard;
  const Array* a = find_array(array);
  return a == nullptr ? 0 : a->bytes;
}

uint64_t simcuda_mipmapped_array_bytes(CUmipmappedArray array) {
  Guard guard;
  const Array* a = find_mipmap(array);
  return a == nullptr ? 0 : a->bytes;
}

uint64_t simcuda_vmm_bytes(int ordinal) {
  Guard guard;
  if (ordinal < 0 || ordinal >= kMaxDevices) return 0;
  return proc().dev[ordinal].vmm_bytes;
}

}  // extern "C"

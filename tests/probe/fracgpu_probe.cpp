// A small CUDA driver client for the tests: runs the commands given on its
// command line, in order, and prints one `key=value` line per result. The
// tests run it under LD_PRELOAD=libfracgpu.so against the simulated driver,
// so every step goes through the interposer exactly as an application's
// would: linked calls, dlsym, and cuGetProcAddress.
//
// It links the driver directly (the "linked" path). Unknown commands and bad
// arguments exit 64; a CUDA error is printed, not fatal: tests assert on it.
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fracgpu/ledger_layout.h"

extern "C" void* rtld_next_from_a();  // tests/probe/rtld_next_a.cpp

namespace {

std::vector<CUdeviceptr> g_ptrs;
std::vector<CUdeviceptr> g_async_ptrs;
std::vector<CUcontext> g_contexts;
std::vector<CUgreenCtx> g_greens;
std::vector<CUmemGenericAllocationHandle> g_vmm;
std::vector<uint64_t> g_vmm_sizes;  // of g_vmm's handles
struct VmmMap {
  CUdeviceptr va;
  uint64_t size;
};
std::vector<VmmMap> g_maps;
std::vector<CUarray> g_arrays;
std::vector<CUmipmappedArray> g_mipmaps;
CUmemoryPool g_pool = nullptr;
CUstream g_capture_stream = nullptr;
CUstream g_other_stream = nullptr;  // stream-on: a stream of another context than the current one
std::vector<CUgraphExec> g_graph_execs;

[[noreturn]] void usage(const char* what) {
  fprintf(stderr, "fracgpu_probe: %s\n", what);
  exit(64);
}

uint64_t parse_bytes(const char* s) {
  char* end = nullptr;
  double v = strtod(s, &end);
  std::string unit = end ? end : "";
  if (unit == "" || unit == "B") return static_cast<uint64_t>(v);
  if (unit == "KiB") return static_cast<uint64_t>(v * 1024);
  if (unit == "MiB") return static_cast<uint64_t>(v * 1024 * 1024);
  if (unit == "GiB") return static_cast<uint64_t>(v * 1024 * 1024 * 1024);
  usage("bad size");
}

void print(const char* key, long long value) {
  printf("%s=%lld\n", key, value);
  fflush(stdout);
}

// Which library and symbol an address belongs to.
void print_owner(const char* prefix, void* address) {
  Dl_info info{};
  if (address == nullptr || dladdr(address, &info) == 0) {
    printf("%s_lib=none %s_sym=none\n", prefix, prefix);
  } else {
    const char* base = info.dli_fname ? strrchr(info.dli_fname, '/') : nullptr;
    printf("%s_lib=%s %s_sym=%s\n", prefix, base ? base + 1 : info.dli_fname, prefix,
           info.dli_sname ? info.dli_sname : "?");
  }
  fflush(stdout);
}

void* driver_handle() {
  static void* handle = dlopen("libcuda.so.1", RTLD_NOW);
  return handle;
}

uint64_t sim_count(const char* name) {
  using Fn = uint64_t (*)(const char*);
  auto fn = reinterpret_cast<Fn>(dlsym(driver_handle(), "simcuda_call_count"));
  return fn ? fn(name) : 0;
}

CUresult get_proc(const char* symbol, int version, cuuint64_t flags, void** fn) {
  CUdriverProcAddressQueryResult status{};
  return cuGetProcAddress_v2(symbol, fn, version, flags, &status);
}

// What a racing thread holds: one allocation of any charged kind.
enum class RaceKind { kLinear, kPitch, kManaged, kAsync, kPool, kVmm, kArray, kGraph, kContext, kCount };
const char* const kRaceKindNames[] = {"linear", "pitch", "managed", "async", "pool", "vmm", "array", "graph",
                                      "context"};
static_assert(sizeof(kRaceKindNames) / sizeof(kRaceKindNames[0]) == static_cast<size_t>(RaceKind::kCount));

struct RaceHeld {
  RaceKind kind;
  uint64_t handle;
  uint64_t size;  // vmm: a mapping of that size at `handle`, whose handle is released
};

// A VMM allocation mapped into an address range of its own, its handle
// released at once: the mapping alone keeps the memory.
CUresult map_and_release(CUmemGenericAllocationHandle h, uint64_t size, CUdeviceptr* va) {
  CUresult r = cuMemAddressReserve(va, size, 0, 0, 0);
  if (r != CUDA_SUCCESS) return r;
  r = cuMemMap(*va, size, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    cuMemAddressFree(*va, size);
    return r;
  }
  return cuMemRelease(h);
}

CUresult unmap_and_free(CUdeviceptr va, uint64_t size) {
  CUresult r = cuMemUnmap(va, size);
  if (r == CUDA_SUCCESS) r = cuMemAddressFree(va, size);
  return r;
}

// One exec that every racing thread launches (graph memory shared by threads),
// made before the race by `race ... graph` or `mixed`.
CUgraphExec g_race_shared_exec = nullptr;

CUresult race_graph_exec(uint64_t bytes, CUgraphExec* exec) {
  CUDA_MEM_ALLOC_NODE_PARAMS params{};
  params.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  params.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  params.poolProps.location.id = 0;
  params.bytesize = bytes;
  CUgraph graph = nullptr;
  CUgraphNode node = nullptr;
  CUresult r = cuGraphCreate(&graph, 0);
  if (r == CUDA_SUCCESS) r = cuGraphAddMemAllocNode(&node, graph, nullptr, 0, &params);
  if (r == CUDA_SUCCESS) r = cuGraphInstantiateWithFlags(exec, graph, 0);
  if (graph != nullptr) cuGraphDestroy(graph);
  return r;
}

// Takes `bytes` (about) of device memory of the given kind.
CUresult race_take(RaceKind kind, uint64_t bytes, std::mt19937_64& rng, RaceHeld* out) {
  out->kind = kind;
  CUresult r = CUDA_ERROR_UNKNOWN;
  switch (kind) {
    case RaceKind::kLinear: {
      CUdeviceptr p = 0;
      r = cuMemAlloc_v2(&p, bytes);
      out->handle = p;
      break;
    }
    case RaceKind::kPitch: {
      CUdeviceptr p = 0;
      size_t pitch = 0;
      const size_t width = 1000 + rng() % 3000;  // pitch rounds it up
      r = cuMemAllocPitch_v2(&p, &pitch, width, std::max<uint64_t>(bytes / width, 1), 4);
      out->handle = p;
      break;
    }
    case RaceKind::kManaged: {
      CUdeviceptr p = 0;
      r = cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL);
      out->handle = p;
      break;
    }
    case RaceKind::kAsync: {
      CUdeviceptr p = 0;
      r = rng() % 2 ? cuMemAllocAsync(&p, bytes, nullptr) : cuMemAllocAsync_ptsz(&p, bytes, nullptr);
      out->handle = p;
      break;
    }
    case RaceKind::kPool: {
      CUdeviceptr p = 0;
      r = cuMemAllocFromPoolAsync(&p, bytes, g_pool, nullptr);
      out->handle = p;
      break;
    }
    case RaceKind::kVmm: {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = 0;
      CUmemGenericAllocationHandle h = 0;
      const uint64_t size = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
      r = cuMemCreate(&h, size, &prop, 0);
      out->handle = h;
      out->size = 0;
      if (r == CUDA_SUCCESS && rng() % 2) {
        CUdeviceptr va = 0;
        r = map_and_release(h, size, &va);
        if (r != CUDA_SUCCESS) {
          cuMemRelease(h);
          break;
        }
        out->handle = va;
        out->size = size;
      }
      break;
    }
    case RaceKind::kArray: {
      CUDA_ARRAY_DESCRIPTOR d{};
      d.Width = 4096;  // float4: 64 KiB a row
      d.Height = std::max<uint64_t>(bytes >> 16, 1);
      d.Format = CU_AD_FORMAT_FLOAT;
      d.NumChannels = 4;
      CUarray a = nullptr;
      r = cuArrayCreate_v2(&a, &d);
      out->handle = reinterpret_cast<uint64_t>(a);
      break;
    }
    case RaceKind::kGraph: {
      // Launch the shared exec now and then (threads sharing one exec), else
      // an exec of our own, launched: it holds its memory until destroyed.
      if (g_race_shared_exec != nullptr && rng() % 4 == 0) {
        r = rng() % 2 ? cuGraphLaunch(g_race_shared_exec, nullptr) : cuGraphUpload(g_race_shared_exec, nullptr);
        out->handle = 0;
        break;
      }
      CUgraphExec exec = nullptr;
      r = race_graph_exec(bytes, &exec);
      if (r != CUDA_SUCCESS) break;
      r = cuGraphLaunch(exec, nullptr);
      if (r != CUDA_SUCCESS) cuGraphExecDestroy(exec);
      out->handle = reinterpret_cast<uint64_t>(exec);
      break;
    }
    case RaceKind::kContext: {
      CUcontext ctx = nullptr;
      r = cuCtxCreate_v2(&ctx, 0, 0);
      if (r == CUDA_SUCCESS) cuCtxPopCurrent_v2(nullptr);  // back to the shared context
      out->handle = reinterpret_cast<uint64_t>(ctx);
      break;
    }
    case RaceKind::kCount:
      break;
  }
  return r;
}

CUresult race_give_back(const RaceHeld& held, std::mt19937_64& rng) {
  switch (held.kind) {
    case RaceKind::kLinear:
    case RaceKind::kPitch:
    case RaceKind::kManaged:
      return cuMemFree_v2(held.handle);
    case RaceKind::kAsync:
    case RaceKind::kPool: {
      CUresult r = rng() % 2 ? cuMemFreeAsync(held.handle, nullptr) : cuMemFreeAsync_ptsz(held.handle, nullptr);
      // The default pool gives memory back at synchronization.
      if (r == CUDA_SUCCESS && rng() % 2 == 0) r = cuStreamSynchronize(nullptr);
      if (r == CUDA_SUCCESS && held.kind == RaceKind::kPool && rng() % 8 == 0) r = cuMemPoolTrimTo(g_pool, 0);
      return r;
    }
    case RaceKind::kVmm:
      return held.size != 0 ? unmap_and_free(held.handle, held.size) : cuMemRelease(held.handle);
    case RaceKind::kArray:
      return cuArrayDestroy(reinterpret_cast<CUarray>(held.handle));
    case RaceKind::kGraph: {
      CUresult r = CUDA_SUCCESS;
      if (held.handle != 0) r = cuGraphExecDestroy(reinterpret_cast<CUgraphExec>(held.handle));
      if (r == CUDA_SUCCESS && rng() % 16 == 0) r = cuDeviceGraphMemTrim(0);
      return r;
    }
    case RaceKind::kContext: {
      auto ctx = reinterpret_cast<CUcontext>(held.handle);
      if (rng() % 2) return cuCtxDestroy_v2(ctx);
      // cuCtxDetach destroys the context it is given (once attached), and
      // wants it current.
      CUresult r = cuCtxPushCurrent_v2(ctx);
      if (r == CUDA_SUCCESS) r = cuCtxDetach(ctx);
      return r;
    }
    case RaceKind::kCount:
      break;
  }
  return CUDA_ERROR_UNKNOWN;
}

// Threads relaunch one exec, which the driver backs, trim the graph memory
// cache (which takes its memory away), and take and give back linear memory
// (which keeps the quota at its edge), all at once.
void race_relaunch(const std::atomic<long long>& stop_flag, std::mt19937_64& rng, std::atomic<long long>& ok,
                   const std::function<void(CUresult)>& count) {
  std::vector<CUdeviceptr> mine;
  while (stop_flag.load() == 0) {
    CUresult r;
    switch (rng() % 4) {
      case 0:
      case 1:
        r = cuGraphLaunch(g_race_shared_exec, nullptr);
        break;
      case 2:
        r = cuDeviceGraphMemTrim(0);
        break;
      default:
        if (!mine.empty() && rng() % 2) {
          r = cuMemFree_v2(mine.back());
          mine.pop_back();
        } else {
          CUdeviceptr p = 0;
          r = cuMemAlloc_v2(&p, 8 << 20);
          if (r == CUDA_SUCCESS) mine.push_back(p);
        }
    }
    if (r == CUDA_SUCCESS) ok++;
    count(r);
  }
  for (CUdeviceptr p : mine) cuMemFree_v2(p);
}

// Threads allocate and free random sizes at the quota's edge, of one kind
// ("mixed": any kind, chosen each time; "relaunch": race_relaunch).
void race(int threads, double seconds, uint64_t max_chunk, const std::string& what) {
  int kind_index = -1;  // mixed
  for (int k = 0; k < static_cast<int>(RaceKind::kCount); ++k)
    if (what == kRaceKindNames[k]) kind_index = k;
  if (kind_index < 0 && what != "mixed" && what != "relaunch") usage("race: unknown kind");
  std::atomic<long long> ok{0}, oom{0}, other{0};
  std::atomic<int> last_other{0};
  CUcontext ctx = nullptr;
  cuCtxGetCurrent(&ctx);
  if (what == "graph" || what == "mixed" || what == "relaunch") {
    CUresult r = race_graph_exec(what == "relaunch" ? max_chunk : max_chunk / 2, &g_race_shared_exec);
    if (r == CUDA_SUCCESS && what == "relaunch") r = cuGraphLaunch(g_race_shared_exec, nullptr);
    if (r != CUDA_SUCCESS) usage("race: cannot make the shared graph");
  }

  std::atomic<long long> stop{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      cuCtxSetCurrent(ctx);
      std::mt19937_64 rng(getpid() * 131 + t);
      std::vector<RaceHeld> mine;
      auto count = [&](CUresult r) {
        if (r == CUDA_ERROR_OUT_OF_MEMORY) {
          oom++;
        } else if (r != CUDA_SUCCESS) {
          other++;
          last_other.store(r);
        }
      };
      const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      if (what == "relaunch") {
        if (t == 0) {
          std::this_thread::sleep_until(end);
          stop.store(1);
        }
        race_relaunch(stop, rng, ok, count);
        return;
      }
      while (std::chrono::steady_clock::now() < end) {
        if (!mine.empty() && (rng() % 2 == 0 || mine.size() > 6)) {
          size_t i = rng() % mine.size();
          count(race_give_back(mine[i], rng));
          mine.erase(mine.begin() + static_cast<long>(i));
          continue;
        }
        const auto kind = kind_index >= 0 ? static_cast<RaceKind>(kind_index)
                                          : static_cast<RaceKind>(rng() % static_cast<int>(RaceKind::kCount));
        RaceHeld held{};
        CUresult r = race_take(kind, (rng() % max_chunk) + 1, rng, &held);
        if (r == CUDA_SUCCESS) {
          mine.push_back(held);
          ok++;
        }
        count(r);
      }
      for (const RaceHeld& held : mine) race_give_back(held, rng);
    });
  }
  for (auto& th : pool) th.join();
  print("race_ok", ok);
  print("race_oom", oom);
  print("race_other", other);
  print("race_last_other", last_other);
}

size_t index_arg(const char* s, size_t size) {
  if (size == 0) usage("nothing to release");
  if (strcmp(s, "last") == 0) return size - 1;
  size_t i = strtoull(s, nullptr, 10);
  if (i >= size) usage("index out of range");
  return i;
}

// JAX's start-up (XLA's GPU client): every device the driver shows gets a
// context and its share of memory up front. Every call is found with
// cuGetProcAddress, as the CUDA runtime finds them: cuInit, the device
// count, then on every device its UUID, its primary context (made current)
// and `percent` of the free memory it is shown, then a peer query for every
// pair of devices. Prints jax_init, jax_count, jax_<i>_{uuid,ctx,free,alloc}
// and jax_peer_<a>_<b> (the query's result), and keeps what it allocated.
void jax_start(double percent) {
  auto fn = [](const char* name, auto type) {
    void* p = nullptr;
    if (get_proc(name, 12000, 0, &p) != CUDA_SUCCESS) p = nullptr;
    return reinterpret_cast<decltype(type)>(p);
  };
  const auto init = fn("cuInit", &cuInit);
  const auto get_count = fn("cuDeviceGetCount", &cuDeviceGetCount);
  const auto get = fn("cuDeviceGet", &cuDeviceGet);
  const auto get_uuid = fn("cuDeviceGetUuid", &cuDeviceGetUuid_v2);
  const auto retain = fn("cuDevicePrimaryCtxRetain", &cuDevicePrimaryCtxRetain);
  const auto set_current = fn("cuCtxSetCurrent", &cuCtxSetCurrent);
  const auto mem_info = fn("cuMemGetInfo", &cuMemGetInfo_v2);
  const auto mem_alloc = fn("cuMemAlloc", &cuMemAlloc_v2);
  const auto can_access_peer = fn("cuDeviceCanAccessPeer", &cuDeviceCanAccessPeer);
  if (!init || !get_count || !get || !get_uuid || !retain || !set_current || !mem_info || !mem_alloc ||
      !can_access_peer)
    usage("jax-start: cuGetProcAddress lacks a function");
  const CUresult r = init(0);
  print("jax_init", r);
  if (r != CUDA_SUCCESS) return;
  int count = 0;
  get_count(&count);
  print("jax_count", count);
  char key[64];
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    CUuuid uuid{};
    get(&dev, i);
    get_uuid(&uuid, dev);
    const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
    printf("jax_%d_uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", i, u[0], u[1],
           u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    CUcontext ctx = nullptr;
    CUresult c = retain(&ctx, dev);
    if (c == CUDA_SUCCESS) c = set_current(ctx);
    snprintf(key, sizeof key, "jax_%d_ctx", i);
    print(key, c);
    if (c != CUDA_SUCCESS) continue;
    size_t free_bytes = 0, total_bytes = 0;
    mem_info(&free_bytes, &total_bytes);
    snprintf(key, sizeof key, "jax_%d_free", i);
    print(key, static_cast<long long>(free_bytes));
    CUdeviceptr p = 0;
    const CUresult a = mem_alloc(&p, static_cast<size_t>(static_cast<double>(free_bytes) * percent / 100));
    if (a == CUDA_SUCCESS) g_ptrs.push_back(p);
    snprintf(key, sizeof key, "jax_%d_alloc", i);
    print(key, a);
  }
  for (int a = 0; a < count; ++a)
    for (int b = 0; b < count; ++b) {
      if (a == b) continue;
      int can = 0;
      snprintf(key, sizeof key, "jax_peer_%d_%d", a, b);
      print(key, can_access_peer(&can, a, b));
    }
}

// PROBE_BEFORE_MAIN=1: a library constructor that uses the GPU before main,
// as some frameworks' static initializers do.
__attribute__((constructor)) void use_gpu_before_main() {
  if (getenv("PROBE_BEFORE_MAIN") == nullptr) return;
  CUcontext ctx = nullptr;
  CUdeviceptr p = 0;
  CUresult r = cuInit(0);
  if (r == CUDA_SUCCESS) r = cuDevicePrimaryCtxRetain(&ctx, 0);
  if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(ctx);
  if (r == CUDA_SUCCESS) r = cuMemAlloc_v2(&p, 100 << 20);
  if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
  print("before_main", r);
}

// Frees everything from an atexit handler, after main has returned, and
// allocates once more: the interposer must still work then.
void free_at_exit() {
  long failures = 0;
  for (CUdeviceptr p : g_ptrs)
    if (cuMemFree_v2(p) != CUDA_SUCCESS) ++failures;
  g_ptrs.clear();
  CUdeviceptr p = 0;
  if (cuMemAlloc_v2(&p, 1 << 20) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS) ++failures;
  print("at_exit_failures", failures);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string cmd = argv[i];
    auto arg = [&]() -> const char* {
      if (i + 1 >= argc) usage(("missing argument for " + cmd).c_str());
      return argv[++i];
    };
    if (cmd == "init") {
      print("init", cuInit(0));
    } else if (cmd == "init-dlsym") {  // cuInit found with dlsym, as a runtime that dlopens libcuda does
      auto fn = reinterpret_cast<CUresult (*)(unsigned)>(dlsym(driver_handle(), "cuInit"));
      print("init", fn != nullptr ? fn(0) : CUDA_ERROR_NOT_FOUND);
    } else if (cmd == "devices") {  // devices: the count, and each device's UUID and PCI bus ID
      int count = 0;
      print("devices_rc", cuDeviceGetCount(&count));
      print("devices", count);
      for (int i = 0; i < count; ++i) {
        CUdevice dev = 0;
        CUuuid uuid{};
        char bus[32] = "";
        cuDeviceGet(&dev, i);
        cuDeviceGetUuid_v2(&uuid, dev);
        cuDeviceGetPCIBusId(bus, sizeof bus, dev);
        const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
        printf("device_%d_uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", i, u[0],
               u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
        printf("device_%d_bus=%s\n", i, bus);
      }
      CUdevice past = 0;
      print("device_past_end", cuDeviceGet(&past, count));
      fflush(stdout);
    } else if (cmd == "getenv") {  // getenv NAME: env_NAME=<value>, or env_NAME_unset=1
      const char* name = arg();
      const char* value = getenv(name);
      if (value != nullptr) printf("env_%s=%s\n", name, value);
      else printf("env_%s_unset=1\n", name);
      fflush(stdout);
    } else if (cmd == "ctx-device") {  // the current context's device ordinal
      CUdevice dev = -1;
      const CUresult r = cuCtxGetDevice(&dev);
      print("ctx_device", r == CUDA_SUCCESS ? dev : -static_cast<long long>(r));
    } else if (cmd == "jax-start") {  // jax-start PERCENT (see jax_start)
      jax_start(atof(arg()));
    } else if (cmd == "primary") {
      CUdevice dev = atoi(arg());
      CUcontext ctx = nullptr;
      CUresult r = cuDevicePrimaryCtxRetain(&ctx, dev);
      if (r == CUDA_SUCCESS) cuCtxSetCurrent(ctx);
      print("primary", r);
    } else if (cmd == "release-primary") {
      print("release_primary", cuDevicePrimaryCtxRelease_v2(atoi(arg())));
    } else if (cmd == "reset-primary") {
      print("reset_primary", cuDevicePrimaryCtxReset_v2(atoi(arg())));
    } else if (cmd == "ctx-create") {
      int version = atoi(arg());
      CUdevice dev = atoi(arg());
      CUcontext ctx = nullptr;
      CUresult r;
      switch (version) {
        case 1: r = cuCtxCreate(&ctx, 0, dev); break;
        case 2: r = cuCtxCreate_v2(&ctx, 0, dev); break;
        case 3: r = cuCtxCreate_v3(&ctx, nullptr, 0, 0, dev); break;
        default: r = cuCtxCreate_v4(&ctx, nullptr, 0, dev); break;
      }
      if (r == CUDA_SUCCESS) g_contexts.push_back(ctx);
      print("ctx_create", r);
    } else if (cmd == "ctx-destroy") {
      size_t k = index_arg(arg(), g_contexts.size());
      print("ctx_destroy", cuCtxDestroy_v2(g_contexts[k]));
      g_contexts.erase(g_contexts.begin() + static_cast<long>(k));
      if (!g_contexts.empty()) cuCtxSetCurrent(g_contexts.back());
    } else if (cmd == "ctx-attach") {  // the current context, once more
      CUcontext ctx = nullptr;
      CUresult r = cuCtxAttach(&ctx, 0);
      if (r == CUDA_SUCCESS) g_contexts.push_back(ctx);
      print("ctx_attach", r);
    } else if (cmd == "ctx-detach") {  // ctx-detach IDX: made current, then detached
      size_t k = index_arg(arg(), g_contexts.size());
      CUresult r = cuCtxSetCurrent(g_contexts[k]);
      if (r == CUDA_SUCCESS) r = cuCtxDetach(g_contexts[k]);
      print("ctx_detach", r);
      g_contexts.erase(g_contexts.begin() + static_cast<long>(k));
    } else if (cmd == "green-create") {  // green-create DEV KEY: all of DEV's SMs; made current; KEY=<its CUcontext>
      CUdevice dev = atoi(arg());
      const char* key = arg();
      CUdevResource sms{};
      CUdevResourceDesc desc = nullptr;
      CUgreenCtx green = nullptr;
      CUcontext ctx = nullptr;
      CUresult r = cuDeviceGetDevResource(dev, &sms, CU_DEV_RESOURCE_TYPE_SM);
      if (r == CUDA_SUCCESS) r = cuDevResourceGenerateDesc(&desc, &sms, 1);
      if (r == CUDA_SUCCESS) r = cuGreenCtxCreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
      if (r == CUDA_SUCCESS) {
        g_greens.push_back(green);
        r = cuCtxFromGreenCtx(&ctx, green);
      }
      if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(ctx);
      print("green_create", r);
      print(key, static_cast<long long>(reinterpret_cast<intptr_t>(ctx)));
    } else if (cmd == "green-destroy") {  // the green context created last
      if (g_greens.empty()) usage("no green context");
      print("green_destroy", cuGreenCtxDestroy(g_greens.back()));
      g_greens.pop_back();
    } else if (cmd == "current-ctx") {  // current-ctx KEY: prints KEY=<the current context's handle>
      const char* key = arg();
      CUcontext ctx = nullptr;
      cuCtxGetCurrent(&ctx);
      print(key, static_cast<long long>(reinterpret_cast<intptr_t>(ctx)));
    } else if (cmd == "alloc") {
      CUdeviceptr p = 0;
      CUresult r = cuMemAlloc_v2(&p, parse_bytes(arg()));
      if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      print("alloc", r);
    } else if (cmd == "alloc-v1") {
      CUdeviceptr_v1 p = 0;
      CUresult r = cuMemAlloc(&p, static_cast<unsigned int>(parse_bytes(arg())));
      if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      print("alloc_v1", r);
    } else if (cmd == "free") {
      size_t k = index_arg(arg(), g_ptrs.size());
      print("free", cuMemFree_v2(g_ptrs[k]));
      g_ptrs.erase(g_ptrs.begin() + static_cast<long>(k));
    } else if (cmd == "free-all") {
      for (CUdeviceptr p : g_ptrs) cuMemFree_v2(p);
      g_ptrs.clear();
      print("free_all", 0);
    } else if (cmd == "pitch") {
      size_t width = parse_bytes(arg()), height = parse_bytes(arg()), pitch = 0;
      CUdeviceptr p = 0;
      CUresult r = cuMemAllocPitch_v2(&p, &pitch, width, height, 4);
      if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      print("pitch_result", r);
      print("pitch", static_cast<long long>(pitch));
    } else if (cmd == "managed") {
      CUdeviceptr p = 0;
      CUresult r = cuMemAllocManaged(&p, parse_bytes(arg()), CU_MEM_ATTACH_GLOBAL);
      if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      print("managed", r);
    } else if (cmd == "async") {
      CUdeviceptr p = 0;
      CUresult r = cuMemAllocAsync(&p, parse_bytes(arg()), nullptr);
      if (r == CUDA_SUCCESS) g_async_ptrs.push_back(p);
      print("async", r);
    } else if (cmd == "stream-on") {  // stream-on DEV: a stream in DEV's primary context; the current one kept
      CUcontext c = nullptr, popped = nullptr;
      CUresult r = cuDevicePrimaryCtxRetain(&c, atoi(arg()));
      if (r == CUDA_SUCCESS) r = cuCtxPushCurrent_v2(c);
      if (r == CUDA_SUCCESS) {
        r = cuStreamCreate(&g_other_stream, CU_STREAM_NON_BLOCKING);
        cuCtxPopCurrent_v2(&popped);
      }
      print("stream_on", r);
    } else if (cmd == "async-other") {  // async-other BYTES: cuMemAllocAsync on the stream-on stream
      CUdeviceptr p = 0;
      CUresult r = cuMemAllocAsync(&p, parse_bytes(arg()), g_other_stream);
      if (r == CUDA_SUCCESS) g_async_ptrs.push_back(p);
      print("async_other", r);
    } else if (cmd == "async-ptsz") {
      CUdeviceptr p = 0;
      CUresult r = cuMemAllocAsync_ptsz(&p, parse_bytes(arg()), nullptr);
      if (r == CUDA_SUCCESS) g_async_ptrs.push_back(p);
      print("async_ptsz", r);
    } else if (cmd == "free-async") {
      size_t k = index_arg(arg(), g_async_ptrs.size());
      print("free_async", cuMemFreeAsync(g_async_ptrs[k], nullptr));
      g_async_ptrs.erase(g_async_ptrs.begin() + static_cast<long>(k));
    } else if (cmd == "pool-create") {
      CUdevice dev = atoi(arg());
      CUmemPoolProps props{};
      props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
      props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      props.location.id = dev;
      print("pool_create", cuMemPoolCreate(&g_pool, &props));
    } else if (cmd == "pool-default") {  // pool-default DEV: DEV's default pool as the pool the pool-* commands use
      print("pool_default", cuDeviceGetDefaultMemPool(&g_pool, atoi(arg())));
    } else if (cmd == "pool-threshold") {
      cuuint64_t threshold = parse_bytes(arg());
      print("pool_threshold", cuMemPoolSetAttribute(g_pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
    } else if (cmd == "pool-async") {
      CUdeviceptr p = 0;
      CUresult r = cuMemAllocFromPoolAsync(&p, parse_bytes(arg()), g_pool, nullptr);
      if (r == CUDA_SUCCESS) g_async_ptrs.push_back(p);
      print("pool_async", r);
    } else if (cmd == "pool-trim") {
      print("pool_trim", cuMemPoolTrimTo(g_pool, parse_bytes(arg())));
    } else if (cmd == "pool-destroy") {
      print("pool_destroy", cuMemPoolDestroy(g_pool));
      g_pool = nullptr;
    } else if (cmd == "graph-capture") {
      // graph-capture BYTES: a graph captured from a stream that allocates
      // BYTES (cuMemAllocAsync) and frees them; instantiated with flags.
      if (g_capture_stream == nullptr && cuStreamCreate(&g_capture_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        usage("cannot create a stream");
      const uint64_t bytes = parse_bytes(arg());
      CUgraph graph = nullptr;
      CUdeviceptr p = 0;
      print("capture_begin", cuStreamBeginCapture_v2(g_capture_stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
      print("capture_alloc", cuMemAllocAsync(&p, bytes, g_capture_stream));
      print("capture_free", cuMemFreeAsync(p, g_capture_stream));
      print("capture_end", cuStreamEndCapture(g_capture_stream, &graph));
      CUgraphExec exec = nullptr;
      CUresult r = cuGraphInstantiateWithFlags(&exec, graph, 0);
      if (r == CUDA_SUCCESS) g_graph_execs.push_back(exec);
      print("graph_instantiate", r);
    } else if (cmd == "graph-node" || cmd == "graph-node-upload") {
      // graph-node DEV BYTES: a graph with one allocation node on DEV that is
      // not freed in the graph; instantiated with parameters (graph-node-upload:
      // with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD, on the null stream).
      const bool upload = cmd == "graph-node-upload";
      CUDA_MEM_ALLOC_NODE_PARAMS params{};
      params.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
      params.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      params.poolProps.location.id = atoi(arg());
      params.bytesize = parse_bytes(arg());
      CUgraph graph = nullptr;
      CUgraphNode node = nullptr;
      print("graph_create", cuGraphCreate(&graph, 0));
      print("graph_alloc_node", cuGraphAddMemAllocNode(&node, graph, nullptr, 0, &params));
      CUDA_GRAPH_INSTANTIATE_PARAMS instantiate{};
      if (upload) instantiate.flags = CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
      CUgraphExec exec = nullptr;
      CUresult r = cuGraphInstantiateWithParams(&exec, graph, &instantiate);
      if (r == CUDA_SUCCESS) g_graph_execs.push_back(exec);
      print("graph_instantiate", r);
      print("graph_exec_left", static_cast<long long>(r != CUDA_SUCCESS && exec != nullptr));
    } else if (cmd == "graph-launch") {
      print("graph_launch", cuGraphLaunch(g_graph_execs[index_arg(arg(), g_graph_execs.size())], nullptr));
    } else if (cmd == "graph-upload") {
      print("graph_upload", cuGraphUpload(g_graph_execs[index_arg(arg(), g_graph_execs.size())], nullptr));
    } else if (cmd == "graph-exec-destroy") {
      size_t k = index_arg(arg(), g_graph_execs.size());
      print("graph_exec_destroy", cuGraphExecDestroy(g_graph_execs[k]));
      g_graph_execs.erase(g_graph_execs.begin() + static_cast<long>(k));
    } else if (cmd == "graph-trim") {
      print("graph_trim", cuDeviceGraphMemTrim(atoi(arg())));
    } else if (cmd == "sync") {
      print("sync", cuStreamSynchronize(nullptr));
    } else if (cmd == "ctx-sync") {
      print("ctx_sync", cuCtxSynchronize());
    } else if (cmd == "vmm") {
      size_t bytes = parse_bytes(arg());
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = atoi(arg());
      CUmemGenericAllocationHandle h = 0;
      CUresult r = cuMemCreate(&h, bytes, &prop, 0);
      if (r == CUDA_SUCCESS) {
        g_vmm.push_back(h);
        g_vmm_sizes.push_back(bytes);
      }
      print("vmm", r);
    } else if (cmd == "vmm-release") {
      size_t k = index_arg(arg(), g_vmm.size());
      print("vmm_release", cuMemRelease(g_vmm[k]));
      g_vmm.erase(g_vmm.begin() + static_cast<long>(k));
      g_vmm_sizes.erase(g_vmm_sizes.begin() + static_cast<long>(k));
    } else if (cmd == "vmm-map") {  // vmm-map IDX: all of handle IDX, at an address range of its own
      size_t k = index_arg(arg(), g_vmm.size());
      VmmMap m{0, g_vmm_sizes[k]};
      CUresult r = cuMemAddressReserve(&m.va, m.size, 0, 0, 0);
      if (r == CUDA_SUCCESS) r = cuMemMap(m.va, m.size, 0, g_vmm[k], 0);
      if (r == CUDA_SUCCESS) g_maps.push_back(m);
      print("vmm_map", r);
    } else if (cmd == "vmm-unmap") {
      size_t k = index_arg(arg(), g_maps.size());
      print("vmm_unmap", cuMemUnmap(g_maps[k].va, g_maps[k].size));
      cuMemAddressFree(g_maps[k].va, g_maps[k].size);
      g_maps.erase(g_maps.begin() + static_cast<long>(k));
    } else if (cmd == "vmm-retain") {  // vmm-retain IDX: the handle behind mapping IDX, as a new handle
      size_t k = index_arg(arg(), g_maps.size());
      CUmemGenericAllocationHandle h = 0;
      CUresult r = cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(g_maps[k].va));
      if (r == CUDA_SUCCESS) {
        g_vmm.push_back(h);
        g_vmm_sizes.push_back(g_maps[k].size);
      }
      print("vmm_retain", r);
    } else if (cmd == "array" || cmd == "array-until-refused") {
      // array WIDTH HEIGHT: one float4 array. array-until-refused WIDTH
      // HEIGHT: such arrays until one is refused (at most 100,000): how many
      // were made, and the refusal.
      const bool one = cmd == "array";
      CUDA_ARRAY_DESCRIPTOR d{};
      d.Width = parse_bytes(arg());
      d.Height = parse_bytes(arg());
      d.Format = CU_AD_FORMAT_FLOAT;
      d.NumChannels = 4;
      CUresult r = CUDA_SUCCESS;
      long made = 0;
      for (; made < (one ? 1 : 100000); ++made) {
        CUarray a = nullptr;
        if ((r = cuArrayCreate_v2(&a, &d)) != CUDA_SUCCESS) break;
        g_arrays.push_back(a);
      }
      if (!one) print("arrays_made", made);
      print(one ? "array" : "arrays_refused", r);
    } else if (cmd == "array3d") {
      CUDA_ARRAY3D_DESCRIPTOR d{};
      d.Width = parse_bytes(arg());
      d.Height = parse_bytes(arg());
      d.Depth = parse_bytes(arg());
      d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
      d.NumChannels = 1;
      CUarray a = nullptr;
      CUresult r = cuArray3DCreate_v2(&a, &d);
      if (r == CUDA_SUCCESS) g_arrays.push_back(a);
      print("array3d", r);
    } else if (cmd == "array-destroy") {
      size_t k = index_arg(arg(), g_arrays.size());
      print("array_destroy", cuArrayDestroy(g_arrays[k]));
      g_arrays.erase(g_arrays.begin() + static_cast<long>(k));
    } else if (cmd == "mipmap") {
      CUDA_ARRAY3D_DESCRIPTOR d{};
      d.Width = parse_bytes(arg());
      d.Height = parse_bytes(arg());
      d.Format = CU_AD_FORMAT_FLOAT;
      d.NumChannels = 1;
      unsigned levels = static_cast<unsigned>(atoi(arg()));
      CUmipmappedArray m = nullptr;
      CUresult r = cuMipmappedArrayCreate(&m, &d, levels);
      if (r == CUDA_SUCCESS) g_mipmaps.push_back(m);
      print("mipmap", r);
    } else if (cmd == "mipmap-destroy") {
      size_t k = index_arg(arg(), g_mipmaps.size());
      print("mipmap_destroy", cuMipmappedArrayDestroy(g_mipmaps[k]));
      g_mipmaps.erase(g_mipmaps.begin() + static_cast<long>(k));
    } else if (cmd == "info") {
      size_t free_bytes = 0, total_bytes = 0;
      CUresult r = cuMemGetInfo_v2(&free_bytes, &total_bytes);
      print("info", r);
      print("free", static_cast<long long>(free_bytes));
      print("total", static_cast<long long>(total_bytes));
    } else if (cmd == "info-v1") {
      unsigned int free_bytes = 0, total_bytes = 0;
      print("info_v1", cuMemGetInfo(&free_bytes, &total_bytes));
      print("free_v1", free_bytes);
      print("total_v1", total_bytes);
    } else if (cmd == "total") {
      size_t bytes = 0;
      print("total_result", cuDeviceTotalMem_v2(&bytes, atoi(arg())));
      print("device_total", static_cast<long long>(bytes));
    } else if (cmd == "zero-charges") {
      // What a hostile tenant can do to its own usage file: wipe every
      // charge of every slot, so the ledger says it holds nothing.
      const char* dir = getenv("FRACGPU_TENANT_DIR");
      const std::string path = std::string(dir != nullptr ? dir : "") + "/" + fracgpu::ledger::kUsageFileName;
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      void* map = fd < 0 ? MAP_FAILED
                         : mmap(nullptr, sizeof(fracgpu::ledger::UsageSegment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (map != MAP_FAILED) {
        auto* usage = static_cast<fracgpu::ledger::UsageSegment*>(map);
        for (auto& row : usage->charges)
          for (auto& charge : row) charge.store(0);
        munmap(map, sizeof(fracgpu::ledger::UsageSegment));
      }
      // fd stays open: closing any descriptor of the file would drop this
      // process's record lock on its slot, and the slot would look dead.
      print("zero_charges", map != MAP_FAILED ? 0 : 1);
    } else if (cmd == "fill") {
      // Allocate chunks until refused; report what fit.
      uint64_t chunk = parse_bytes(arg()), filled = 0;
      CUdeviceptr p = 0;
      CUresult r;
      while ((r = cuMemAlloc_v2(&p, chunk)) == CUDA_SUCCESS) {
        g_ptrs.push_back(p);
        filled += chunk;
      }
      print("filled", static_cast<long long>(filled));
      print("fill_stop", r);
    } else if (cmd == "loop") {
      // N allocate/free pairs and N cuMemGetInfo calls: the common paths.
      const long n = atol(arg());
      const uint64_t bytes = parse_bytes(arg());
      long failures = 0;
      for (long k = 0; k < n; ++k) {
        CUdeviceptr p = 0;
        size_t f = 0, t = 0;
        if (cuMemAlloc_v2(&p, bytes) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS ||
            cuMemGetInfo_v2(&f, &t) != CUDA_SUCCESS)
          ++failures;
      }
      print("loop_failures", failures);
    } else if (cmd == "loop-async") {
      // N stream-ordered allocate/free pairs on the default pool; prints the
      // wall time per pair.
      const long n = atol(arg());
      const uint64_t bytes = parse_bytes(arg());
      long failures = 0;
      const auto start = std::chrono::steady_clock::now();
      for (long k = 0; k < n; ++k) {
        CUdeviceptr p = 0;
        if (cuMemAllocAsync(&p, bytes, nullptr) != CUDA_SUCCESS || cuMemFreeAsync(p, nullptr) != CUDA_SUCCESS)
          ++failures;
      }
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
      print("loop_failures", failures);
      print("loop_ns_per_pair", n > 0 ? ns.count() / n : 0);
    } else if (cmd == "race") {
      // race THREADS SECONDS MAX_BYTES KIND (linear, pitch, managed, async,
      // pool: the pool of pool-create, vmm, array, graph, context, mixed)
      int threads = atoi(arg());
      double seconds = atof(arg());
      uint64_t max_bytes = parse_bytes(arg());
      race(threads, seconds, max_bytes, arg());
    } else if (cmd == "fork") {
      // The child runs the remaining commands; the parent waits for it and
      // reports how it ended, then stops.
      fflush(stdout);
      pid_t child = fork();
      if (child == 0) continue;
      int status = 0;
      waitpid(child, &status, 0);
      print("fork_child_exit", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
      return 0;
    } else if (cmd == "rtld-next") {
      // rtld_next_a's dlsym(RTLD_NEXT) must find rtld_next_b's definition (2).
      auto fn = reinterpret_cast<int (*)()>(rtld_next_from_a());
      print("rtld_next_who", fn ? fn() : 0);
    } else if (cmd == "rtld-default-local") {
      // rtld-default-local LIB: LIB loaded with RTLD_LOCAL, its
      // dlsym(RTLD_DEFAULT) must find its own dependency's function (7).
      void* lib = dlopen(arg(), RTLD_NOW | RTLD_LOCAL);
      auto from = lib ? reinterpret_cast<void* (*)()>(dlsym(lib, "rtld_default_from_local")) : nullptr;
      auto fn = from ? reinterpret_cast<int (*)()>(from()) : nullptr;
      print("rtld_default_local", fn ? fn() : 0);
    } else if (cmd == "load-race") {
      // load-race LIB: LIB's constructor calls cuInit while the main thread
      // makes the process's first driver call (the interposer's first load
      // of libcuda). Both must return: a deadlock ends the probe at 10 s.
      alarm(10);
      int signal[2];
      if (pipe(signal) != 0) usage("load-race: pipe");
      setenv("CTOR_DRIVER_SIGNAL_FD", std::to_string(signal[1]).c_str(), 1);
      const std::string lib = arg();
      void* handle = nullptr;
      std::thread loader([&] { handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL); });
      char byte = 0;
      if (read(signal[0], &byte, 1) != 1) usage("load-race: the constructor never ran");
      print("load_race_main", cuInit(0));
      loader.join();
      const auto* result = handle ? static_cast<const int*>(dlsym(handle, "ctor_driver_result")) : nullptr;
      print("load_race_ctor", result ? *result : -1);
    } else if (cmd == "free-at-exit") {
      atexit(free_at_exit);
    } else if (cmd == "hold") {
      print("holding", getpid());
      pause();
    } else if (cmd == "barrier") {
      // barrier DIR: create DIR/ready-<pid>, then wait (up to 30 s) for DIR/go,
      // so that several probes start their next step together.
      const std::string dir = arg();
      const std::string ready = dir + "/ready-" + std::to_string(getpid());
      FILE* f = fopen(ready.c_str(), "w");
      if (f == nullptr) usage("barrier: cannot create the ready file");
      fclose(f);
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (access((dir + "/go").c_str(), F_OK) != 0) {
        if (std::chrono::steady_clock::now() > give_up) usage("barrier: no go");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else if (cmd == "sleep-ms") {
      std::this_thread::sleep_for(std::chrono::milliseconds(atoi(arg())));
    } else if (cmd == "getproc") {
      // getproc SYMBOL CUDA_VERSION FLAGS: which function the caller receives.
      const char* symbol = arg();
      int version = atoi(arg());
      cuuint64_t flags = strtoull(arg(), nullptr, 0);
      void* fn = nullptr;
      CUdriverProcAddressQueryResult status{};
      CUresult r = cuGetProcAddress_v2(symbol, &fn, version, flags, &status);
      print("getproc", r);
      print("getproc_status", status);
      print_owner("getproc", fn);
    } else if (cmd == "getproc-v1") {
      const char* symbol = arg();
      int version = atoi(arg());
      void* fn = nullptr;
      using V1 = CUresult (*)(const char*, void**, int, cuuint64_t);
      // The v1 entry point, as old runtimes find it.
      auto v1 = reinterpret_cast<V1>(dlsym(driver_handle(), "cuGetProcAddress"));
      print_owner("getproc_v1_entry", reinterpret_cast<void*>(v1));
      CUresult r = v1 ? v1(symbol, &fn, version, 0) : CUDA_ERROR_NOT_FOUND;
      print("getproc_v1", r);
      print_owner("getproc_v1", fn);
    } else if (cmd == "dlsym") {
      print_owner("dlsym", dlsym(driver_handle(), arg()));
    } else if (cmd == "call-alloc-via-getproc") {
      // Resolve "cuMemAlloc" for a CUDA version and call it with the ABI
      // that version implies: 32-bit before 3.2, 64-bit after.
      int version = atoi(arg());
      uint64_t bytes = parse_bytes(arg());
      void* fn = nullptr;
      CUresult r = get_proc("cuMemAlloc", version, 0, &fn);
      if (r == CUDA_SUCCESS && version < 3020) {
        CUdeviceptr_v1 p = 0;
        r = reinterpret_cast<CUresult (*)(CUdeviceptr_v1*, unsigned int)>(fn)(&p, static_cast<unsigned>(bytes));
        if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      } else if (r == CUDA_SUCCESS) {
        CUdeviceptr p = 0;
        r = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(fn)(&p, bytes);
        if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      }
      print("call_alloc", r);
    } else if (cmd == "call-alloc-via-dlsym") {
      uint64_t bytes = parse_bytes(arg());
      auto fn = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(dlsym(driver_handle(), "cuMemAlloc_v2"));
      CUdeviceptr p = 0;
      CUresult r = fn ? fn(&p, bytes) : CUDA_ERROR_NOT_FOUND;
      if (r == CUDA_SUCCESS) g_ptrs.push_back(p);
      print("call_alloc_dlsym", r);
    } else if (cmd == "call-async-ptsz-via-getproc") {
      uint64_t bytes = parse_bytes(arg());
      void* fn = nullptr;
      CUresult r = get_proc("cuMemAllocAsync", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &fn);
      CUdeviceptr p = 0;
      if (r == CUDA_SUCCESS) r = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t, CUstream)>(fn)(&p, bytes, nullptr);
      if (r == CUDA_SUCCESS) g_async_ptrs.push_back(p);
      print("call_async_ptsz", r);
    } else if (cmd == "export-table") {
      const void* table = nullptr;
      CUuuid id{};
      print("export_table", cuGetExportTable(&table, &id));
    } else if (cmd == "sim-used" || cmd == "sim-peak" || cmd == "sim-reset-peak") {
      // Ground truth from the simulated driver's control interface.
      const int dev = atoi(arg());
      if (cmd == "sim-reset-peak") {
        auto fn = reinterpret_cast<void (*)(int)>(dlsym(driver_handle(), "simcuda_reset_peak"));
        if (!fn) usage("not the simulated driver");
        fn(dev);
        print("sim_reset_peak", 0);
      } else {
        auto fn = reinterpret_cast<uint64_t (*)(int)>(
            dlsym(driver_handle(), cmd == "sim-used" ? "simcuda_device_used" : "simcuda_device_peak"));
        if (!fn) usage("not the simulated driver");
        print(cmd == "sim-used" ? "sim_used" : "sim_peak", static_cast<long long>(fn(dev)));
      }
    } else if (cmd == "simcount") {
      const char* name = arg();
      printf("simcount_%s=%llu\n", name, static_cast<unsigned long long>(sim_count(name)));
      fflush(stdout);
    } else {
      usage(("unknown command " + cmd).c_str());
    }
  }
  return 0;
}

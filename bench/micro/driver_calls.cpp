// Driver-call microbenchmarks: what libfracgpu.so adds to single driver
// calls. One binary, linked against the simulated driver; run_micro.sh runs it
// natively and with LD_PRELOAD=libfracgpu.so, in alternation, and subtracts.
// Its direct calls bind to the interposer's exports when it is preloaded, so
// the same code measures both.
//
//   micro_driver_calls [--micro_device=N] [google benchmark flags]
//   micro_driver_calls [--micro_device=N] --micro_callgrind=N [--micro_only=NAME]
//
// --micro_device: the simulated device to use (the runner puts a tenant alone
//   on device 0 and two tenants on device 1).
// --micro_callgrind: instead of timing, run each call N times between
//   callgrind client requests (zero, then dump as "<name>"), so a run under
//   `valgrind --tool=callgrind` gives exact instructions per call. Without
//   valgrind the requests do nothing.
//
// The JSON context records which object the calls reach ("calls_reach") and
// the tenant, so the summary can refuse a run that was not what it claims.
#include <benchmark/benchmark.h>
#include <cuda.h>
#include <dlfcn.h>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_ZERO_STATS
#define CALLGRIND_DUMP_STATS_AT(name) ((void)(name))
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

CUdevice g_device = 0;
CUfunction g_kernel = nullptr;
void* g_libcuda = nullptr;

// One driver call per op, returning false on an error (the check costs the
// same with and without the interposer, so it cancels in the difference).
struct Op {
  const char* name;
  bool (*call)();
};

bool launch() {
  // A kernel of zero simulated duration: the device timeline never grows, so
  // no synchronization (and nothing that would disturb the timing) is needed.
  return cuLaunchKernel(g_kernel, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr) == CUDA_SUCCESS;
}

bool alloc_free() {
  CUdeviceptr p = 0;
  if (cuMemAlloc_v2(&p, 256) != CUDA_SUCCESS) return false;
  return cuMemFree_v2(p) == CUDA_SUCCESS;
}

bool mem_get_info() {
  size_t free_bytes = 0, total_bytes = 0;
  bool ok = cuMemGetInfo_v2(&free_bytes, &total_bytes) == CUDA_SUCCESS;
  benchmark::DoNotOptimize(free_bytes);
  return ok;
}

// What the CUDA 12 runtime does for every entry point it uses. The
// interposer maps the driver's answer back to its hook by scanning its table
// (hooks.def order): cuMemAlloc_v2 is found early; a function it does not
// hook (cuCtxGetDevice) costs the whole scan, the worst case.
bool get_proc_address_of(const char* symbol) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status{};
  bool ok = cuGetProcAddress_v2(symbol, &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_SUCCESS;
  benchmark::DoNotOptimize(fn);
  return ok && fn != nullptr;
}
bool get_proc_address() { return get_proc_address_of("cuMemAlloc"); }
bool get_proc_address_unhooked() { return get_proc_address_of("cuCtxGetDevice"); }

bool ctx_get_device() {
  // Not hooked: under the interposer it still binds straight to the driver.
  CUdevice device = -1;
  bool ok = cuCtxGetDevice(&device) == CUDA_SUCCESS;
  benchmark::DoNotOptimize(device);
  return ok;
}

// The same table scan as cuGetProcAddress, after glibc's own lookup.
bool dlsym_of(const char* symbol) {
  void* fn = dlsym(g_libcuda, symbol);
  benchmark::DoNotOptimize(fn);
  return fn != nullptr;
}
bool lookup_dlsym() { return dlsym_of("cuMemAlloc_v2"); }
bool lookup_dlsym_unhooked() { return dlsym_of("cuCtxGetDevice"); }

const Op kOps[] = {
    {"cuLaunchKernel", launch},
    {"cuMemAlloc_v2+cuMemFree_v2", alloc_free},
    {"cuMemGetInfo_v2", mem_get_info},
    {"cuGetProcAddress_v2", get_proc_address},
    {"cuGetProcAddress_v2_unhooked", get_proc_address_unhooked},
    {"cuCtxGetDevice", ctx_get_device},
    {"dlsym", lookup_dlsym},
    {"dlsym_unhooked", lookup_dlsym_unhooked},
};

void run_op(benchmark::State& state, const Op* op) {
  for (auto _ : state) {
    if (!op->call()) [[unlikely]] {
      state.SkipWithError("driver call failed");
      break;
    }
  }
}

bool check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  const char* name = nullptr;
  cuGetErrorName(r, &name);
  fprintf(stderr, "micro_driver_calls: %s failed: %s (%d)\n", what, name != nullptr ? name : "?", static_cast<int>(r));
  return false;
}

bool set_up(int ordinal) {
  CUcontext ctx = nullptr;
  CUmodule module = nullptr;
  static const char kImage[] = "any image: the simulated driver accepts it";
  if (!check(cuInit(0), "cuInit") || !check(cuDeviceGet(&g_device, ordinal), "cuDeviceGet") ||
      !check(cuDevicePrimaryCtxRetain(&ctx, g_device), "cuDevicePrimaryCtxRetain") ||
      !check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent") || !check(cuModuleLoadData(&module, kImage), "cuModuleLoadData") ||
      !check(cuModuleGetFunction(&g_kernel, module, "sleep_0us"), "cuModuleGetFunction"))
    return false;
  g_libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (g_libcuda == nullptr) {
    fprintf(stderr, "micro_driver_calls: libcuda.so.1 is not loaded: %s\n", dlerror());
    return false;
  }
  // Every call must work before anything is timed.
  for (const Op& op : kOps)
    if (!op.call()) {
      fprintf(stderr, "micro_driver_calls: %s failed during set-up\n", op.name);
      return false;
    }
  return true;
}

// The file that defines the cuMemAlloc_v2 the binary's calls bind to.
std::string calls_reach() {
  Dl_info info{};
  void* address = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
  if (address == nullptr || dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "unknown";
  const char* slash = strrchr(info.dli_fname, '/');
  return slash != nullptr ? slash + 1 : info.dli_fname;
}

int run_callgrind(long iterations, const char* only) {
  for (const Op& op : kOps) {
    if (only != nullptr && strcmp(only, op.name) != 0) continue;
    // Warm: lazy binding, first-use paths and caches stay out of the count.
    for (int i = 0; i < 1000; ++i) op.call();
    CALLGRIND_ZERO_STATS;
    for (long i = 0; i < iterations; ++i) op.call();
    CALLGRIND_DUMP_STATS_AT(op.name);
  }
  return 0;
}

// Removes "--micro_<key>=value" from argv; returns the value or null.
const char* take_flag(int* argc, char** argv, const char* key) {
  const size_t length = strlen(key);
  for (int i = 1; i < *argc; ++i) {
    if (strncmp(argv[i], key, length) != 0 || argv[i][length] != '=') continue;
    const char* value = argv[i] + length + 1;
    for (int j = i; j + 1 < *argc; ++j) argv[j] = argv[j + 1];
    --*argc;
    return value;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  const char* device = take_flag(&argc, argv, "--micro_device");
  const char* callgrind = take_flag(&argc, argv, "--micro_callgrind");
  const char* only = take_flag(&argc, argv, "--micro_only");
  // A real CUDA process is never single-threaded: the driver starts its own
  // threads in cuInit. The simulated driver starts none, and glibc and
  // libstdc++ skip atomics in a process that has never had a second thread
  // (mutexes, shared_ptr counts, both in the simulated driver's calls). The
  // interposer starts one, so without this the native runs alone would get
  // the cheaper locks, and the difference would bill the interposer for them
  // (8 ns of a call the interposer does not touch, on an Intel Xeon).
  std::thread([] {}).join();
  if (!set_up(device != nullptr ? atoi(device) : 0)) return 1;
  if (callgrind != nullptr) return run_callgrind(atol(callgrind), only);

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  const char* tenant = getenv("FRACGPU_TENANT");
  benchmark::AddCustomContext("calls_reach", calls_reach());
  benchmark::AddCustomContext("tenant", tenant != nullptr ? tenant : "");
  benchmark::AddCustomContext("device", std::to_string(g_device));
  for (const Op& op : kOps) benchmark::RegisterBenchmark(op.name, run_op, &op);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

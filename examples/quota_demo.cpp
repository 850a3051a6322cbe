// A small CUDA driver API workload that shows a memory quota at work: what
// the GPU looks like from inside the tenant, where allocations stop, and
// that the process carries on after being refused.
//
//   quota_demo [CHUNK_MIB] [HOLD_SECONDS]
#include <cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

const char* error_name(CUresult r) {
  const char* name = nullptr;
  return cuGetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr ? name : "?";
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines in order when several run at once
  const size_t chunk = (argc > 1 ? strtoull(argv[1], nullptr, 10) : 512) << 20;
  const int hold_seconds = argc > 2 ? atoi(argv[2]) : 0;
  CUresult r = cuInit(0);
  if (r != CUDA_SUCCESS) {
    printf("[%d] cuInit: %s\n", getpid(), error_name(r));
    return 1;
  }
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  char name[128] = {};
  cuDeviceGet(&dev, 0);
  cuDeviceGetName(name, sizeof name, dev);
  if ((r = cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS || (r = cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) {
    printf("[%d] context: %s\n", getpid(), error_name(r));
    return 1;
  }
  size_t free_bytes = 0, total_bytes = 0;
  cuMemGetInfo(&free_bytes, &total_bytes);
  printf("[%d] %s: total %.0f MiB, free %.0f MiB (as this tenant sees it)\n", getpid(), name, mib(total_bytes),
         mib(free_bytes));

  std::vector<CUdeviceptr> held;
  for (;;) {
    CUdeviceptr p = 0;
    r = cuMemAlloc(&p, chunk);
    if (r != CUDA_SUCCESS) break;
    held.push_back(p);
  }
  printf("[%d] allocated %zu x %.0f MiB = %.0f MiB, then: %s\n", getpid(), held.size(), mib(chunk),
         mib(held.size() * chunk), error_name(r));
  cuMemGetInfo(&free_bytes, &total_bytes);
  printf("[%d] free now %.0f MiB of %.0f MiB; the process goes on\n", getpid(), mib(free_bytes), mib(total_bytes));
  if (!held.empty()) {
    cuMemFree(held.back());
    held.pop_back();
    CUdeviceptr p = 0;
    r = cuMemAlloc(&p, chunk);
    printf("[%d] freed one chunk, allocated it again: %s\n", getpid(), error_name(r));
    if (r == CUDA_SUCCESS) held.push_back(p);
  }
  if (hold_seconds > 0) std::this_thread::sleep_for(std::chrono::seconds(hold_seconds));
  for (CUdeviceptr p : held) cuMemFree(p);
  cuDevicePrimaryCtxRelease(dev);
  return 0;
}

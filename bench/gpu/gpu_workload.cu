// Real-GPU benchmark workload (bench/gpu/run_gpu.sh; docs/performance.md,
// "Real GPU"). Two shapes of GPU use:
//
//   compute  a long arithmetic kernel (about --kernel-ms each) over the whole
//            GPU, back to back, synchronizing every --sync-every kernels;
//   launch   a stream of tiny kernels (one block, a few instructions) as fast
//            as the CPU launches them, synchronizing every --sync-every.
//   step     an interactive loop: one kernel that spins about --kernel-us
//            (one block; clock64 against the GPU's clock rate), then
//            --host-us of busy CPU work (default 1.2 x --kernel-us), a
//            synchronize every --sync-every (default 64): launch-bound, nothing
//            queued ahead (docs/sm-time.md, measured mode).
//
// Unless --no-cupti, it measures its own GPU time with CUPTI activity records
// (the kernels' start and end timestamps as the GPU recorded them),
// independent of fracgpu, which never uses CUPTI. GPU time = the union of the
// process's kernel intervals inside the timed window. A kernel's start-end
// also covers time in which another context held the GPU (time-slicing) or
// ran beside it (MPS), so this is a share of the GPU only where one process's
// kernels run at a time (fracgpu tenants). CUPTI's per-kernel record adds a
// fixed cost to every launch: throughput is measured with --no-cupti.
//
//   gpu_workload --mode compute|launch|step --seconds S
//                [--start-file F | --start-ns NS] [--ready-file F]
//                [--iterations N] [--blocks B] [--kernel-ms 5]
//                [--sync-every N] [--kernel-us U] [--host-us U] [--no-cupti]
//   gpu_workload --mode compute --calibrate [--kernel-ms 5] [--blocks B]
//
// The compute kernel runs B blocks (default 8 per SM) of N iterations. With
// --calibrate it times the kernel alone (the median of 9 event-timed
// kernels), prints {"iterations": N, "blocks": B, "kernel_ms": ...} for
// about --kernel-ms per kernel and exits: run_gpu.sh does this once, on an idle
// GPU, and passes the same N and B to every process of every run, so that
// kernels are the same length in every run compared. Without --iterations a
// process calibrates itself the same way (for use by hand).
//
// Warms up (context, module, a few kernels), writes --ready-file, waits for
// the common start (CLOCK_MONOTONIC ns, read from --start-file once it
// exists), runs S seconds and prints one JSON line: mode, kernels, seconds,
// rate (kernels/s), iterations, blocks, cupti (0/1), gpu_time_s and
// gpu_fraction (GPU time / window; null without CUPTI), cupti_dropped. Exit 0,
// 1 on a CUDA or CUPTI error, 2 on a bad argument.
//
// Build: bench/gpu/build_workload.sh (nvcc, -lcupti; run_gpu.sh calls it).
#include <cuda_runtime.h>
#include <cupti.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

#define CUDA_OK(call)                                                                     \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "gpu_workload: %s: %s\n", #call, cudaGetErrorString(e_));           \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

#define CUPTI_OK(call)                                                                    \
  do {                                                                                    \
    CUptiResult r_ = (call);                                                              \
    if (r_ != CUPTI_SUCCESS) {                                                            \
      const char* s_ = nullptr;                                                           \
      cuptiGetResultString(r_, &s_);                                                      \
      fprintf(stderr, "gpu_workload: %s: %s\n", #call, s_ != nullptr ? s_ : "?");        \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

__global__ void compute_kernel(float* out, int iterations) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f;
  for (int i = 0; i < iterations; ++i) {
    a = fmaf(a, b, c);
    b = fmaf(b, c, a) * 0.5f;
  }
  if (a == 12345.0f) out[blockIdx.x] = b;  // never true: keeps the loop alive
}

__global__ void spin_kernel(float* out, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  if (threadIdx.x == 0) out[blockIdx.x] += 1.0f;
}

__global__ void tiny_kernel(float* out) {
  if (threadIdx.x == 0) out[blockIdx.x] += 1.0f;
}

uint64_t now_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Kernel intervals (GPU timestamps, ns) from CUPTI's completed buffers.
std::mutex g_mutex;
std::vector<std::pair<uint64_t, uint64_t>> g_intervals;
std::atomic<uint64_t> g_dropped{0};

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = 8u << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t stream_id, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
      // start/end sit at the same place in every kernel record version.
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      g_intervals.emplace_back(k->start, k->end);
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, stream_id, &dropped) == CUPTI_SUCCESS) g_dropped += dropped;
  free(buffer);
}

// Union of the intervals clipped to [lo, hi]: GPU time in the window.
uint64_t busy_in(uint64_t lo, uint64_t hi) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::sort(g_intervals.begin(), g_intervals.end());
  uint64_t busy = 0, cur_s = 0, cur_e = 0;
  bool open = false;
  for (auto [s, e] : g_intervals) {
    s = std::max(s, lo);
    e = std::min(e, hi);
    if (e <= s) continue;
    if (open && s <= cur_e) {
      cur_e = std::max(cur_e, e);
      continue;
    }
    if (open) busy += cur_e - cur_s;
    cur_s = s, cur_e = e, open = true;
  }
  if (open) busy += cur_e - cur_s;
  return busy;
}

struct Options {
  std::string mode;
  double seconds = 0;
  std::string start_file, ready_file;
  uint64_t start_ns = 0;
  double kernel_ms = 5;
  int sync_every = 0;  // 0: the mode's default
  long iterations = 0;  // 0: calibrate to kernel_ms
  int blocks = 0;       // 0: 8 per SM
  double kernel_us = 10, host_us = 0;  // step; host_us 0: 1.2 x kernel_us
  bool cupti = true, calibrate = false;
};

int usage(const char* why) {
  fprintf(stderr, "gpu_workload: %s\nusage: gpu_workload --mode compute|launch|step --seconds S [--start-file F | --start-ns NS] "
                  "[--ready-file F] [--iterations N] [--blocks B] [--kernel-ms MS] [--sync-every N] [--kernel-us U] "
                  "[--host-us U] [--no-cupti]\n"
                  "       gpu_workload --mode compute --calibrate [--kernel-ms MS] [--blocks B]\n", why);
  return 2;
}

constexpr int kThreads = 256;

// Median length (ms) of 9 compute kernels of `iterations`, each timed alone
// between two events after one untimed kernel.
int median_kernel_ms(cudaStream_t stream, float* out, int blocks, long iterations, float* ms) {
  cudaEvent_t a = nullptr, b = nullptr;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  compute_kernel<<<blocks, kThreads, 0, stream>>>(out, static_cast<int>(iterations));
  std::vector<float> t;
  for (int i = 0; i < 9; ++i) {
    CUDA_OK(cudaEventRecord(a, stream));
    compute_kernel<<<blocks, kThreads, 0, stream>>>(out, static_cast<int>(iterations));
    CUDA_OK(cudaEventRecord(b, stream));
    CUDA_OK(cudaEventSynchronize(b));
    float v = 0;
    CUDA_OK(cudaEventElapsedTime(&v, a, b));
    t.push_back(v);
  }
  std::sort(t.begin(), t.end());
  *ms = t[t.size() / 2];
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  return 0;
}

// Iterations for a kernel of about kernel_ms: scale a first guess, measure
// again, scale once more (the length is close to linear in iterations).
int calibrate(cudaStream_t stream, float* out, int blocks, double kernel_ms, long* iterations, float* ms) {
  long n = 1 << 14;
  for (int round = 0; round < 2; ++round) {
    if (median_kernel_ms(stream, out, blocks, n, ms) != 0) return 1;
    const double scaled = n * (kernel_ms / std::max(*ms, 1e-3f));
    n = std::clamp<long>(static_cast<long>(scaled), 1, 1L << 30);
  }
  if (median_kernel_ms(stream, out, blocks, n, ms) != 0) return 1;
  *iterations = n;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-cupti") {
      o.cupti = false;
      continue;
    }
    if (a == "--calibrate") {
      o.calibrate = true;
      continue;
    }
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const char* v = argv[++i];
    if (a == "--mode") o.mode = v;
    else if (a == "--seconds") o.seconds = atof(v);
    else if (a == "--start-file") o.start_file = v;
    else if (a == "--start-ns") o.start_ns = strtoull(v, nullptr, 10);
    else if (a == "--ready-file") o.ready_file = v;
    else if (a == "--kernel-ms") o.kernel_ms = atof(v);
    else if (a == "--sync-every") o.sync_every = atoi(v);
    else if (a == "--iterations") o.iterations = atol(v);
    else if (a == "--blocks") o.blocks = atoi(v);
    else if (a == "--kernel-us") o.kernel_us = atof(v);
    else if (a == "--host-us") o.host_us = atof(v);
    else return usage(("unknown option " + a).c_str());
  }
  if (o.mode != "compute" && o.mode != "launch" && o.mode != "step") return usage("--mode must be compute, launch or step");
  if (o.kernel_us <= 0 || o.host_us < 0) return usage("--kernel-us must be above 0, --host-us not below");
  if (o.calibrate && o.mode != "compute") return usage("--calibrate is for --mode compute");
  if ((!o.calibrate && o.seconds <= 0) || o.kernel_ms <= 0) return usage("--seconds and --kernel-ms must be above 0");
  if (o.iterations < 0 || o.iterations > (1L << 30) || o.blocks < 0) return usage("--iterations and --blocks must be positive");
  const bool compute = o.mode == "compute", step = o.mode == "step";
  const int sync_every = o.sync_every > 0 ? o.sync_every : (compute ? 4 : step ? 64 : 1024);
  // step: the spin kernel's cycles for kernel_us at the GPU's clock (kHz).
  int clock_khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const long long spin_cycles = static_cast<long long>(o.kernel_us * clock_khz / 1000.0);
  const uint64_t host_ns = static_cast<uint64_t>((o.host_us > 0 ? o.host_us : o.kernel_us * 1.2) * 1000);

  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* out = nullptr;
  CUDA_OK(cudaMalloc(&out, 4096 * sizeof(float)));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Under MPS the SM count is the client's limited one: run_gpu.sh passes
  // --blocks so that every process runs the same kernel.
  const int blocks = o.blocks > 0 ? o.blocks : sms * 8;

  long iterations = o.iterations;
  float calibrated_ms = 0;
  if (compute && iterations == 0 && calibrate(stream, out, blocks, o.kernel_ms, &iterations, &calibrated_ms) != 0) return 1;
  if (o.calibrate) {
    printf("{\"iterations\": %ld, \"blocks\": %d, \"kernel_ms\": %.4f, \"sms\": %d}\n", iterations, blocks,
           calibrated_ms, sms);
    return 0;
  }
  for (int i = 0; i < 16; ++i) tiny_kernel<<<1, 32, 0, stream>>>(out);
  if (compute) compute_kernel<<<blocks, kThreads, 0, stream>>>(out, static_cast<int>(iterations));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamSynchronize(stream));

  if (o.cupti) {
    CUPTI_OK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    CUPTI_OK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  }

  if (!o.ready_file.empty()) {
    FILE* f = fopen(o.ready_file.c_str(), "w");
    if (f != nullptr) fputs("ready\n", f), fclose(f);
  }
  if (!o.start_file.empty()) {
    for (;;) {
      FILE* f = fopen(o.start_file.c_str(), "r");
      unsigned long long v = 0;
      if (f != nullptr && fscanf(f, "%llu", &v) == 1) o.start_ns = v;
      if (f != nullptr) fclose(f);
      if (o.start_ns != 0) break;
      usleep(2000);
    }
  }
  while (now_ns() < o.start_ns) usleep(200);

  uint64_t gpu_lo = 0, gpu_hi = 0;
  if (o.cupti) CUPTI_OK(cuptiGetTimestamp(&gpu_lo));
  const uint64_t t0 = now_ns(), end = t0 + static_cast<uint64_t>(o.seconds * 1e9);
  unsigned long long kernels = 0;
  while (now_ns() < end) {
    for (int i = 0; i < sync_every; ++i) {
      if (compute) {
        compute_kernel<<<blocks, kThreads, 0, stream>>>(out, static_cast<int>(iterations));
      } else if (step) {
        spin_kernel<<<1, 32, 0, stream>>>(out, spin_cycles);
        const uint64_t until = now_ns() + host_ns;
        while (now_ns() < until) {
        }
      } else {
        tiny_kernel<<<1, 32, 0, stream>>>(out);
      }
    }
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaStreamSynchronize(stream));
    kernels += sync_every;
  }
  const double wall = (now_ns() - t0) / 1e9;
  char gpu_time[64] = "null", gpu_fraction[64] = "null";
  if (o.cupti) {
    CUPTI_OK(cuptiGetTimestamp(&gpu_hi));
    CUPTI_OK(cuptiActivityFlushAll(1));
    const double gpu_s = busy_in(gpu_lo, gpu_hi) / 1e9;
    snprintf(gpu_time, sizeof gpu_time, "%.4f", gpu_s);
    snprintf(gpu_fraction, sizeof gpu_fraction, "%.4f", gpu_s / wall);
  }
  printf("{\"mode\": \"%s\", \"kernels\": %llu, \"seconds\": %.3f, \"rate\": %.2f, \"iterations\": %ld, "
         "\"blocks\": %d, \"threads\": %d, \"cupti\": %d, \"gpu_time_s\": %s, \"gpu_fraction\": %s, "
         "\"cupti_dropped\": %llu, \"pid\": %d}\n",
         o.mode.c_str(), kernels, wall, kernels / wall, compute ? iterations : 0L, compute ? blocks : 1,
         compute ? kThreads : 32, o.cupti ? 1 : 0, gpu_time, gpu_fraction,
         static_cast<unsigned long long>(g_dropped.load()), static_cast<int>(getpid()));
  return 0;
}

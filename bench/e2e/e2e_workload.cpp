// End-to-end benchmark workloads (bench/e2e/run_e2e.sh; docs/performance.md).
// Each is a shape of real GPU use that stresses a different part of fracgpu:
//
//   launch   many tiny kernels as fast as the CPU can launch them, one
//            synchronize every `sync_every` launches: the per-launch cost of
//            the interposer's gate (and of the hand-overs between tenants).
//   compute  long kernels back to back, about `ahead_us` of work queued ahead
//            (double-buffered events, as a training loop between syncs): the
//            GPU time a tenant gets, the hand-over drains.
//   step     an interactive loop (inference, a notebook): one kernel, then
//            `host_us` of CPU work (busy), a synchronize every `sync_every`
//            steps; with host_us above kernel_us the GPU waits for the CPU
//            (launch-bound, nothing queued ahead).
//   alloc    a caching allocator's pattern: bursts of cuMemAlloc/cuMemFree of
//            varying sizes, then cuMemAllocAsync/cuMemFreeAsync on a stream,
//            one tiny kernel and a stream synchronize per burst: the memory
//            quota's accounting on every allocation and free.
//   cheat    a tenant that games a sampling GPU-time meter (NVML samples
//            which process is on the GPU at instants k x `period_ms` of
//            CLOCK_MONOTONIC, as the stand-in NVML does with
//            SIMNVML_SAMPLE_MS): one thread launches `kernel_us` kernels
//            back to back, each synchronized before the next, but launches
//            none whose kernel (run at once) would end within `guard_ms`
//            before an instant, nor any until 1 ms after it, so the GPU
//            holds none of its work at the instant. A kernel that waits for
//            the GPU behind another process's work can still be there.
//
//   e2e_workload mode=launch|step|compute|alloc|cheat key=value ...
//     seconds=5        how long to run, from the start
//     start_ns=T       wait until CLOCK_MONOTONIC T before starting (a common
//                      start for tenants started one after another)
//     kernel_us=N      kernel length (default: launch 1, step 10, compute 5000,
//                      alloc 1, cheat 2000)
//     ahead_us=20000   compute: work kept queued ahead
//     sync_every=256   launch, step: launches between synchronizes
//     host_us=0        step: CPU work after each launch (default 1.2 x kernel_us)
//     burst=32         alloc: allocations per burst
//     period_ms=167    cheat: the meter's sampling period
//     guard_ms=8       cheat: idle from this long before each sampling instant
//
// Prints one line of key=value: mode, ops (launches, kernels or allocator
// calls), seconds (measured), rate (ops/s), unit. Exit 0, or 1 on a CUDA
// error (printed), 64 on a bad argument.
#include <cuda.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::string mode;
  double seconds = 5;
  uint64_t start_ns = 0;
  unsigned kernel_us = 0;  // 0: the mode's default
  unsigned ahead_us = 20000;
  unsigned sync_every = 256;
  unsigned host_us = 0;  // 0: the mode's default
  unsigned burst = 32;
  unsigned period_ms = 167;
  unsigned guard_ms = 8;
};

uint64_t now_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

bool check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  const char* name = nullptr;
  cuGetErrorName(r, &name);
  fprintf(stderr, "e2e_workload: %s: %s (%d)\n", what, name != nullptr ? name : "?", static_cast<int>(r));
  return false;
}

#define CHECK(call)                          \
  do {                                       \
    if (!check((call), #call)) return false; \
  } while (0)

struct Workload {
  const Options& o;
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  CUfunction kernel = nullptr;
  unsigned long long ops = 0;

  explicit Workload(const Options& options) : o(options) {}

  bool setup() {
    CUdevice dev = 0;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CUmodule module = nullptr;
    static const char image[] = "simulated";  // the simulated driver takes any image
    CHECK(cuModuleLoadData(&module, image));
    unsigned us = o.kernel_us != 0 ? o.kernel_us
                  : o.mode == "compute" ? 5000
                  : o.mode == "cheat"   ? 2000
                  : o.mode == "step"    ? 10
                                        : 1;
    const std::string name = "sleep_" + std::to_string(us) + "us";
    CHECK(cuModuleGetFunction(&kernel, module, name.c_str()));
    return true;
  }

  bool launch() { return check(cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel"); }

  bool run_launch(uint64_t end) {
    while (now_ns() < end) {
      for (unsigned i = 0; i < o.sync_every; ++i) {
        if (!launch()) return false;
        ++ops;
      }
      CHECK(cuStreamSynchronize(stream));
    }
    return true;
  }

  bool run_step(uint64_t end) {
    const unsigned kernel_us = o.kernel_us != 0 ? o.kernel_us : 10;
    const uint64_t host_ns = (o.host_us != 0 ? o.host_us : kernel_us * 6 / 5) * 1000ull;
    while (now_ns() < end) {
      for (unsigned i = 0; i < o.sync_every; ++i) {
        if (!launch()) return false;
        ++ops;
        const uint64_t until = now_ns() + host_ns;
        while (now_ns() < until) {
        }
      }
      CHECK(cuStreamSynchronize(stream));
    }
    return true;
  }

  bool run_compute(uint64_t end) {
    // Double buffering: mark each batch, then wait for the one before it, so
    // about one batch stays queued and the GPU never runs dry.
    CUevent older = nullptr, newer = nullptr;
    CHECK(cuEventCreate(&older, CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventCreate(&newer, CU_EVENT_DISABLE_TIMING));
    const unsigned us = o.kernel_us != 0 ? o.kernel_us : 5000;
    unsigned batch_us = 0;
    bool have_older = false;
    while (now_ns() < end) {
      if (!launch()) return false;
      ++ops;
      batch_us += us;
      if (batch_us < o.ahead_us) continue;
      batch_us = 0;
      CHECK(cuEventRecord(newer, stream));
      if (have_older) CHECK(cuEventSynchronize(older));
      std::swap(older, newer);
      have_older = true;
    }
    CHECK(cuStreamSynchronize(stream));
    cuEventDestroy_v2(older);
    cuEventDestroy_v2(newer);
    return true;
  }

  bool run_cheat(uint64_t end) {
    const uint64_t kernel_ns = (o.kernel_us != 0 ? o.kernel_us : 2000) * 1000ull;
    const uint64_t period_ns = o.period_ms * 1'000'000ull;
    const uint64_t guard_ns = o.guard_ms * 1'000'000ull;
    while (true) {
      const uint64_t now = now_ns();
      if (now >= end) break;
      // The next sampling instant strictly after now, and the one before.
      const uint64_t next = (now / period_ns + 1) * period_ns;
      const uint64_t prev = next - period_ns;
      if (now < prev + 1'000'000 || now + kernel_ns + guard_ns > next) {
        // Inside the idle window: sleep until 1 ms after the next instant
        // (or after the one just passed), or the end.
        const uint64_t resume = now < prev + 1'000'000 ? prev + 1'000'000 : next + 1'000'000;
        const uint64_t until = std::min(resume, end);
        struct timespec ts {};
        ts.tv_sec = static_cast<time_t>(until / 1'000'000'000ull);
        ts.tv_nsec = static_cast<long>(until % 1'000'000'000ull);
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
        continue;
      }
      if (!launch()) return false;
      ++ops;
      CHECK(cuStreamSynchronize(stream));
    }
    return true;
  }

  bool run_alloc(uint64_t end) {
    // Sizes from 4 KiB to 8 MiB in a fixed pseudo-random order (a linear
    // congruential sequence: the same run every time, no allocation of ours).
    uint32_t seed = 12345;
    auto next_size = [&seed] {
      seed = seed * 1664525u + 1013904223u;
      return static_cast<size_t>(4096) << ((seed >> 24) % 12);
    };
    // cuMemAlloc_v2/cuMemFree_v2: what cuda.h's macros turn an application's
    // cuMemAlloc into (this build declares the real versioned names).
    std::vector<CUdeviceptr> blocks(o.burst, 0);
    while (now_ns() < end) {
      for (auto& b : blocks) {
        CHECK(cuMemAlloc_v2(&b, next_size()));
        ++ops;
      }
      // Free in an order other than allocation order, as a cache evicts.
      for (size_t i = 0; i < blocks.size(); i += 2) CHECK(cuMemFree_v2(blocks[i]));
      for (size_t i = 1; i < blocks.size(); i += 2) CHECK(cuMemFree_v2(blocks[i]));
      ops += blocks.size();
      for (auto& b : blocks) {
        CHECK(cuMemAllocAsync(&b, next_size(), stream));
        ++ops;
      }
      if (!launch()) return false;
      for (auto& b : blocks) {
        CHECK(cuMemFreeAsync(b, stream));
        ++ops;
      }
      CHECK(cuStreamSynchronize(stream));
    }
    return true;
  }
};

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const char* eq = strchr(argv[i], '=');
    if (eq == nullptr) {
      fprintf(stderr, "e2e_workload: expected key=value, got %s\n", argv[i]);
      return false;
    }
    const std::string key(argv[i], static_cast<size_t>(eq - argv[i]));
    const char* value = eq + 1;
    if (key == "mode") o->mode = value;
    else if (key == "seconds") o->seconds = atof(value);
    else if (key == "start_ns") o->start_ns = strtoull(value, nullptr, 10);
    else if (key == "kernel_us") o->kernel_us = static_cast<unsigned>(atoi(value));
    else if (key == "ahead_us") o->ahead_us = static_cast<unsigned>(atoi(value));
    else if (key == "sync_every") o->sync_every = static_cast<unsigned>(atoi(value));
    else if (key == "host_us") o->host_us = static_cast<unsigned>(atoi(value));
    else if (key == "burst") o->burst = static_cast<unsigned>(atoi(value));
    else if (key == "period_ms") o->period_ms = static_cast<unsigned>(atoi(value));
    else if (key == "guard_ms") o->guard_ms = static_cast<unsigned>(atoi(value));
    else {
      fprintf(stderr, "e2e_workload: unknown key %s\n", key.c_str());
      return false;
    }
  }
  if (o->mode != "launch" && o->mode != "compute" && o->mode != "alloc" && o->mode != "step" && o->mode != "cheat") {
    fprintf(stderr, "e2e_workload: mode must be launch, step, compute, alloc or cheat, not \"%s\"\n", o->mode.c_str());
    return false;
  }
  if (o->mode == "cheat" && (o->period_ms == 0 || uint64_t{o->guard_ms} + 1 + ((o->kernel_us != 0 ? o->kernel_us : 2000) + 999) / 1000 >= o->period_ms)) {
    fprintf(stderr, "e2e_workload: cheat: period_ms must leave room for guard_ms, 1 ms and a kernel\n");
    return false;
  }
  if (o->seconds <= 0 || o->sync_every == 0 || o->burst == 0) {
    fprintf(stderr, "e2e_workload: seconds, sync_every and burst must be above 0\n");
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 64;
  Workload w(o);
  if (!w.setup()) return 1;
  while (o.start_ns != 0 && now_ns() < o.start_ns) std::this_thread::sleep_for(std::chrono::microseconds(200));
  const uint64_t start = now_ns();
  const uint64_t end = start + static_cast<uint64_t>(o.seconds * 1e9);
  bool ok = o.mode == "launch"    ? w.run_launch(end)
            : o.mode == "step"    ? w.run_step(end)
            : o.mode == "compute" ? w.run_compute(end)
            : o.mode == "cheat"   ? w.run_cheat(end)
                                  : w.run_alloc(end);
  const double seconds = static_cast<double>(now_ns() - start) / 1e9;
  const char* unit = o.mode == "launch" || o.mode == "step"   ? "launches/s"
                     : o.mode == "compute" || o.mode == "cheat" ? "kernels/s"
                                                                : "calls/s";
  printf("mode=%s ops=%llu seconds=%.3f rate=%.1f unit=%s\n", o.mode.c_str(), w.ops, seconds,
         static_cast<double>(w.ops) / seconds, unit);
  return ok ? 0 : 1;
}

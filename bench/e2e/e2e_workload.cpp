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
//   inference  a latency-critical service (issue 24): bursts of `burst`
//            kernels of `kernel_us` (default 20 x 100 us: 2 ms of GPU work),
//            burst k arriving at k x `period_ms` (default 10) + uniform
//            (-`jitter_us`, +`jitter_us`) from the start (independent per
//            burst, from `seed`, so every run sees the same arrivals); one
//            thread launches a burst's kernels, then synchronizes the
//            stream. A burst's latency: CLOCK_MONOTONIC from before its
//            first launch to after the synchronize returns. A burst whose
//            arrival has passed when the one before ends starts at once (its
//            latency still counts from its first launch: the queueing
//            behind its own late predecessor is the service's, not the
//            GPU's). None starts after the window: bursts left over then
//            (`missed`) would run on a GPU the other tenants have left, at
//            their alone latency, and hide the wait that made them late.
//   training  a training loop's kernels (default 2000 us) with `inflight`
//            of them kept in flight: 1 launches, synchronizes, launches
//            (shape a); 1000 waits, before each launch, on an event recorded
//            after the kernel launched 1000 before (shape b, what PyTorch's
//            queueing ahead does). ops counts the kernels complete at the
//            end of the window; the ones still in flight are then waited for
//            (not counted) so that none is left on the GPU for the next run.
//
//   e2e_workload mode=launch|step|compute|alloc|cheat|inference|training key=value ...
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
//     burst=20         inference: kernels per burst
//     period_ms=10     inference: time between burst arrivals
//     jitter_us=1000   inference: each arrival moves by up to this, either way
//     seed=1           inference: the arrivals' random sequence
//     latency_file=F   inference: write each burst's latency (ns), one a line
//     inflight=1       training: kernels kept in flight (1: shape a, 1000: b)
//
// Prints one line of key=value: mode, ops (launches, kernels or allocator
// calls), seconds (measured; training: to the window's end, without the
// drain), rate (ops/s), unit; inference adds bursts (measured), late (of
// them, started after their arrival: the one before had not ended), missed
// (arrived in the window but not started in it), p50_ms, p99_ms, p999_ms,
// max_ms (nearest-rank percentiles of the bursts' latencies). Exit 0, or 1 on
// a CUDA error (printed), 64 on a bad argument.
#include <cuda.h>
#include <time.h>

#include <algorithm>
#include <cmath>
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
  unsigned burst = 0;      // 0: the mode's default (alloc 32, inference 20)
  unsigned period_ms = 0;  // 0: the mode's default (cheat 167, inference 10)
  unsigned guard_ms = 8;
  unsigned jitter_us = 1000;
  uint64_t seed = 1;
  std::string latency_file;
  unsigned inflight = 1;
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
  std::vector<uint64_t> latencies;  // inference: each burst's, in ns
  unsigned long long late = 0;      // inference: bursts started after their arrival
  unsigned long long missed = 0;    // inference: arrived in the window, not started in it
  uint64_t stopped_ns = 0;          // training: when the window ended (before the drain)

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
                  : o.mode == "cheat"     ? 2000
                  : o.mode == "training"  ? 2000
                  : o.mode == "inference" ? 100
                  : o.mode == "step"      ? 10
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

  bool run_inference(uint64_t start, uint64_t end) {
    // splitmix64: a fixed, portable sequence (std::uniform_*_distribution's
    // output is the library's choice, and the arrivals must not change with it).
    uint64_t state = o.seed;
    auto next_random = [&state] {
      uint64_t z = (state += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return z ^ (z >> 31);
    };
    const int64_t period_ns = int64_t{o.period_ms} * 1'000'000;
    const int64_t jitter_ns = int64_t{o.jitter_us} * 1000;
    for (uint64_t k = 0;; ++k) {
      // uniform in [-jitter, +jitter] (to 1 ns; the modulo's bias is far below that)
      const uint64_t span = static_cast<uint64_t>(2 * jitter_ns + 1);
      const int64_t jitter = jitter_ns == 0 ? 0 : static_cast<int64_t>(next_random() % span) - jitter_ns;
      const int64_t offset = static_cast<int64_t>(k) * period_ns + jitter;
      const uint64_t arrival = offset <= 0 ? start : start + static_cast<uint64_t>(offset);
      if (arrival >= end) break;
      if (now_ns() >= end) {
        ++missed;
        continue;
      }
      if (now_ns() < arrival) {
        struct timespec ts {};
        ts.tv_sec = static_cast<time_t>(arrival / 1'000'000'000ull);
        ts.tv_nsec = static_cast<long>(arrival % 1'000'000'000ull);
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
      } else if (k != 0) {
        ++late;
      }
      const uint64_t t0 = now_ns();
      for (unsigned i = 0; i < o.burst; ++i) {
        if (!launch()) return false;
        ++ops;
      }
      CHECK(cuStreamSynchronize(stream));
      latencies.push_back(now_ns() - t0);
    }
    return true;
  }

  bool run_training(uint64_t end) {
    // A ring of events, one per kernel in flight: before launching kernel i,
    // wait for the event recorded after kernel i - inflight, so that at most
    // `inflight` kernels are queued, and the CPU runs ahead of the GPU by
    // that much as a framework's launch queue lets it.
    std::vector<CUevent> ring(o.inflight, nullptr);
    for (auto& e : ring) CHECK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    unsigned long long launched = 0;
    while (now_ns() < end) {
      CUevent& slot = ring[launched % o.inflight];
      if (launched >= o.inflight) {
        CHECK(cuEventSynchronize(slot));
        ++ops;  // kernel launched - inflight has completed
      }
      if (!launch()) return false;
      CHECK(cuEventRecord(slot, stream));
      ++launched;
    }
    stopped_ns = now_ns();
    // Kernels still in the ring that completed in the window count too (with
    // 1000 in flight, a short run would otherwise count none of its last 2 s).
    for (unsigned long long i = launched > o.inflight ? launched - o.inflight : 0; i < launched; ++i) {
      const CUresult r = cuEventQuery(ring[i % o.inflight]);
      if (r == CUDA_ERROR_NOT_READY) break;  // in stream order: the later ones are not done either
      CHECK(r);
      ++ops;
    }
    // The window is over: what is still in flight is not counted, but it
    // must leave the (shared, simulated) GPU before the next run starts.
    CHECK(cuStreamSynchronize(stream));
    for (auto& e : ring) cuEventDestroy_v2(e);
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
    else if (key == "jitter_us") o->jitter_us = static_cast<unsigned>(atoi(value));
    else if (key == "seed") o->seed = strtoull(value, nullptr, 10);
    else if (key == "latency_file") o->latency_file = value;
    else if (key == "inflight") o->inflight = static_cast<unsigned>(atoi(value));
    else {
      fprintf(stderr, "e2e_workload: unknown key %s\n", key.c_str());
      return false;
    }
  }
  if (o->mode != "launch" && o->mode != "compute" && o->mode != "alloc" && o->mode != "step" && o->mode != "cheat" &&
      o->mode != "inference" && o->mode != "training") {
    fprintf(stderr,
            "e2e_workload: mode must be launch, step, compute, alloc, cheat, inference or training, not \"%s\"\n",
            o->mode.c_str());
    return false;
  }
  if (o->burst == 0) o->burst = o->mode == "inference" ? 20 : 32;
  if (o->period_ms == 0) o->period_ms = o->mode == "inference" ? 10 : 167;
  if (o->mode == "cheat" && (uint64_t{o->guard_ms} + 1 + ((o->kernel_us != 0 ? o->kernel_us : 2000) + 999) / 1000 >= o->period_ms)) {
    fprintf(stderr, "e2e_workload: cheat: period_ms must leave room for guard_ms, 1 ms and a kernel\n");
    return false;
  }
  if (o->seconds <= 0 || o->sync_every == 0 || o->inflight == 0) {
    fprintf(stderr, "e2e_workload: seconds, sync_every and inflight must be above 0\n");
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
            : o.mode == "cheat"     ? w.run_cheat(end)
            : o.mode == "inference" ? w.run_inference(start, end)
            : o.mode == "training"  ? w.run_training(end)
                                    : w.run_alloc(end);
  const double seconds = static_cast<double>((w.stopped_ns != 0 ? w.stopped_ns : now_ns()) - start) / 1e9;
  const char* unit = o.mode == "launch" || o.mode == "step" ? "launches/s"
                     : o.mode == "compute" || o.mode == "cheat" || o.mode == "inference" || o.mode == "training"
                         ? "kernels/s"
                         : "calls/s";
  std::string extra;
  if (o.mode == "inference") {
    std::vector<uint64_t> sorted = w.latencies;
    std::sort(sorted.begin(), sorted.end());
    // Nearest rank: the smallest latency with at least p of the bursts at or
    // below it (with under 1000 bursts, p99.9 is the largest).
    auto pct_ms = [&sorted](double p) {
      if (sorted.empty()) return 0.0;
      const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
      return static_cast<double>(sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1]) / 1e6;
    };
    char buf[256];
    snprintf(buf, sizeof buf, " bursts=%zu late=%llu missed=%llu p50_ms=%.3f p99_ms=%.3f p999_ms=%.3f max_ms=%.3f",
             sorted.size(), w.late, w.missed, pct_ms(0.50), pct_ms(0.99), pct_ms(0.999), pct_ms(1.0));
    extra = buf;
    if (!o.latency_file.empty()) {
      FILE* f = fopen(o.latency_file.c_str(), "w");
      if (f == nullptr) {
        perror(o.latency_file.c_str());
        ok = false;
      } else {
        for (uint64_t ns : w.latencies) fprintf(f, "%llu\n", static_cast<unsigned long long>(ns));
        fclose(f);
      }
    }
  }
  printf("mode=%s ops=%llu seconds=%.3f rate=%.1f unit=%s%s\n", o.mode.c_str(), w.ops, seconds,
         static_cast<double>(w.ops) / seconds, unit, extra.c_str());
  return ok ? 0 : 1;
}

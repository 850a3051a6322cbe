// timeslice_probe: what the GPU's own time-slicing looks like from inside a
// context. One thread spins for a while reading the GPU's global timer
// (%globaltimer, ns, one clock for every context on the GPU) and records every
// gap between two consecutive readings longer than a threshold: while its
// context is switched out it reads nothing, so the gaps are the times other
// contexts (and the switches) had the GPU. Run two or more at once and
// bench/gpu/timeslice_report.py lines their logs up into the slice length and
// the switch gap (tests/gpu/run_timeslice.sh does both).
//
//   timeslice_probe [--seconds S] [--gap-ns N] [--max-gaps K] [--idle]
//
// Prints one JSON line: {"pid", "start_ns", "end_ns", "gap_ns", "gaps": [[from,
// to], ...], "overflow"} on the global timer's clock. Exit 0, or 1 with a
// message when CUDA fails.
// --idle: a process with a context on the GPU that runs nothing for S
// seconds (after the warm-up launch), and prints {"pid", "idle": true}: the
// observer of run_timeslice.sh's CUPTI run, which asks whether a process
// receives other processes' context switches.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Log {
  uint64_t start, end;
  unsigned long long count;  // gaps seen (may exceed the buffer)
};

// One thread: spin for `span` ns of the global clock, noting each gap > min_gap.
__global__ void spin(uint64_t span, uint64_t min_gap, uint64_t* gaps, unsigned long long max_gaps, Log* log) {
  const uint64_t start = global_ns();
  uint64_t prev = start, now = start;
  unsigned long long n = 0;
  while (now - start < span) {
    now = global_ns();
    if (now - prev > min_gap) {
      if (n < max_gaps) {
        gaps[2 * n] = prev;
        gaps[2 * n + 1] = now;
      }
      ++n;
    }
    prev = now;
  }
  log->start = start;
  log->end = now;
  log->count = n;
}

bool check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "timeslice_probe: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 2.0;
  unsigned long long gap_ns = 3000, max_gaps = 1 << 18;
  bool idle = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--idle") == 0) {
      idle = true;
      continue;
    }
    const auto value = [&](const char* name) -> const char* {
      if (std::strcmp(argv[i], name) != 0) return nullptr;
      if (i + 1 >= argc) {
        std::fprintf(stderr, "timeslice_probe: %s needs a value\n", name);
        std::exit(64);
      }
      return argv[++i];
    };
    if (const char* v = value("--seconds")) {
      seconds = std::atof(v);
    } else if (const char* v = value("--gap-ns")) {
      gap_ns = std::strtoull(v, nullptr, 10);
    } else if (const char* v = value("--max-gaps")) {
      max_gaps = std::strtoull(v, nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: timeslice_probe [--seconds S] [--gap-ns N] [--max-gaps K] [--idle]\n");
      return 64;
    }
  }
  if (!(seconds > 0 && seconds <= 60) || gap_ns == 0 || max_gaps == 0 || max_gaps > (1ull << 24)) {
    std::fprintf(stderr, "timeslice_probe: --seconds in (0, 60], --gap-ns > 0, --max-gaps in [1, 2^24]\n");
    return 64;
  }
  uint64_t* d_gaps = nullptr;
  Log* d_log = nullptr;
  if (!check(cudaMalloc(&d_gaps, 2 * max_gaps * sizeof(uint64_t)), "cudaMalloc") ||
      !check(cudaMalloc(&d_log, sizeof(Log)), "cudaMalloc"))
    return 1;
  // A short first launch: the context and the module are loaded before the
  // measured spin starts.
  spin<<<1, 1>>>(1000000, gap_ns, d_gaps, max_gaps, d_log);
  if (!check(cudaDeviceSynchronize(), "warm-up")) return 1;
  if (idle) {
    usleep(static_cast<useconds_t>(seconds * 1e6));
    std::printf("{\"pid\": %d, \"idle\": true}\n", static_cast<int>(getpid()));
    return 0;
  }
  spin<<<1, 1>>>(static_cast<uint64_t>(seconds * 1e9), gap_ns, d_gaps, max_gaps, d_log);
  if (!check(cudaGetLastError(), "launch") || !check(cudaDeviceSynchronize(), "spin")) return 1;
  Log log{};
  if (!check(cudaMemcpy(&log, d_log, sizeof log, cudaMemcpyDeviceToHost), "cudaMemcpy")) return 1;
  const unsigned long long kept = log.count < max_gaps ? log.count : max_gaps;
  std::vector<uint64_t> gaps(2 * kept);
  if (kept > 0 && !check(cudaMemcpy(gaps.data(), d_gaps, gaps.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost),
                         "cudaMemcpy"))
    return 1;
  std::printf("{\"pid\": %d, \"start_ns\": %llu, \"end_ns\": %llu, \"gap_ns\": %llu, \"overflow\": %s, \"gaps\": [",
              static_cast<int>(getpid()), static_cast<unsigned long long>(log.start),
              static_cast<unsigned long long>(log.end), gap_ns, log.count > max_gaps ? "true" : "false");
  for (unsigned long long i = 0; i < kept; ++i)
    std::printf("%s[%llu, %llu]", i ? ", " : "", static_cast<unsigned long long>(gaps[2 * i]),
                static_cast<unsigned long long>(gaps[2 * i + 1]));
  std::printf("]}\n");
  return 0;
}

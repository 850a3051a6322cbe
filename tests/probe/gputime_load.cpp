// A saturating GPU workload for the GPU-time tests and benchmark: one thread
// per device, each launching kernels back to back on its own stream through
// the chosen entry point, keeping a bounded amount of work queued ahead (as
// a training or inference loop does between synchronizations).
//
//   gputime_load key=value ...
//     devices=0,1       devices to load, one thread each (default 0)
//     kernels_us=50,50000  kernel lengths, cycled (the sim runs sleep_<N>us for N us)
//     seconds=10        how long to keep launching
//     ahead_us=2000     queue about this much work ahead, then wait for the older half
//     host_us=0         after each launch, spin this long on the CPU (the host-side work
//                       of an interactive loop: with host_us above the kernel length the
//                       load is launch-bound and queues nothing ahead)
//     path=kernel       kernel | kernel_ptsz | ex | ex_ptsz | coop | coop_ptsz | multi |
//                       graph | graph_ptsz | graph_mem (graph, in a process that also
//                       holds an exec with a memory-allocation node: the interposer's
//                       path for graphs with memory) | legacy | legacy_grid | legacy_async |
//                       getproc (cuLaunchKernel as cuGetProcAddress gives it, as the
//                       CUDA runtime finds it) |
//                       multi_pair (devices=A,B: one thread, current on A, launching a
//                       kernel on A, then one cooperative kernel on A and B together) |
//                       capture (capture the kernel into a graph on the stream, then
//                       launch the graph; the launch into the capturing stream is timed)
//     start_ns=T        wait until CLOCK_MONOTONIC T before launching
//     pause_ms=0,0      after `seconds`, optionally idle this long, then launch again this long
//     switch=set|push   one thread for all devices, launching on each in turn and
//                       changing context between launches with cuCtxSetCurrent, or
//                       cuCtxPushCurrent/cuCtxPopCurrent (default: a thread per device)
//     switch=create     one thread for all devices, one after the other: each device's
//                       run in a context made current only by cuCtxCreate, for `seconds`
//     leave_after_s=S   (a thread per device) the thread of the last of `devices` stops
//                       after S seconds and releases its primary context: the process
//                       leaves that GPU and runs on the others for `seconds`
//     fork_after=S      run S seconds, then fork: the child starts CUDA afresh and runs
//                       `seconds`; the parent waits for it and exits with its status
//     last_us=N         after the run, launch one N us kernel and exit without waiting
//                       for it (the process exits while it holds the GPU)
//     dodge_ms=P        the phase-locked cheat: the driver samples at multiples of P ms of
//                       CLOCK_MONOTONIC (the stand-in NVML's timeline, SIMNVML_SAMPLE_MS);
//                       from guard_ms before each such instant until 1 ms after it, launch
//                       nothing and wait for the queue to empty, so no sample finds this
//                       process on the GPU
//     guard_ms=8        (with dodge_ms or timed_ms) how long before each instant to stop
//     timed_ms=P        the long kernel timed between samples: 1 ms after each multiple of
//                       P ms of CLOCK_MONOTONIC (the stand-in NVML's sampling instants),
//                       launch the first of kernels_us (it waits for a grant), then one
//                       kernel that ends guard_ms before the next instant (whole ms), and
//                       wait for it: every sample finds another tenant's work, while this
//                       one runs on past its grant
//     exit_at_ms=P      one link of a chain of short-lived processes: once set up, launch
//                       until exit_after_ms past the first multiple of P ms of CLOCK_MONOTONIC
//                       more than 1 ms away (the stand-in NVML's next sampling instant), then
//                       exit (`seconds` is ignored): the sample names a process that is gone
//                       by the time anyone asks whose it is
//     exit_after_ms=2   (with exit_at_ms) how long after that instant to exit
//     ahead_us=0        launch one kernel at a time: synchronize after each
//     flood_after_ms=T  a tenant that looks light, then floods: for T ms launch only the
//                       first of kernels_us, with host_us and ahead_us as given; from then
//                       on only the last, back to back (no host work), flood_ahead_us
//                       queued ahead
//     flood_ahead_us=100000  (with flood_after_ms) how much to queue ahead while flooding
//     flood_slice_us=S  (with flood_after_ms; simulated driver only) when the flood starts,
//                       set the process's own time slice to S us (a real process may at
//                       any time: the driver's channel-group control needs no privilege)
//     kernels=sim       sim: the simulated driver's sleep_<N>us kernels; ptx: on a real GPU,
//                       one spin kernel of fixed work (a dependent integer chain, not a
//                       clock: cut by another context's slice, it takes the same GPU time),
//                       N us each as measured alone at the start (path=kernel only)
//     spin_per_us=R     (kernels=ptx) the spin kernel's iterations per us, instead of
//                       measuring them at the start (where other processes may already
//                       share the GPU); kernels=ptx alone prints the figure it measured
//     instants=clock    where dodge_ms, timed_ms and exit_at_ms put the sampling instants:
//                       clock, multiples of their period of CLOCK_MONOTONIC (the stand-in
//                       NVML's timeline); nvml, as a tenant on a real GPU would learn them:
//                       period and phase from the timestamps of the device's utilization
//                       samples (nvmlDeviceGetSamples), read again every second (the clock's
//                       until a sample is there). Prints instants_period_us= and
//                       instants_phase_us= (of CLOCK_MONOTONIC) once learned. Under
//                       the interposer (which shows a tenant none of the device's
//                       samples) a helper process started without it reads them:
//                       gputime_load nvml_stamps=BUS prints the ring's timestamps
//     burst=N,P,J       an inference service (device 0, path=kernel): bursts of N kernels
//                       (kernels_us), the k-th arriving at k*P us + uniform(-J, +J) us
//                       after the start (seed 1); a burst whose arrival is past starts at
//                       once. Each burst's latency: from before its first launch to the
//                       return of the stream's synchronization after its last. Prints
//                       bursts=, p50_us=, p99_us=, p999_us=, max_us= (whole run)
//
// Prints launches_<device>=N when done, step_max_us=N (the longest time one
// launch took with the wait for older work after it: how long the load was
// stalled at worst, in the runs of `seconds` on a thread per device), and,
// for path=capture, capture_launch_max_us=N: the slowest launch into a
// capturing stream.
// Exit 0, or 1 on a CUDA error (printed).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fracgpu/nvml_abi.h"

namespace {

struct Options {
  std::vector<int> devices{0};
  std::vector<unsigned> kernels_us{1000};
  double seconds = 10;
  unsigned ahead_us = 2000;
  unsigned host_us = 0;
  std::string path = "kernel";
  uint64_t start_ns = 0;
  unsigned pause_ms = 0;
  double resume_seconds = 0;
  std::string switch_mode;  // "", "set", "push" or "create"
  double fork_after = 0;
  double leave_after_s = 0;  // leave_after_s
  unsigned last_us = 0;
  unsigned dodge_ms = 0;
  unsigned timed_ms = 0;
  unsigned guard_ms = 8;
  unsigned exit_at_ms = 0;
  unsigned exit_after_ms = 2;
  unsigned flood_after_ms = 0;
  unsigned flood_ahead_us = 100000;
  unsigned flood_slice_us = 0;
  std::vector<unsigned> burst;  // N, P us, J us
  bool ptx_kernels = false;  // kernels=ptx
  double spin_per_us = 0;    // kernels=ptx: 0, measure
  bool nvml_instants = false;  // instants=nvml
};

uint64_t now_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Sleeps until CLOCK_MONOTONIC reaches t_ns.
void sleep_until(uint64_t t_ns) {
  for (uint64_t t = now_ns(); t < t_ns; t = now_ns()) {
    struct timespec ts {static_cast<time_t>((t_ns - t) / 1'000'000'000ull), static_cast<long>((t_ns - t) % 1'000'000'000ull)};
    nanosleep(&ts, nullptr);
  }
}

std::vector<unsigned> parse_list(const char* s) {
  std::vector<unsigned> out;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    out.push_back(static_cast<unsigned>(strtoul(p, &end, 10)));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

bool check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  const char* name = nullptr;
  cuGetErrorName(r, &name);
  fprintf(stderr, "gputime_load: %s: %s (%d)\n", what, name != nullptr ? name : "?", static_cast<int>(r));
  return false;
}

#define CHECK(call)                  \
  do {                               \
    if (!check((call), #call)) return false; \
  } while (0)

// kernels=ptx: fixed work, so a kernel cut by another context's time slice
// still takes its GPU time (a spin on %globaltimer would end by the wall
// clock). The sink, never non-null here, keeps ptxas from dropping the loop.
constexpr char kSpinPtx[] = R"(.version 7.0
.target sm_70
.address_size 64
.visible .entry fracgpu_spin(.param .u64 fracgpu_spin_iterations, .param .u64 fracgpu_spin_sink)
{
  .reg .pred %p<3>;
  .reg .b64 %rd<5>;
  ld.param.u64 %rd1, [fracgpu_spin_iterations];
  ld.param.u64 %rd2, [fracgpu_spin_sink];
  mov.u64 %rd3, 0;
  mov.u64 %rd4, 1;
  setp.eq.u64 %p1, %rd1, 0;
  @%p1 bra DONE;
LOOP:
  mad.lo.u64 %rd4, %rd4, 6364136223846793005, 1442695040888963407;
  add.u64 %rd3, %rd3, 1;
  setp.lt.u64 %p2, %rd3, %rd1;
  @%p2 bra LOOP;
DONE:
  setp.eq.u64 %p1, %rd2, 0;
  @%p1 bra END;
  st.global.u64 [%rd2], %rd4;
END:
  ret;
}
)";

// NVML's ring of GPU-utilization samples of one device, read in this
// process.
class NvmlRing {
 public:
  // False (and says why) where NVML or the device at PCI bus id `bus` is not there.
  bool open(const char* bus) {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      fprintf(stderr, "gputime_load: instants=nvml: no libnvidia-ml.so.1 (%s); the clock's instants\n", dlerror());
      return false;
    }
    auto init = reinterpret_cast<decltype(&nvmlInit_v2)>(dlsym(lib, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<decltype(&nvmlDeviceGetHandleByPciBusId_v2)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    get_samples_ = reinterpret_cast<decltype(&nvmlDeviceGetSamples)>(dlsym(lib, "nvmlDeviceGetSamples"));
    if (init == nullptr || by_bus == nullptr || get_samples_ == nullptr || init() != NVML_SUCCESS ||
        by_bus(bus, &device_) != NVML_SUCCESS) {
      fprintf(stderr, "gputime_load: instants=nvml: NVML has no device %s; the clock's instants\n", bus);
      get_samples_ = nullptr;
    }
    return get_samples_ != nullptr;
  }

  // The timestamps (us, CPU time) of the samples now in the ring; empty
  // when there are none.
  std::vector<unsigned long long> stamps() const {
    nvmlValueType_t type{};
    unsigned count = 0;
    if (get_samples_ == nullptr ||
        get_samples_(device_, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &count, nullptr) != NVML_SUCCESS || count == 0)
      return {};
    std::vector<nvmlSample_t> ring(count);
    if (get_samples_(device_, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &count, ring.data()) != NVML_SUCCESS) return {};
    std::vector<unsigned long long> out;
    for (unsigned i = 0; i < count && i < ring.size(); ++i) out.push_back(ring[i].timeStamp);
    return out;
  }

 private:
  decltype(&nvmlDeviceGetSamples) get_samples_ = nullptr;
  nvmlDevice_t device_ = nullptr;
};

// Where the driver's sampling instants are. clock: multiples of the given
// period of CLOCK_MONOTONIC (the stand-in NVML's). nvml: learned from the
// timestamps of the device's utilization samples, as a tenant on a real GPU
// can (its container has NVML): the period from the span of the samples in
// the ring, the phase from the newest, read again every second. Under the
// interposer a tenant's NVML shows none of the device's samples, so the
// ring is read as a hostile tenant would: by a process of its container
// started without the interposer (this program again, nvml_stamps=BUS), in
// a thread of its own so that no launch waits for it.
class Instants {
 public:
  void use_nvml(int cuda_device) {
    if (cuDeviceGetPCIBusId(bus_, sizeof bus_, cuda_device) != CUDA_SUCCESS) {
      fprintf(stderr, "gputime_load: instants=nvml: no PCI bus id of device %d; the clock's instants\n", cuda_device);
      return;
    }
    const char* preload = getenv("LD_PRELOAD");
    if (preload == nullptr || *preload == 0) {
      in_process_ = ring_.open(bus_);
      return;
    }
    std::thread([this] {
      while (true) {
        std::vector<unsigned long long> stamps = helper_stamps();
        bool learned = false;
        {
          std::lock_guard<std::mutex> hold(mutex_);
          learn(std::move(stamps));
          learned = learned_;
        }
        std::this_thread::sleep_for(std::chrono::nanoseconds(read_interval_ns(learned)));
      }
    }).detach();
  }

  // The last instant at or before t and the first one after it (given_ns:
  // the clock's period).
  struct Around {
    uint64_t last, next;
  };
  Around around(uint64_t t, uint64_t given_ns) {
    std::lock_guard<std::mutex> hold(mutex_);
    if (in_process_ && (read_ns_ == 0 || t - read_ns_ >= read_interval_ns(learned_))) {
      read_ns_ = t;
      learn(ring_.stamps());
    }
    const uint64_t period = learned_ ? period_ns_ : given_ns, phase = learned_ ? phase_ns_ : 0;
    const uint64_t last = t - (t % period + period - phase) % period;
    return {last, last + period};
  }

 private:
  // How often the ring is read: every 100 ms until learned, then every second.
  static uint64_t read_interval_ns(bool learned) { return learned ? 1'000'000'000ull : 100'000'000ull; }

  // The ring as a process of the same container without the interposer reads it.
  std::vector<unsigned long long> helper_stamps() const {
    char self[4096] = {};
    if (readlink("/proc/self/exe", self, sizeof self - 1) <= 0) return {};
    const std::string command = std::string("env -u LD_PRELOAD '") + self + "' nvml_stamps=" + bus_ + " 2>/dev/null";
    FILE* out = popen(command.c_str(), "r");
    if (out == nullptr) return {};
    std::vector<unsigned long long> stamps;
    unsigned long long stamp = 0;
    while (fscanf(out, "%llu", &stamp) == 1) stamps.push_back(stamp);
    pclose(out);
    return stamps;
  }

  // Period and phase from the ring's stamps, read just now (under mutex_).
  void learn(std::vector<unsigned long long> stamps) {
    std::sort(stamps.begin(), stamps.end());
    stamps.erase(std::unique(stamps.begin(), stamps.end()), stamps.end());
    if (stamps.size() < 2) return;
    // A sample is missing where the GPU idled through its period: the
    // shortest gap is one period; the whole span, in such periods, the
    // average one.
    unsigned long long gap = ~0ull;
    for (size_t i = 1; i < stamps.size(); ++i) gap = std::min(gap, stamps[i] - stamps[i - 1]);
    const unsigned long long span = stamps.back() - stamps.front();
    const unsigned long long periods = std::max(1ull, (span + gap / 2) / gap);
    const uint64_t period_ns = span * 1000ull / periods;
    if (period_ns < 1'000'000ull) return;
    // NVML's stamps are CPU time in us (CLOCK_REALTIME); instants here are
    // CLOCK_MONOTONIC.
    struct timespec real {};
    clock_gettime(CLOCK_REALTIME, &real);
    const uint64_t real_ns = static_cast<uint64_t>(real.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(real.tv_nsec);
    const int64_t newest_mono = static_cast<int64_t>(stamps.back() * 1000ull) - static_cast<int64_t>(real_ns) +
                                static_cast<int64_t>(now_ns());
    if (newest_mono <= 0) return;
    period_ns_ = period_ns;
    phase_ns_ = static_cast<uint64_t>(newest_mono) % period_ns;
    if (!learned_) {
      printf("instants_period_us=%llu\ninstants_phase_us=%llu\n", static_cast<unsigned long long>(period_ns_ / 1000),
             static_cast<unsigned long long>(phase_ns_ / 1000));
      fflush(stdout);
    }
    learned_ = true;
  }

  char bus_[32] = {};
  NvmlRing ring_;
  bool in_process_ = false;  // the ring is read in this process
  std::mutex mutex_;
  uint64_t read_ns_ = 0;
  bool learned_ = false;
  uint64_t period_ns_ = 0, phase_ns_ = 0;
};

Instants g_instants;

// A driver function found at run time, as an old application's loader
// finds the deprecated launches (through the interposer's dlsym when it is
// preloaded); also the stand-in's own controls. Exits if the driver has none.
template <class Fn>
Fn driver_symbol(const char* name) {
  static void* symbol = dlsym(RTLD_DEFAULT, name);
  if (symbol == nullptr) {
    fprintf(stderr, "gputime_load: the driver has no %s\n", name);
    exit(1);
  }
  return reinterpret_cast<Fn>(symbol);
}

struct Launcher {
  explicit Launcher(const Options& options) : o(options) {}
  const Options& o;
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  std::vector<CUfunction> functions;
  std::vector<CUgraphExec> graphs;
  CUgraphExec memory_graph = nullptr;  // path=graph_mem: an exec with a memory-allocation node
  CUmodule module = nullptr;
  std::map<uint64_t, CUfunction> timed_functions;  // timed_ms, last_us: the long kernels, by length in us
  CUfunction spin = nullptr;                        // kernels=ptx: every kernel is this one
  double spin_per_us = 0;                           // kernels=ptx: its iterations per us
  std::vector<unsigned long long> iterations;       // kernels=ptx: functions[i]'s
  PFN_cuLaunchKernel_v4000 launch_from_getproc = nullptr;  // path=getproc
  unsigned long long launches = 0;
  uint64_t capture_launch_max_ns = 0;
  uint64_t step_max_ns = 0;  // the longest step: a launch, and the wait for older work that may follow

  // created: a context of its own, current through cuCtxCreate alone;
  // otherwise the primary context, made current with cuCtxSetCurrent.
  bool setup(int device, bool created = false) {
    CUdevice dev = 0;
    CHECK(cuDeviceGet(&dev, device));
    if (created) {
      CHECK(cuCtxCreate_v2(&ctx, 0, dev));
    } else {
      CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
      CHECK(cuCtxSetCurrent(ctx));
    }
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    if (o.ptx_kernels) return setup_spin();
    static const char image[] = "simulated";  // the simulated driver takes any image
    CHECK(cuModuleLoadData(&module, image));
    for (unsigned us : o.kernels_us) {
      CUfunction f = nullptr;
      const std::string name = "sleep_" + std::to_string(us) + "us";
      CHECK(cuModuleGetFunction(&f, module, name.c_str()));
      functions.push_back(f);
      if (o.path.rfind("graph", 0) == 0) {
        CUgraph g = nullptr;
        CHECK(cuGraphCreate(&g, 0));
        CUDA_KERNEL_NODE_PARAMS p{};
        p.func = f;
        p.gridDimX = p.gridDimY = p.gridDimZ = 1;
        p.blockDimX = p.blockDimY = p.blockDimZ = 1;
        CUgraphNode node = nullptr;
        CHECK(cuGraphAddKernelNode_v2(&node, g, nullptr, 0, &p));
        CUgraphExec exec = nullptr;
        CHECK(cuGraphInstantiateWithFlags(&exec, g, 0));
        graphs.push_back(exec);
      }
    }
    if (o.path == "graph_mem") {
      // Never launched: its existence is what takes graph launches down the
      // interposer's graph-memory path.
      CUgraph g = nullptr;
      CHECK(cuGraphCreate(&g, 0));
      CUDA_MEM_ALLOC_NODE_PARAMS p{};
      p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
      p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      p.poolProps.location.id = device;
      p.bytesize = 2 << 20;
      CUgraphNode node = nullptr;
      CHECK(cuGraphAddMemAllocNode(&node, g, nullptr, 0, &p));
      CHECK(cuGraphInstantiateWithFlags(&memory_graph, g, 0));
    }
    if (o.path == "getproc") {
      void* fn = nullptr;
      CUdriverProcAddressQueryResult found{};
      CHECK(cuGetProcAddress_v2("cuLaunchKernel", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found));
      launch_from_getproc = reinterpret_cast<PFN_cuLaunchKernel_v4000>(fn);
    }
    return true;
  }

  // kernels=ptx: the spin kernel, and its iterations per us, measured alone
  // (the shortest of three runs of at least a millisecond) unless given.
  bool setup_spin() {
    CHECK(cuModuleLoadData(&module, kSpinPtx));
    CHECK(cuModuleGetFunction(&spin, module, "fracgpu_spin"));
    spin_per_us = o.spin_per_us;
    if (spin_per_us <= 0) {
      CUevent from = nullptr, to = nullptr;
      CHECK(cuEventCreate(&from, CU_EVENT_DEFAULT));
      CHECK(cuEventCreate(&to, CU_EVENT_DEFAULT));
      unsigned long long n = 1ull << 14;
      float best_ms = 0;
      for (;;) {
        best_ms = 0;
        for (int trial = 0; trial < 3; ++trial) {
          CHECK(cuEventRecord(from, stream));
          CHECK(launch_spin(n));
          CHECK(cuEventRecord(to, stream));
          CHECK(cuEventSynchronize(to));
          float ms = 0;
          CHECK(cuEventElapsedTime(&ms, from, to));
          if (trial == 0 || ms < best_ms) best_ms = ms;
        }
        if (best_ms >= 1.0f || n >= (1ull << 40)) break;
        n *= best_ms > 0.01f ? static_cast<unsigned long long>(2.0f / best_ms) + 1 : 64;
      }
      cuEventDestroy(from);
      cuEventDestroy(to);
      if (best_ms <= 0) {
        fprintf(stderr, "gputime_load: the spin kernel took no time\n");
        return false;
      }
      spin_per_us = static_cast<double>(n) / (best_ms * 1000.0);
      printf("spin_per_us=%.3f\n", spin_per_us);
      fflush(stdout);
    }
    for (unsigned us : o.kernels_us) {
      functions.push_back(spin);
      iterations.push_back(spin_iterations(us));
    }
    return true;
  }

  unsigned long long spin_iterations(uint64_t us) const {
    return std::max(1ull, static_cast<unsigned long long>(static_cast<double>(us) * spin_per_us));
  }

  CUresult launch_spin(unsigned long long n) {
    unsigned long long sink = 0;
    void* args[] = {&n, &sink};
    return cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, stream, args, nullptr);
  }

  // A kernel of us microseconds outside the cycle of kernels_us (timed_ms,
  // last_us): sleep_<us>us on the simulated driver, the spin on a GPU.
  CUresult launch_us(uint64_t us) {
    if (o.ptx_kernels) return launch_spin(spin_iterations(us));
    CUfunction& f = timed_functions[us];
    if (f == nullptr) {
      if (CUresult r = cuModuleGetFunction(&f, module, ("sleep_" + std::to_string(us) + "us").c_str())) return r;
    }
    return cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr);
  }

  // Captures f into a graph on the stream, then launches the graph. The
  // launch into the capturing stream runs nothing, so it must never wait
  // for the GPU: its latency is recorded.
  bool launch_captured(CUfunction f) {
    CHECK(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    const uint64_t t0 = now_ns();
    CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
    capture_launch_max_ns = std::max(capture_launch_max_ns, now_ns() - t0);
    CUgraph graph = nullptr;
    CHECK(cuStreamEndCapture(stream, &graph));
    CUgraphExec exec = nullptr;
    CHECK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    CHECK(cuGraphLaunch(exec, stream));
    CHECK(cuGraphExecDestroy(exec));
    CHECK(cuGraphDestroy(graph));
    return true;
  }

  bool launch(size_t i) {
    CUfunction f = functions[i];
    const std::string& p = o.path;
    if (p == "kernel" && o.ptx_kernels) CHECK(launch_spin(iterations[i]));
    else if (p == "kernel") CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
    else if (p == "getproc") CHECK(launch_from_getproc(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
    else if (p == "kernel_ptsz") CHECK(cuLaunchKernel_ptsz(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
    else if (p == "ex" || p == "ex_ptsz") {
      CUlaunchConfig config{};
      config.gridDimX = config.gridDimY = config.gridDimZ = 1;
      config.blockDimX = 32;
      config.blockDimY = config.blockDimZ = 1;
      config.hStream = stream;
      if (p == "ex") CHECK(cuLaunchKernelEx(&config, f, nullptr, nullptr));
      else CHECK(cuLaunchKernelEx_ptsz(&config, f, nullptr, nullptr));
    } else if (p == "coop") CHECK(cuLaunchCooperativeKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr));
    else if (p == "coop_ptsz") CHECK(cuLaunchCooperativeKernel_ptsz(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr));
    else if (p == "multi") {
      CUDA_LAUNCH_PARAMS params{};
      params.function = f;
      params.gridDimX = params.gridDimY = params.gridDimZ = 1;
      params.blockDimX = 32;
      params.blockDimY = params.blockDimZ = 1;
      params.hStream = stream;
      CHECK(cuLaunchCooperativeKernelMultiDevice(&params, 1, 0));
    } else if (p == "graph" || p == "graph_mem") CHECK(cuGraphLaunch(graphs[i], stream));
    else if (p == "graph_ptsz") CHECK(cuGraphLaunch_ptsz(graphs[i], stream));
    else if (p == "legacy") CHECK(driver_symbol<decltype(&cuLaunch)>("cuLaunch")(f));
    else if (p == "legacy_grid") CHECK(driver_symbol<decltype(&cuLaunchGrid)>("cuLaunchGrid")(f, 1, 1));
    else if (p == "legacy_async") CHECK(driver_symbol<decltype(&cuLaunchGridAsync)>("cuLaunchGridAsync")(f, 1, 1, stream));
    else if (p == "capture") {
      if (!launch_captured(f)) return false;
    } else {
      fprintf(stderr, "gputime_load: unknown path %s\n", p.c_str());
      return false;
    }
    ++launches;
    return true;
  }

  // The legacy launches go to the null stream: wait on that one.
  CUstream sync_stream() const { return o.path.rfind("legacy", 0) == 0 && o.path != "legacy_async" ? nullptr : stream; }

  // One run, step by step (with this launcher's context current).
  CUevent older = nullptr, newer = nullptr;
  uint64_t batch_us = 0;
  size_t next = 0;
  uint64_t flood_at_ns = 0;  // flood_after_ms: when the light phase ends
  bool slice_set = false;    // flood_slice_us: set at the flood's start
  bool have_older = false;

  bool begin() {
    CHECK(cuEventCreate(&older, CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventCreate(&newer, CU_EVENT_DISABLE_TIMING));
    batch_us = 0;
    next = 0;
    have_older = false;
    flood_at_ns = o.flood_after_ms != 0 ? now_ns() + o.flood_after_ms * 1'000'000ull : 0;
    return true;
  }

  // dodge_ms: if a sampling instant is near, empty the queue and sleep past it.
  bool dodge() {
    if (o.dodge_ms == 0) return true;
    const uint64_t given = o.dodge_ms * 1'000'000ull, guard = o.guard_ms * 1'000'000ull;
    const uint64_t now = now_ns();
    const Instants::Around instant = g_instants.around(now, given);
    const uint64_t kernel_ns = o.kernels_us[next] * 1000ull, since = now - instant.last;
    if (now + kernel_ns + guard < instant.next && since >= 1'000'000ull) return true;
    CHECK(cuStreamSynchronize(sync_stream()));
    const uint64_t resume = (since < 1'000'000ull ? instant.last : instant.next) + 1'000'000ull;
    sleep_until(resume);
    batch_us = 0;
    return true;
  }

  // timed_ms: one grant's tiny kernel, then one long kernel that runs on
  // past the grant and ends just before the next sampling instant.
  bool timed_step() {
    const uint64_t given = o.timed_ms * 1'000'000ull, guard = o.guard_ms * 1'000'000ull;
    const uint64_t start = now_ns();
    const Instants::Around instant = g_instants.around(start, given);
    sleep_until((instant.last + 1'000'000ull > start ? instant.last : instant.next) + 1'000'000ull);
    if (!launch(0)) return false;
    const uint64_t t = now_ns(), next_instant = g_instants.around(t, given).next;
    if (t + guard + 1'000'000ull < next_instant) {
      const uint64_t ms = (next_instant - guard - t) / 1'000'000ull;
      CHECK(launch_us(ms * 1000));
      ++launches;
    }
    CHECK(cuStreamSynchronize(stream));
    return true;
  }

  bool step() {
    if (o.timed_ms != 0) return timed_step();
    const bool flooding = flood_at_ns != 0 && now_ns() >= flood_at_ns;
    // The stand-in's control for the driver's own (an ioctl it does not model).
    if (flooding && o.flood_slice_us != 0 && !std::exchange(slice_set, true) &&
        driver_symbol<int (*)(uint64_t)>("simcuda_set_own_timeslice_us")(o.flood_slice_us) != 0) {
      fprintf(stderr, "gputime_load: flood_slice_us=%u: the stand-in refused it\n", o.flood_slice_us);
      return false;
    }
    if (flood_at_ns != 0) next = flooding ? functions.size() - 1 : 0;
    const unsigned host_us = flooding ? 0 : o.host_us, ahead_us = flooding ? o.flood_ahead_us : o.ahead_us;
    if (!dodge()) return false;
    if (!launch(next)) return false;
    if (host_us != 0) {
      // Host-side work between launches (busy, as a Python loop is).
      const uint64_t until = now_ns() + host_us * 1000ull;
      while (now_ns() < until) {
      }
    }
    batch_us += o.kernels_us[next];
    next = (next + 1) % functions.size();
    if (ahead_us == 0) {
      CHECK(cuStreamSynchronize(sync_stream()));
      return true;
    }
    if (batch_us < ahead_us) return true;
    // Double buffering: mark this batch, then wait for the one before it,
    // so about one batch stays queued and the GPU never runs dry.
    batch_us = 0;
    CHECK(cuEventRecord(newer, sync_stream()));
    if (have_older) CHECK(cuEventSynchronize(older));
    std::swap(older, newer);
    have_older = true;
    return true;
  }

  bool end() {
    CHECK(cuCtxSynchronize());
    cuEventDestroy(older);
    cuEventDestroy(newer);
    return true;
  }

  bool run_for(double seconds) {
    if (!begin()) return false;
    uint64_t until = now_ns() + static_cast<uint64_t>(seconds * 1e9);
    if (o.exit_at_ms != 0) {
      const uint64_t soonest = now_ns() + 1'000'000ull;
      until = g_instants.around(soonest, o.exit_at_ms * 1'000'000ull).next + o.exit_after_ms * 1'000'000ull;
    }
    for (uint64_t before = now_ns(); before < until;) {
      if (!step()) return false;
      const uint64_t after = now_ns();
      step_max_ns = std::max(step_max_ns, after - before);
      before = after;
    }
    return end();
  }
};

// Makes `ctx` current the way switch= asks; pop() undoes a push.
struct Switcher {
  bool push;
  bool enter(CUcontext ctx) const { return push ? check(cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent") : check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent"); }
  bool leave() const {
    CUcontext popped = nullptr;
    return !push || check(cuCtxPopCurrent_v2(&popped), "cuCtxPopCurrent");
  }
};

// switch=: one thread launches on every device in turn, changing the
// current context before each launch.
bool run_switching(std::vector<Launcher>& launchers, double seconds, const Switcher& sw) {
  for (Launcher& l : launchers) {
    if (!sw.enter(l.ctx) || !l.begin() || !sw.leave()) return false;
  }
  const uint64_t until = now_ns() + static_cast<uint64_t>(seconds * 1e9);
  while (now_ns() < until) {
    for (Launcher& l : launchers) {
      if (!sw.enter(l.ctx) || !l.step() || !sw.leave()) return false;
    }
  }
  for (Launcher& l : launchers) {
    if (!sw.enter(l.ctx) || !l.end() || !sw.leave()) return false;
  }
  return true;
}

// path=multi_pair: a kernel on the first device (the thread's current
// context, so its launch pass is for that GPU), then a multi-device
// cooperative launch on both, each followed by a wait for the second
// device's stream (which bounds the work queued there).
bool run_multi_pair(std::vector<Launcher>& launchers, const Options& o) {
  if (launchers.size() != 2) {
    fprintf(stderr, "gputime_load: path=multi_pair needs two devices\n");
    return false;
  }
  for (size_t i = 0; i < 2; ++i)
    if (!launchers[i].setup(o.devices[i])) return false;
  Launcher& a = launchers[0];
  Launcher& b = launchers[1];
  CHECK(cuCtxSetCurrent(a.ctx));
  CUDA_LAUNCH_PARAMS params[2] = {};
  for (int i = 0; i < 2; ++i) {
    params[i].function = launchers[i].functions[0];
    params[i].gridDimX = params[i].gridDimY = params[i].gridDimZ = 1;
    params[i].blockDimX = 32;
    params[i].blockDimY = params[i].blockDimZ = 1;
    params[i].hStream = launchers[i].stream;
  }
  const uint64_t until = now_ns() + static_cast<uint64_t>(o.seconds * 1e9);
  while (now_ns() < until) {
    CHECK(cuLaunchKernel(a.functions[0], 1, 1, 1, 32, 1, 1, 0, a.stream, nullptr, nullptr));
    CHECK(cuLaunchCooperativeKernelMultiDevice(params, 2, 0));
    ++a.launches;
    ++b.launches;
    CHECK(cuStreamSynchronize(b.stream));
  }
  CHECK(cuCtxSynchronize());
  return true;
}

// Runs the whole workload for `seconds` (then pause_ms and its resumption).
// burst=: the inference service. Latencies in ns, one per burst.
int run_bursts(const Options& o) {
  Launcher l(o);
  if (!l.setup(o.devices[0])) return 1;
  const unsigned n = o.burst[0];
  const uint64_t period = o.burst[1] * 1000ull, jitter = o.burst[2] * 1000ull;
  uint64_t rng = 1;  // xorshift64, a fixed seed: the same arrivals every run
  auto uniform = [&rng]() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return static_cast<double>(rng >> 11) / static_cast<double>(1ull << 53);
  };
  std::vector<uint64_t> latencies;
  const uint64_t start = now_ns() + period, until = start + static_cast<uint64_t>(o.seconds * 1e9);
  for (uint64_t k = 0;; ++k) {
    const double offset = (uniform() * 2 - 1) * static_cast<double>(jitter);
    const uint64_t arrival = start + k * period + static_cast<uint64_t>(std::max(0.0, static_cast<double>(period) + offset)) - period;
    if (arrival >= until) break;
    sleep_until(arrival);
    const uint64_t t0 = now_ns();
    for (unsigned i = 0; i < n; ++i)
      if (!l.launch(i % l.functions.size())) return 1;
    if (!check(cuStreamSynchronize(l.stream), "cuStreamSynchronize")) return 1;
    latencies.push_back(now_ns() - t0);
  }
  std::vector<uint64_t> sorted = latencies;
  std::sort(sorted.begin(), sorted.end());
  auto pct = [&](double p) -> unsigned long long {
    return sorted.empty() ? 0 : sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))] / 1000;
  };
  printf("bursts=%zu\np50_us=%llu\np99_us=%llu\np999_us=%llu\nmax_us=%llu\nlaunches_%d=%llu\n", sorted.size(),
         pct(0.5), pct(0.99), pct(0.999), sorted.empty() ? 0ull : static_cast<unsigned long long>(sorted.back() / 1000),
         o.devices[0], l.launches);
  fflush(stdout);
  return 0;
}

int run_all(const Options& o, double seconds) {
  std::vector<Launcher> launchers(o.devices.size(), Launcher(o));
  std::vector<int> ok(o.devices.size(), 0);
  auto wait_start = [&] {
    while (o.start_ns != 0 && now_ns() < o.start_ns) std::this_thread::sleep_for(std::chrono::microseconds(200));
  };
  if (o.path == "multi_pair") {
    ok.assign(ok.size(), run_multi_pair(launchers, o) ? 1 : 0);
  } else if (o.switch_mode == "create") {
    // Nothing but cuCtxCreate changes the thread's current context here.
    wait_start();
    bool good = true;
    for (size_t i = 0; good && i < o.devices.size(); ++i)
      good = launchers[i].setup(o.devices[i], true) && launchers[i].run_for(seconds);
    ok.assign(ok.size(), good ? 1 : 0);
  } else if (!o.switch_mode.empty()) {
    const Switcher sw{o.switch_mode == "push"};
    bool good = true;
    for (size_t i = 0; good && i < o.devices.size(); ++i) good = launchers[i].setup(o.devices[i]);
    wait_start();
    good = good && run_switching(launchers, seconds, sw);
    if (good && o.resume_seconds > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o.pause_ms));
      good = run_switching(launchers, o.resume_seconds, sw);
    }
    ok.assign(ok.size(), good ? 1 : 0);
  } else {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < o.devices.size(); ++i) {
      threads.emplace_back([&, i] {
        Launcher& l = launchers[i];
        if (!l.setup(o.devices[i])) return;
        wait_start();
        const bool leaves = o.leave_after_s > 0 && i + 1 == o.devices.size();
        if (!l.run_for(leaves ? o.leave_after_s : seconds)) return;
        if (leaves) {
          // Off this GPU, as a process that is done with one device: the last
          // release destroys the context (its stream, module and memory with
          // it), and with it NVML's listing there.
          CUdevice dev = 0;
          ok[i] = check(cuDeviceGet(&dev, o.devices[i]), "cuDeviceGet") &&
                  check(cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease");
          return;
        }
        if (o.resume_seconds > 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(o.pause_ms));
          if (!l.run_for(o.resume_seconds)) return;
        }
        ok[i] = 1;
      });
    }
    for (auto& t : threads) t.join();
  }
  int status = 0;
  for (size_t i = 0; i < o.devices.size(); ++i) {
    printf("launches_%d=%llu\n", o.devices[i], launchers[i].launches);
    if (!ok[i]) status = 1;
  }
  uint64_t capture_max = 0, step_max = 0;
  for (const Launcher& l : launchers) capture_max = std::max(capture_max, l.capture_launch_max_ns);
  for (const Launcher& l : launchers) step_max = std::max(step_max, l.step_max_ns);
  printf("step_max_us=%llu\n", static_cast<unsigned long long>(step_max / 1000));
  if (o.path == "capture") printf("capture_launch_max_us=%llu\n", static_cast<unsigned long long>(capture_max / 1000));
  if (status == 0 && o.last_us != 0) {
    // One more kernel, then exit at once: the exit hands the GPU on.
    Launcher& l = launchers[0];
    if (!check(cuCtxSetCurrent(l.ctx), "cuCtxSetCurrent") || !check(l.launch_us(o.last_us), "cuLaunchKernel"))
      status = 1;
  }
  fflush(stdout);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  // The helper of instants=nvml under the interposer: the ring's stamps, one a line.
  if (argc == 2 && strncmp(argv[1], "nvml_stamps=", 12) == 0) {
    NvmlRing ring;
    if (!ring.open(argv[1] + 12)) return 1;
    for (unsigned long long stamp : ring.stamps()) printf("%llu\n", stamp);
    return 0;
  }
  Options o;
  for (int i = 1; i < argc; ++i) {
    const char* eq = strchr(argv[i], '=');
    if (eq == nullptr) {
      fprintf(stderr, "gputime_load: expected key=value, got %s\n", argv[i]);
      return 64;
    }
    const std::string key(argv[i], static_cast<size_t>(eq - argv[i]));
    const char* value = eq + 1;
    if (key == "devices") {
      o.devices.clear();
      for (unsigned d : parse_list(value)) o.devices.push_back(static_cast<int>(d));
    } else if (key == "kernels_us") o.kernels_us = parse_list(value);
    else if (key == "seconds") o.seconds = atof(value);
    else if (key == "ahead_us") o.ahead_us = static_cast<unsigned>(atoi(value));
    else if (key == "host_us") o.host_us = static_cast<unsigned>(atoi(value));
    else if (key == "path") o.path = value;
    else if (key == "start_ns") o.start_ns = strtoull(value, nullptr, 10);
    else if (key == "pause_ms") {
      const std::vector<unsigned> v = parse_list(value);
      o.pause_ms = v.empty() ? 0 : v[0];
      o.resume_seconds = v.size() > 1 ? v[1] / 1000.0 : 0;
    } else if (key == "switch") o.switch_mode = value;
    else if (key == "fork_after") o.fork_after = atof(value);
    else if (key == "leave_after_s") o.leave_after_s = atof(value);
    else if (key == "last_us") o.last_us = static_cast<unsigned>(atoi(value));
    else if (key == "dodge_ms") o.dodge_ms = static_cast<unsigned>(atoi(value));
    else if (key == "timed_ms") o.timed_ms = static_cast<unsigned>(atoi(value));
    else if (key == "guard_ms") o.guard_ms = static_cast<unsigned>(atoi(value));
    else if (key == "exit_at_ms") o.exit_at_ms = static_cast<unsigned>(atoi(value));
    else if (key == "exit_after_ms") o.exit_after_ms = static_cast<unsigned>(atoi(value));
    else if (key == "burst") o.burst = parse_list(value);
    else if (key == "flood_after_ms") o.flood_after_ms = static_cast<unsigned>(atoi(value));
    else if (key == "flood_ahead_us") o.flood_ahead_us = static_cast<unsigned>(atoi(value));
    else if (key == "flood_slice_us") o.flood_slice_us = static_cast<unsigned>(atoi(value));
    else if (key == "kernels" && (strcmp(value, "sim") == 0 || strcmp(value, "ptx") == 0))
      o.ptx_kernels = strcmp(value, "ptx") == 0;
    else if (key == "spin_per_us") o.spin_per_us = atof(value);
    else if (key == "instants" && (strcmp(value, "clock") == 0 || strcmp(value, "nvml") == 0))
      o.nvml_instants = strcmp(value, "nvml") == 0;
    else if (key == "kernels" || key == "instants") {
      fprintf(stderr, "gputime_load: %s takes %s, not %s\n", key.c_str(), key == "kernels" ? "sim or ptx" : "clock or nvml",
              value);
      return 64;
    } else {
      fprintf(stderr, "gputime_load: unknown key %s\n", key.c_str());
      return 64;
    }
  }
  if (o.kernels_us.empty() || o.devices.empty()) return 64;
  if (!o.switch_mode.empty() && o.switch_mode != "set" && o.switch_mode != "push" && o.switch_mode != "create") {
    fprintf(stderr, "gputime_load: switch must be set, push or create\n");
    return 64;
  }
  if (o.ptx_kernels && (o.path != "kernel" || !o.switch_mode.empty() || o.fork_after > 0)) {
    fprintf(stderr, "gputime_load: kernels=ptx takes path=kernel, a thread per device, no fork_after\n");
    return 64;
  }
  if (!check(cuInit(0), "cuInit")) return 1;
  if (o.nvml_instants) g_instants.use_nvml(o.devices[0]);
  if (o.burst.size() == 3 && o.burst[0] > 0 && o.burst[1] > 0) return run_bursts(o);
  if (!o.burst.empty()) {
    fprintf(stderr, "gputime_load: burst=N,P,J needs N > 0 and P > 0\n");
    return 64;
  }
  if (o.fork_after <= 0) return run_all(o, o.seconds);
  if (run_all(o, o.fork_after) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) {
    perror("gputime_load: fork");
    return 1;
  }
  if (child == 0) {
    // A forked child starts the driver afresh (the parent's handles are not its own).
    if (!check(cuInit(0), "cuInit in the child")) _exit(1);
    const int status = run_all(o, o.seconds);
    fflush(stdout);
    exit(status);
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child) return 1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

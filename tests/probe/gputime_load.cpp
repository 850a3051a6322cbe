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
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

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
  unsigned last_us = 0;
  unsigned dodge_ms = 0;
  unsigned timed_ms = 0;
  unsigned guard_ms = 8;
  unsigned exit_at_ms = 0;
  unsigned exit_after_ms = 2;
  unsigned flood_after_ms = 0;
  unsigned flood_ahead_us = 100000;
  std::vector<unsigned> burst;  // N, P us, J us
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

// The deprecated launches, found at run time as an old application's loader
// would (through the interposer's dlsym when it is preloaded).
template <class Fn>
Fn legacy(const char* name) {
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
  CUfunction last = nullptr;  // last_us
  CUmodule module = nullptr;
  std::map<uint64_t, CUfunction> timed_functions;  // timed_ms: the long kernels, by length in ms
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
    if (o.last_us != 0) CHECK(cuModuleGetFunction(&last, module, ("sleep_" + std::to_string(o.last_us) + "us").c_str()));
    if (o.path == "getproc") {
      void* fn = nullptr;
      CUdriverProcAddressQueryResult found{};
      CHECK(cuGetProcAddress_v2("cuLaunchKernel", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found));
      launch_from_getproc = reinterpret_cast<PFN_cuLaunchKernel_v4000>(fn);
    }
    return true;
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
    if (p == "kernel") CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
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
    else if (p == "legacy") CHECK(legacy<decltype(&cuLaunch)>("cuLaunch")(f));
    else if (p == "legacy_grid") CHECK(legacy<decltype(&cuLaunchGrid)>("cuLaunchGrid")(f, 1, 1));
    else if (p == "legacy_async") CHECK(legacy<decltype(&cuLaunchGridAsync)>("cuLaunchGridAsync")(f, 1, 1, stream));
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
    const uint64_t period = o.dodge_ms * 1'000'000ull, guard = o.guard_ms * 1'000'000ull;
    const uint64_t now = now_ns(), next_instant = (now / period + 1) * period;
    const uint64_t kernel_ns = o.kernels_us[next] * 1000ull;
    if (now + kernel_ns + guard < next_instant && now % period >= 1'000'000ull) return true;
    CHECK(cuStreamSynchronize(sync_stream()));
    const uint64_t resume = (now % period < 1'000'000ull ? now / period * period : next_instant) + 1'000'000ull;
    sleep_until(resume);
    batch_us = 0;
    return true;
  }

  // timed_ms: one grant's tiny kernel, then one long kernel that runs on
  // past the grant and ends just before the next sampling instant.
  bool timed_step() {
    const uint64_t period = o.timed_ms * 1'000'000ull, guard = o.guard_ms * 1'000'000ull;
    const uint64_t resume = now_ns() / period * period + 1'000'000ull;
    sleep_until(resume > now_ns() ? resume : resume + period);
    if (!launch(0)) return false;
    const uint64_t t = now_ns(), next_instant = (t / period + 1) * period;
    if (t + guard + 1'000'000ull < next_instant) {
      const uint64_t ms = (next_instant - guard - t) / 1'000'000ull;
      CUfunction& f = timed_functions[ms];
      if (f == nullptr) CHECK(cuModuleGetFunction(&f, module, ("sleep_" + std::to_string(ms * 1000) + "us").c_str()));
      CHECK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
      ++launches;
    }
    CHECK(cuStreamSynchronize(stream));
    return true;
  }

  bool step() {
    if (o.timed_ms != 0) return timed_step();
    const bool flooding = flood_at_ns != 0 && now_ns() >= flood_at_ns;
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
      const uint64_t period = o.exit_at_ms * 1'000'000ull, soonest = now_ns() + 1'000'000ull;
      until = (soonest / period + 1) * period + o.exit_after_ms * 1'000'000ull;
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
        if (!l.run_for(seconds)) return;
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
    if (!check(cuCtxSetCurrent(l.ctx), "cuCtxSetCurrent") ||
        !check(cuLaunchKernel(l.last, 1, 1, 1, 32, 1, 1, 0, l.stream, nullptr, nullptr), "cuLaunchKernel"))
      status = 1;
  }
  fflush(stdout);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
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
    else if (key == "last_us") o.last_us = static_cast<unsigned>(atoi(value));
    else if (key == "dodge_ms") o.dodge_ms = static_cast<unsigned>(atoi(value));
    else if (key == "timed_ms") o.timed_ms = static_cast<unsigned>(atoi(value));
    else if (key == "guard_ms") o.guard_ms = static_cast<unsigned>(atoi(value));
    else if (key == "exit_at_ms") o.exit_at_ms = static_cast<unsigned>(atoi(value));
    else if (key == "exit_after_ms") o.exit_after_ms = static_cast<unsigned>(atoi(value));
    else if (key == "burst") o.burst = parse_list(value);
    else if (key == "flood_after_ms") o.flood_after_ms = static_cast<unsigned>(atoi(value));
    else if (key == "flood_ahead_us") o.flood_ahead_us = static_cast<unsigned>(atoi(value));
    else {
      fprintf(stderr, "gputime_load: unknown key %s\n", key.c_str());
      return 64;
    }
  }
  if (o.kernels_us.empty() || o.devices.empty()) return 64;
  if (!o.switch_mode.empty() && o.switch_mode != "set" && o.switch_mode != "push" && o.switch_mode != "create") {
    fprintf(stderr, "gputime_load: switch must be set, push or create\n");
    return 64;
  }
  if (!check(cuInit(0), "cuInit")) return 1;
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

// simnvml_sampling_test: the stand-in NVML's realistic sampling
// (SIMNVML_SAMPLE_MS, SIMNVML_ATTRIB; tests/simnvml/README.md, "Realistic
// sampling") checked directly against timelines built on the simulated driver.
//
// How the tests are arranged:
//   * main() gives this process a state file of its own ("<prefix>.<pid>",
//     removed at exit) and one simulated GPU before any sim call. CTest runs
//     each test in its own process, so each starts from an idle GPU whose bins
//     have never been written.
//   * This binary links the simulated driver (libcuda.so.1) and dlopens the
//     stand-in NVML, which maps the same state file. The sampling knobs are
//     read by the stand-in on every call, so a test sets them with setenv.
//   * Timelines are built ahead of time where exactness matters: on the
//     sim's queue model (SIMCUDA_SCHED=queue, set in main) a kernel starts at
//     max(now, the device's busy_until), so kernels queued
//     behind a pad kernel run back to back at known instants. align_to_grid()
//     makes the device busy exactly until a sampling instant.
//   * Other processes are fork() children driven through pipes; they end with
//     _exit(), never returning into GoogleTest.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fracgpu/nvml_abi.h"
#include "simcuda.h"

namespace {

constexpr uint64_t kMs = 1000000;  // ns
constexpr unsigned kRing = 72;     // the driver's ring depth (facts §2)

std::string g_state;

// ---- Clocks ----------------------------------------------------------------

uint64_t mono_ns() { return simcuda_now_ns(); }

void sleep_until(uint64_t t_ns) {
  timespec ts{static_cast<time_t>(t_ns / 1000000000ull), static_cast<long>(t_ns % 1000000000ull)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

void sleep_ms(unsigned ms) { sleep_until(mono_ns() + ms * kMs); }

// CLOCK_REALTIME - CLOCK_MONOTONIC in us, as measured here: within a few us
// of the offset the stand-in took when the state was created.
long long offset_estimate_us() {
  timespec real{}, mono{};
  clock_gettime(CLOCK_REALTIME, &real);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  return (static_cast<long long>(real.tv_sec) - mono.tv_sec) * 1000000LL + (real.tv_nsec - mono.tv_nsec) / 1000;
}

// A lastSeenTimeStamp that excludes the sample taken at monotonic instant
// t_ms and admits every later one (stamps are exact us; 0.5 ms of slack
// absorbs the estimate's error).
unsigned long long stamp_after(uint64_t t_ms) {
  return static_cast<unsigned long long>(static_cast<long long>(t_ms) * 1000 + offset_estimate_us() + 500);
}

// The monotonic instant (ms) a sample's time stamp stands for.
uint64_t instant_of(unsigned long long stamp_us) {
  return static_cast<uint64_t>(std::llround((static_cast<double>(stamp_us) - offset_estimate_us()) / 1000.0));
}

// ---- The stand-in NVML, dlopened ------------------------------------------

struct Nvml {
  void* lib = nullptr;
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlDeviceGetHandleByIndex_v2) handle_by_index = nullptr;
  decltype(&nvmlDeviceGetProcessUtilization) process_utilization = nullptr;
  decltype(&nvmlDeviceGetProcessesUtilizationInfo) processes_utilization_info = nullptr;
  decltype(&nvmlDeviceGetSamples) samples = nullptr;
  nvmlDevice_t dev = nullptr;
};

Nvml& nvml() {
  static Nvml n = [] {
    Nvml x;
    x.lib = dlopen(SIMNVML_DIR "/libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (x.lib == nullptr) return x;
    x.init = reinterpret_cast<decltype(x.init)>(dlsym(x.lib, "nvmlInit_v2"));
    x.handle_by_index = reinterpret_cast<decltype(x.handle_by_index)>(dlsym(x.lib, "nvmlDeviceGetHandleByIndex_v2"));
    x.process_utilization =
        reinterpret_cast<decltype(x.process_utilization)>(dlsym(x.lib, "nvmlDeviceGetProcessUtilization"));
    x.processes_utilization_info = reinterpret_cast<decltype(x.processes_utilization_info)>(
        dlsym(x.lib, "nvmlDeviceGetProcessesUtilizationInfo"));
    x.samples = reinterpret_cast<decltype(x.samples)>(dlsym(x.lib, "nvmlDeviceGetSamples"));
    if (x.init == nullptr || x.handle_by_index == nullptr || x.init() != NVML_SUCCESS ||
        x.handle_by_index(0, &x.dev) != NVML_SUCCESS)
      x.dev = nullptr;
    return x;
  }();
  return n;
}

// nvmlDeviceGetProcessUtilization with room for `capacity` records.
struct ProcResult {
  nvmlReturn_t rc;
  std::vector<nvmlProcessUtilizationSample_t> records;
};
ProcResult process_utilization(unsigned long long last_seen, unsigned capacity = 16) {
  std::vector<nvmlProcessUtilizationSample_t> buf(std::max(capacity, 1u));
  unsigned count = capacity;
  ProcResult r{nvml().process_utilization(nvml().dev, buf.data(), &count, last_seen), {}};
  if (r.rc == NVML_SUCCESS) r.records.assign(buf.begin(), buf.begin() + count);
  return r;
}

// nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) with room for `capacity`.
struct DevResult {
  nvmlReturn_t rc;
  unsigned count;
  std::vector<nvmlSample_t> samples;
};
DevResult device_samples(unsigned long long last_seen, unsigned capacity = 128) {
  std::vector<nvmlSample_t> buf(std::max(capacity, 1u));
  unsigned count = capacity;
  nvmlValueType_t type = NVML_VALUE_TYPE_DOUBLE;
  DevResult r{nvml().samples(nvml().dev, NVML_GPU_UTILIZATION_SAMPLES, last_seen, &type, &count, buf.data()), count,
              {}};
  if (r.rc == NVML_SUCCESS) {
    EXPECT_EQ(type, NVML_VALUE_TYPE_UNSIGNED_INT);
    r.samples.assign(buf.begin(), buf.begin() + count);
  }
  return r;
}

void set_sampling(unsigned period_ms, const char* attribution = nullptr) {
  if (period_ms == 0) unsetenv("SIMNVML_SAMPLE_MS");
  else setenv("SIMNVML_SAMPLE_MS", std::to_string(period_ms).c_str(), 1);
  if (attribution == nullptr) unsetenv("SIMNVML_ATTRIB");
  else setenv("SIMNVML_ATTRIB", attribution, 1);
}

// ---- The simulated driver --------------------------------------------------

// A context on device 0 and one kernel whose duration is set per launch.
struct Gpu {
  CUcontext ctx = nullptr;
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  bool ok = false;

  Gpu() {
    static const char image[] = "simulated";  // the sim accepts any image
    ok = cuInit(0) == CUDA_SUCCESS && cuCtxCreate_v2(&ctx, 0, 0) == CUDA_SUCCESS &&
         cuModuleLoadData(&module, image) == CUDA_SUCCESS &&
         cuModuleGetFunction(&fn, module, "sampled_kernel") == CUDA_SUCCESS;
  }
  // Queues a kernel of `ns` on the device's timeline; returns the instant the
  // device's queued work ends (the kernel's end, if nobody else queued).
  uint64_t launch(uint64_t ns) {
    simcuda_set_function_duration_ns(fn, ns);
    if (cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr) != CUDA_SUCCESS) return 0;
    return simcuda_device_busy_until_ns(0);
  }
};

// Makes the device busy (with this process's pad kernels) exactly until a
// sampling instant G = k * period, a little ahead; returns G (ns) or 0.
uint64_t align_to_grid(Gpu& gpu, uint64_t period_ms) {
  const uint64_t p = period_ms * kMs;
  for (int attempt = 0; attempt < 5; ++attempt) {
    const uint64_t e1 = gpu.launch(40 * kMs);
    const uint64_t g = ((e1 + 5 * kMs) / p + 1) * p;
    // Queued while the first pad still runs, the second starts at its end.
    if (gpu.launch(g - e1) == g) return g;
    sleep_until(simcuda_device_busy_until_ns(0));  // missed (a stalled runner): again
  }
  return 0;
}

// The kernel log records with index >= first.
std::vector<simcuda_kernel_record> kernel_log(uint64_t first) {
  std::vector<simcuda_kernel_record> out(16384);
  out.resize(simcuda_kernel_log(0, first, out.data(), out.size()));
  return out;
}

// ---- Child processes --------------------------------------------------------

// A process on the same GPU that launches one kernel of `ns` per 'l' it reads
// (answering 'k' once it is queued) and exits at 'q' or end of input.
struct Launcher {
  pid_t pid = -1;
  int cmd = -1, ack = -1;

  explicit Launcher(uint64_t ns) {
    int to[2], from[2];
    if (pipe(to) != 0 || pipe(from) != 0) return;
    pid = fork();
    if (pid == 0) {
      close(to[1]);
      close(from[0]);
      Gpu gpu;
      char c = gpu.ok ? 'r' : 'x';
      if (write(from[1], &c, 1) != 1 || !gpu.ok) _exit(1);
      while (read(to[0], &c, 1) == 1 && c == 'l') {
        c = gpu.launch(ns) != 0 ? 'k' : 'x';
        if (write(from[1], &c, 1) != 1) _exit(1);
      }
      _exit(0);
    }
    close(to[0]);
    close(from[1]);
    cmd = to[1];
    ack = from[0];
  }
  bool ready() {
    char c = 0;
    return pid > 0 && read(ack, &c, 1) == 1 && c == 'r';
  }
  bool launch() {
    char c = 'l';
    return write(cmd, &c, 1) == 1 && read(ack, &c, 1) == 1 && c == 'k';
  }
  ~Launcher() {
    if (pid <= 0) return;
    char c = 'q';
    if (write(cmd, &c, 1) != 1) kill(pid, SIGKILL);
    close(cmd);
    close(ack);
    int status = 0;
    waitpid(pid, &status, 0);
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;
};

class SamplingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_sampling(0);
    unsetenv("SIMNVML_FAULTS");
    ASSERT_NE(nvml().dev, nullptr) << "cannot load " SIMNVML_DIR "/libnvidia-ml.so.1: " << dlerror();
    ASSERT_NE(nvml().samples, nullptr) << "nvmlDeviceGetSamples is not exported";
    // CTest runs each test in a process of its own, on a fresh GPU. Run
    // together, a test waits until an earlier one's kernels have left both
    // the sample ring and the exact mode's one-second window.
    if (simcuda_kernel_log_next(0) > 0) sleep_until(std::max(mono_ns(), simcuda_device_busy_until_ns(0)) + 1100 * kMs);
  }
  void TearDown() override {
    set_sampling(0);
    unsetenv("SIMNVML_FAULTS");
  }
};

// facts §2, consequence 1: a new per-process figure exists once per sampling
// period; polled every 2 ms with the previous newest stamp as lastSeen, the
// call answers NOT_FOUND in between, and each new stamp is P ms after the last.
TEST_F(SamplingTest, BetweenSamplesThePerProcessCallAnswersNotFound) {
  constexpr uint64_t kP = 167;
  set_sampling(kP);
  Gpu gpu;
  ASSERT_TRUE(gpu.ok);
  const uint64_t end = gpu.launch(1500 * kMs);
  const uint64_t start = end - 1500 * kMs;
  // The first sample wholly inside the kernel is the one after `first`.
  const uint64_t first = (start + kP * kMs - 1) / (kP * kMs) * kP;
  unsigned long long last_seen = stamp_after(first);
  uint64_t previous_instant = first;
  int polls = 0, not_found = 0, found = 0, one_period = 0;
  const uint64_t stop = start + 1250 * kMs;
  while (mono_ns() < stop) {
    const ProcResult r = process_utilization(last_seen);
    ++polls;
    if (r.rc == NVML_ERROR_NOT_FOUND) {
      ++not_found;
    } else {
      ASSERT_EQ(r.rc, NVML_SUCCESS);
      ASSERT_EQ(r.records.size(), 1u);
      EXPECT_EQ(r.records[0].pid, static_cast<unsigned>(getpid()));
      EXPECT_EQ(r.records[0].smUtil, 100u) << "a sample wholly inside the kernel";
      EXPECT_EQ(r.records[0].memUtil, 0u);
      const uint64_t instant = instant_of(r.records[0].timeStamp);
      EXPECT_EQ(instant % kP, 0u) << "samples are taken at k * P ms";
      EXPECT_GT(instant, previous_instant);
      if (found > 0) {
        EXPECT_EQ((r.records[0].timeStamp - last_seen) % (kP * 1000), 0u) << "stamps are P ms apart";
        if (r.records[0].timeStamp - last_seen == kP * 1000) ++one_period;
      }
      ++found;
      last_seen = r.records[0].timeStamp;
      previous_instant = instant;
    }
    sleep_ms(2);
  }
  std::printf("%d polls: %d NOT_FOUND, %d new samples\n", polls, not_found, found);
  ASSERT_GE(polls, 100) << "the poll loop ran too rarely to judge";
  EXPECT_GE(found, 4) << polls << " polls";
  EXPECT_GE(one_period, found - 2) << "consecutive samples, P ms apart";
  EXPECT_GE(static_cast<double>(not_found) / polls, 0.95) << not_found << " of " << polls << " polls";
}

// facts §2, consequence 2: two processes time-slicing the GPU 50/50 do not
// each get 50 per sample; each sample names exactly one of them (the one
// resident at the sampling instant) with the whole busy share. Only over many
// samples does each get about half. Two readers in different processes see
// the very same samples.
TEST_F(SamplingTest, TwoProcessesHalfAndHalfGetWholeSamplesNotHalves) {
  constexpr uint64_t kP = 25;
  constexpr uint64_t kSlice = 7300 * 1000;  // ns: not a divisor of the period
  constexpr int kKernels = 140;             // ~1 s of alternating kernels
  set_sampling(kP);
  Gpu gpu;
  ASSERT_TRUE(gpu.ok);
  Launcher a(kSlice), b(kSlice);
  ASSERT_TRUE(a.ready());
  ASSERT_TRUE(b.ready());
  const uint64_t first_index = simcuda_kernel_log_next(0);
  gpu.launch(60 * kMs);  // a lead, so the alternating kernels queue back to back
  for (int i = 0; i < kKernels; ++i) ASSERT_TRUE((i % 2 == 0 ? a : b).launch());
  // The run as placed on the timeline: alternating, without a gap.
  std::vector<simcuda_kernel_record> run = kernel_log(first_index + 1);
  ASSERT_EQ(run.size(), static_cast<size_t>(kKernels));
  for (int i = 0; i < kKernels; ++i) {
    ASSERT_EQ(run[i].pid, i % 2 == 0 ? a.pid : b.pid);
    if (i > 0) {
      ASSERT_EQ(run[i].start_ns, run[i - 1].end_ns) << "the runner stalled: the run has a gap at " << i;
    }
  }
  const uint64_t run_start = run.front().start_ns, run_end = run.back().end_ns;
  // Samples (t0, t_last] lie wholly inside the run, their instants too.
  const uint64_t t0 = (run_start + kP * kMs - 1) / (kP * kMs) * kP;
  const uint64_t t_last = (run_end - 1) / kMs / kP * kP;
  ASSERT_GT(t_last, t0 + 20 * kP);

  // Poll through the run, one sample at a time.
  std::map<unsigned, int> named;
  int singles = 0;
  unsigned long long last_seen = stamp_after(t0);
  uint64_t previous_instant = t0;
  while (previous_instant < t_last && mono_ns() < run_end + 500 * kMs) {
    const ProcResult r = process_utilization(last_seen);
    if (r.rc == NVML_SUCCESS) {
      unsigned long long newest = 0;
      for (const auto& rec : r.records) newest = std::max(newest, rec.timeStamp);
      const uint64_t instant = instant_of(newest);
      if (instant - previous_instant == kP && instant <= t_last) {
        // Exactly one new sample: exactly one PID, with the whole share.
        ++singles;
        EXPECT_EQ(r.records.size(), 1u) << "a sample names one process";
        for (const auto& rec : r.records) {
          EXPECT_TRUE(rec.pid == static_cast<unsigned>(a.pid) || rec.pid == static_cast<unsigned>(b.pid)) << rec.pid;
          EXPECT_EQ(rec.smUtil, 100u) << "the whole busy share, not half of it";
          ++named[rec.pid];
        }
      }
      last_seen = newest;
      previous_instant = instant;
    } else {
      ASSERT_EQ(r.rc, NVML_ERROR_NOT_FOUND);
    }
    sleep_ms(2);
  }
  EXPECT_GE(singles, 15) << "too few samples seen one at a time";
  EXPECT_GE(named[a.pid], singles / 5) << "A named in " << named[a.pid] << " of " << singles << " samples";
  EXPECT_GE(named[b.pid], singles / 5) << "B named in " << named[b.pid] << " of " << singles << " samples";

  // Over the whole run: each about half (loose), together the busy share.
  sleep_until(run_end + 2 * kMs);
  const ProcResult all = process_utilization(stamp_after(t0));
  ASSERT_EQ(all.rc, NVML_SUCCESS);
  ASSERT_EQ(all.records.size(), 2u);
  unsigned total = 0;
  for (const auto& rec : all.records) {
    EXPECT_GE(rec.smUtil, 20u) << rec.pid;
    EXPECT_LE(rec.smUtil, 80u) << rec.pid;
    total += rec.smUtil;
  }
  std::printf("%d samples seen one at a time: A named in %d, B in %d; over the run A %u %%, B %u %%\n", singles,
              named[a.pid], named[b.pid],
              all.records[0].pid == static_cast<unsigned>(a.pid) ? all.records[0].smUtil : all.records[1].smUtil,
              all.records[0].pid == static_cast<unsigned>(a.pid) ? all.records[1].smUtil : all.records[0].smUtil);
  EXPECT_GE(total, 99u) << "each share truncated, together the whole run";
  EXPECT_LE(total, 100u);

  // A reader in another process, at the same moment, sees identical samples
  // (once the sample spanning the run's end has settled: every later one is
  // idle, so the two reads cannot straddle a new sample that counts).
  sleep_until((t_last + 2 * kP + 2) * kMs);
  const unsigned long long window = stamp_after(t0 + 5 * kP);
  int go[2], back[2];
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(back), 0);
  const pid_t reader = fork();
  ASSERT_GE(reader, 0);
  if (reader == 0) {
    char c;
    if (read(go[0], &c, 1) != 1) _exit(1);
    const DevResult d = device_samples(window);
    const ProcResult p = process_utilization(window);
    const unsigned sizes[4] = {static_cast<unsigned>(d.rc), static_cast<unsigned>(d.samples.size()),
                               static_cast<unsigned>(p.rc), static_cast<unsigned>(p.records.size())};
    bool ok = write(back[1], sizes, sizeof sizes) == sizeof sizes;
    ok = ok && write(back[1], d.samples.data(), d.samples.size() * sizeof(nvmlSample_t)) ==
                   static_cast<ssize_t>(d.samples.size() * sizeof(nvmlSample_t));
    ok = ok && write(back[1], p.records.data(), p.records.size() * sizeof(nvmlProcessUtilizationSample_t)) ==
                   static_cast<ssize_t>(p.records.size() * sizeof(nvmlProcessUtilizationSample_t));
    _exit(ok ? 0 : 1);
  }
  close(go[0]);
  close(back[1]);
  ASSERT_EQ(write(go[1], "g", 1), 1);
  const DevResult d = device_samples(window);
  const ProcResult p = process_utilization(window);
  unsigned sizes[4] = {};
  ASSERT_EQ(read(back[0], sizes, sizeof sizes), static_cast<ssize_t>(sizeof sizes));
  std::vector<nvmlSample_t> their_samples(sizes[1]);
  std::vector<nvmlProcessUtilizationSample_t> their_records(sizes[3]);
  const auto read_all = [&](void* buf, size_t n) {
    for (size_t got = 0; got < n;) {
      const ssize_t r = read(back[0], static_cast<char*>(buf) + got, n - got);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  };
  ASSERT_TRUE(read_all(their_samples.data(), their_samples.size() * sizeof(nvmlSample_t)));
  ASSERT_TRUE(read_all(their_records.data(), their_records.size() * sizeof(nvmlProcessUtilizationSample_t)));
  int status = 0;
  waitpid(reader, &status, 0);
  close(go[1]);
  close(back[0]);
  ASSERT_EQ(sizes[0], static_cast<unsigned>(NVML_SUCCESS));
  ASSERT_EQ(d.rc, NVML_SUCCESS);
  ASSERT_EQ(sizes[2], static_cast<unsigned>(NVML_SUCCESS));
  ASSERT_EQ(p.rc, NVML_SUCCESS);
  ASSERT_EQ(their_samples.size(), d.samples.size());
  ASSERT_GE(d.samples.size(), 20u);
  for (size_t i = 0; i < d.samples.size(); ++i) {
    EXPECT_EQ(their_samples[i].timeStamp, d.samples[i].timeStamp) << i;
    EXPECT_EQ(their_samples[i].sampleValue.uiVal, d.samples[i].sampleValue.uiVal) << i;
    if (instant_of(d.samples[i].timeStamp) <= t_last) {
      EXPECT_EQ(d.samples[i].sampleValue.uiVal, 100u) << i;
    }
  }
  ASSERT_EQ(their_records.size(), p.records.size());
  const auto by_pid = [](const auto& x, const auto& y) { return x.pid < y.pid; };
  std::sort(their_records.begin(), their_records.end(), by_pid);
  std::vector<nvmlProcessUtilizationSample_t> mine = p.records;
  std::sort(mine.begin(), mine.end(), by_pid);
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(their_records[i].pid, mine[i].pid);
    EXPECT_EQ(their_records[i].timeStamp, mine[i].timeStamp);
    EXPECT_EQ(their_records[i].smUtil, mine[i].smUtil);
  }
}

// facts §1 ("If no valid sample entries are found ... NVML_ERROR_NOT_FOUND";
// [user] the utilization ring "runs dry whenever the GPU sits idle") and §2
// consequence 4: an idle process holding memory is named by no sample.
TEST_F(SamplingTest, IdleGpuIsNotFoundForProcessesAndForTheDevice) {
  constexpr uint64_t kP = 5;
  Gpu gpu;  // holds memory (its context) but runs nothing yet
  ASSERT_TRUE(gpu.ok);
  set_sampling(kP);
  EXPECT_EQ(process_utilization(0).rc, NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(device_samples(0).rc, NVML_ERROR_NOT_FOUND);
  std::vector<nvmlProcessUtilizationInfo_v1_t> buf(kRing);
  nvmlProcessesUtilizationInfo_t info{};
  info.version = nvmlProcessesUtilizationInfo_v1;
  info.processSamplesCount = kRing;
  info.procUtilArray = buf.data();
  EXPECT_EQ(nvml().processes_utilization_info(nvml().dev, &info), NVML_ERROR_NOT_FOUND);

  // Busy for a while, then idle for longer than the ring: dry again.
  const uint64_t end = gpu.launch(20 * kMs);
  sleep_until(end + 2 * kP * kMs);
  const ProcResult busy = process_utilization(0);
  ASSERT_EQ(busy.rc, NVML_SUCCESS);
  ASSERT_EQ(busy.records.size(), 1u);
  EXPECT_EQ(busy.records[0].pid, static_cast<unsigned>(getpid()));
  EXPECT_EQ(device_samples(0).rc, NVML_SUCCESS);
  sleep_until(end + (kRing + 3) * kP * kMs);
  EXPECT_EQ(process_utilization(0).rc, NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(device_samples(0).rc, NVML_ERROR_NOT_FOUND);
  // The exact mode lists every process holding memory, named or not.
  set_sampling(0);
  const ProcResult exact = process_utilization(0);
  ASSERT_EQ(exact.rc, NVML_SUCCESS);
  ASSERT_EQ(exact.records.size(), 1u);
  EXPECT_EQ(exact.records[0].pid, static_cast<unsigned>(getpid()));
}

// facts §2 [bin]: a sample's util is converted to percent by an integer
// division (truncation); and the two attributions: `instant` names the process
// resident at the sampling instant (the driver's procId), `last` the one whose
// kernel ended last in the period.
TEST_F(SamplingTest, WholePercentTruncatedAndInstantVersusLastAttribution) {
  constexpr uint64_t kP = 100;
  set_sampling(kP);
  Gpu gpu;
  ASSERT_TRUE(gpu.ok);
  const unsigned me = static_cast<unsigned>(getpid());

  // Busy 50.9 % of the period [G, G+P): reads 50, not 51. The kernel ends
  // 49.1 ms before the instant G+P: `instant` names nobody, `last` names it.
  uint64_t g = align_to_grid(gpu, kP);
  ASSERT_NE(g, 0u) << "could not queue the pads in time";
  ASSERT_EQ(gpu.launch(50900 * 1000), g + 50900 * 1000);
  sleep_until(g + (kP + 3) * kMs);
  unsigned long long after_g = stamp_after(g / kMs);
  DevResult d = device_samples(after_g);
  ASSERT_EQ(d.rc, NVML_SUCCESS);
  ASSERT_EQ(d.samples.size(), 1u);
  EXPECT_EQ(d.samples[0].sampleValue.uiVal, 50u);
  EXPECT_EQ(instant_of(d.samples[0].timeStamp), g / kMs + kP);
  set_sampling(kP, "last");
  ProcResult r = process_utilization(after_g);
  ASSERT_EQ(r.rc, NVML_SUCCESS);
  ASSERT_EQ(r.records.size(), 1u);
  EXPECT_EQ(r.records[0].pid, me);
  EXPECT_EQ(r.records[0].smUtil, 50u) << "truncated, not rounded";
  EXPECT_EQ(r.records[0].timeStamp, d.samples[0].timeStamp);
  set_sampling(kP, "instant");
  EXPECT_EQ(process_utilization(after_g).rc, NVML_ERROR_NOT_FOUND) << "idle at the sampling instant";
  set_sampling(kP);  // instant is the default
  EXPECT_EQ(process_utilization(after_g).rc, NVML_ERROR_NOT_FOUND);

  // A kernel that ends 0.5 ms before the instant: 99 %, named only by `last`.
  g = align_to_grid(gpu, kP);
  ASSERT_NE(g, 0u);
  ASSERT_EQ(gpu.launch(99500 * 1000), g + 99500 * 1000);
  sleep_until(g + (kP + 3) * kMs);
  after_g = stamp_after(g / kMs);
  d = device_samples(after_g);
  ASSERT_EQ(d.rc, NVML_SUCCESS);
  ASSERT_EQ(d.samples.size(), 1u);
  EXPECT_EQ(d.samples[0].sampleValue.uiVal, 99u);
  EXPECT_EQ(process_utilization(after_g).rc, NVML_ERROR_NOT_FOUND);
  set_sampling(kP, "last");
  r = process_utilization(after_g);
  ASSERT_EQ(r.rc, NVML_SUCCESS);
  ASSERT_EQ(r.records.size(), 1u);
  EXPECT_EQ(r.records[0].pid, me);
  EXPECT_EQ(r.records[0].smUtil, 99u);

  // One that runs 0.5 ms past the instant: both name it, with 100 %.
  set_sampling(kP);
  g = align_to_grid(gpu, kP);
  ASSERT_NE(g, 0u);
  ASSERT_EQ(gpu.launch(100500 * 1000), g + 100500 * 1000);
  sleep_until(g + (kP + 3) * kMs);
  after_g = stamp_after(g / kMs);
  for (const char* attribution : {"instant", "last"}) {
    set_sampling(kP, attribution);
    r = process_utilization(after_g);
    ASSERT_EQ(r.rc, NVML_SUCCESS) << attribution;
    ASSERT_GE(r.records.size(), 1u) << attribution;
    EXPECT_EQ(r.records[0].pid, me) << attribution;
    EXPECT_EQ(r.records[0].smUtil, 100u) << attribution;
  }
}

// facts §2: the driver keeps 72 samples (NV2080_CTRL_PERF_GPUMON_SAMPLE_COUNT_
// PERFMON_UTIL); lastSeen 0 aggregates over those only, a later lastSeen over
// the newer ones; size queries answer 72 ([bin]).
TEST_F(SamplingTest, TheRingHoldsTheNewest72SamplesAndLastSeenFilters) {
  constexpr uint64_t kP = 5;
  set_sampling(kP);
  // Another process busy for 400 ms (80 samples), then this one for 2 s: a
  // read 500 ms into this one's kernel sees 72 samples, all this process's.
  uint64_t start = 0;
  Gpu gpu;
  ASSERT_TRUE(gpu.ok);
  {
    Launcher other(400 * kMs);
    ASSERT_TRUE(other.ready());
    ASSERT_TRUE(other.launch());
    const uint64_t end = gpu.launch(2000 * kMs);
    start = end - 2000 * kMs;
    const std::vector<simcuda_kernel_record> log = kernel_log(simcuda_kernel_log_next(0) - 2);
    ASSERT_EQ(log.size(), 2u);
    ASSERT_EQ(log[0].pid, other.pid);
    ASSERT_EQ(log[1].start_ns, log[0].end_ns) << "queued behind the other process's kernel";
  }
  sleep_until(start + 500 * kMs);

  DevResult d = device_samples(0);
  ASSERT_LT(mono_ns(), start + 1900 * kMs) << "the reader stalled past the kernel";
  ASSERT_EQ(d.rc, NVML_SUCCESS);
  ASSERT_EQ(d.samples.size(), kRing);
  for (size_t i = 0; i < d.samples.size(); ++i) {
    EXPECT_EQ(d.samples[i].sampleValue.uiVal, 100u) << i;
    if (i > 0) {
      EXPECT_EQ(d.samples[i].timeStamp - d.samples[i - 1].timeStamp, kP * 1000) << i;
    }
  }
  // Per process, lastSeen 0: this process alone (the other's samples are
  // older than the ring), stamped with the newest sample.
  ProcResult r = process_utilization(0);
  ASSERT_EQ(r.rc, NVML_SUCCESS);
  ASSERT_EQ(r.records.size(), 1u);
  EXPECT_EQ(r.records[0].pid, static_cast<unsigned>(getpid()));
  EXPECT_EQ(r.records[0].smUtil, 100u);
  EXPECT_GE(r.records[0].timeStamp, d.samples.back().timeStamp);
  // lastSeen = the 62nd sample's stamp: only the newer ones.
  const DevResult newer = device_samples(d.samples[61].timeStamp);
  ASSERT_EQ(newer.rc, NVML_SUCCESS);
  ASSERT_GE(newer.samples.size(), 10u);
  EXPECT_EQ(newer.samples[0].timeStamp, d.samples[62].timeStamp);
  // Nothing newer than a stamp ahead of every sample.
  EXPECT_EQ(device_samples(d.samples.back().timeStamp + 3600ull * 1000000).rc, NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(process_utilization(d.samples.back().timeStamp + 3600ull * 1000000).rc, NVML_ERROR_NOT_FOUND);

  // Sizes. nvmlDeviceGetSamples and nvmlDeviceGetProcessUtilization with a
  // NULL buffer: 72. A short buffer: INSUFFICIENT_SIZE with the count.
  unsigned count = 0;
  nvmlValueType_t type{};
  EXPECT_EQ(nvml().samples(nvml().dev, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &count, nullptr), NVML_SUCCESS);
  EXPECT_EQ(count, kRing);
  const DevResult short_buffer = device_samples(0, 10);
  EXPECT_EQ(short_buffer.rc, NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(short_buffer.count, kRing);
  std::vector<nvmlSample_t> one(1);
  count = 1;
  EXPECT_EQ(nvml().samples(nvml().dev, NVML_MEMORY_UTILIZATION_SAMPLES, 0, &type, &count, one.data()),
            NVML_ERROR_NOT_SUPPORTED);
  count = 0;
  EXPECT_EQ(nvml().process_utilization(nvml().dev, nullptr, &count, 0), NVML_SUCCESS);
  EXPECT_EQ(count, kRing);
  nvmlProcessUtilizationSample_t record{};
  count = 0;
  EXPECT_EQ(nvml().process_utilization(nvml().dev, &record, &count, 0), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(count, 1u);
  // nvmlDeviceGetProcessesUtilizationInfo demands room for the whole ring.
  std::vector<nvmlProcessUtilizationInfo_v1_t> buf(kRing);
  nvmlProcessesUtilizationInfo_t info{};
  info.version = nvmlProcessesUtilizationInfo_v1;
  info.processSamplesCount = 10;
  info.procUtilArray = buf.data();
  EXPECT_EQ(nvml().processes_utilization_info(nvml().dev, &info), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(info.processSamplesCount, kRing);
  info.processSamplesCount = 100;
  info.procUtilArray = nullptr;
  EXPECT_EQ(nvml().processes_utilization_info(nvml().dev, &info), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(info.processSamplesCount, kRing);
  info.processSamplesCount = kRing;
  info.procUtilArray = buf.data();
  ASSERT_EQ(nvml().processes_utilization_info(nvml().dev, &info), NVML_SUCCESS);
  ASSERT_EQ(info.processSamplesCount, 1u);
  EXPECT_EQ(buf[0].pid, static_cast<unsigned>(getpid()));
  EXPECT_EQ(buf[0].smUtil, 100u);
  info.processSamplesCount = kRing;
  info.lastSeenTimeStamp = buf[0].timeStamp + 3600ull * 1000000;
  EXPECT_EQ(nvml().processes_utilization_info(nvml().dev, &info), NVML_ERROR_NOT_FOUND);
}

// A lost GPU answers the new calls with NVML_ERROR_GPU_IS_LOST, as every query.
TEST_F(SamplingTest, LostGpuFaultAppliesToTheSampledCalls) {
  const std::string faults = g_state + ".faults";
  std::ofstream(faults) << "0 lost\n";
  setenv("SIMNVML_FAULTS", faults.c_str(), 1);
  for (unsigned period : {0u, 5u}) {
    set_sampling(period);
    unsigned count = 0;
    nvmlValueType_t type{};
    EXPECT_EQ(nvml().samples(nvml().dev, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &count, nullptr),
              NVML_ERROR_GPU_IS_LOST);
    EXPECT_EQ(process_utilization(0).rc, NVML_ERROR_GPU_IS_LOST);
    EXPECT_EQ(nvml().process_utilization(nvml().dev, nullptr, &count, 0), NVML_ERROR_GPU_IS_LOST);
    nvmlProcessesUtilizationInfo_t info{};
    info.version = nvmlProcessesUtilizationInfo_v1;
    EXPECT_EQ(nvml().processes_utilization_info(nvml().dev, &info), NVML_ERROR_GPU_IS_LOST);
  }
  unlink(faults.c_str());
}

// SIMNVML_SAMPLE_MS unset or 0: the exact mode, unchanged (one record per
// process holding memory, stamped now, measured from the kernel log, memUtil
// 10; a NULL buffer is INSUFFICIENT_SIZE). nvmlDeviceGetSamples samples
// every 2 ms there.
TEST_F(SamplingTest, ExactModeAnswersAsBefore) {
  Gpu gpu;
  ASSERT_TRUE(gpu.ok);
  const uint64_t end = gpu.launch(20 * kMs);
  sleep_until(end + 5 * kMs);
  const DevResult d = device_samples(0);
  ASSERT_EQ(d.rc, NVML_SUCCESS);
  ASSERT_GE(d.samples.size(), 5u);
  unsigned full = 0;
  for (size_t i = 0; i < d.samples.size(); ++i) {
    EXPECT_EQ(instant_of(d.samples[i].timeStamp) % 2, 0u);
    if (d.samples[i].sampleValue.uiVal == 100) ++full;
  }
  EXPECT_GE(full, 8u) << "20 ms of kernel: at least 8 whole 2 ms samples";
  for (const char* period : {static_cast<const char*>(nullptr), "0"}) {
    if (period == nullptr) unsetenv("SIMNVML_SAMPLE_MS");
    else setenv("SIMNVML_SAMPLE_MS", period, 1);
    const ProcResult r = process_utilization(0);
    ASSERT_EQ(r.rc, NVML_SUCCESS);
    ASSERT_EQ(r.records.size(), 1u);
    EXPECT_EQ(r.records[0].pid, static_cast<unsigned>(getpid()));
    EXPECT_EQ(r.records[0].smUtil, 2u) << "20 ms of the last second, rounded";
    EXPECT_EQ(r.records[0].memUtil, 10u);
    const long long now_us = static_cast<long long>(mono_ns() / 1000) + offset_estimate_us();
    EXPECT_LE(std::llabs(now_us - static_cast<long long>(r.records[0].timeStamp)), 1000000LL) << "stamped now";
    unsigned count = 0;
    EXPECT_EQ(nvml().process_utilization(nvml().dev, nullptr, &count, 0), NVML_ERROR_INSUFFICIENT_SIZE);
    EXPECT_EQ(count, 1u);
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Before any sim call: one GPU, and a state file of this run's own.
  setenv("SIMCUDA_DEVICES", "name=Sampled GPU,mem=8GiB,ctx=64MiB", 1);
  // The queue model: kernels are placed when launched, so a test builds its
  // timeline ahead of time at known instants (see the head). What is tested
  // is the sampling, which reads the same bins under either model.
  setenv("SIMCUDA_SCHED", "queue", 1);
  const char* prefix = std::getenv("SIMCUDA_STATE");
  const std::string base = prefix != nullptr && *prefix != 0 ? prefix : "/tmp/simnvml_sampling_test.state";
  g_state = base + "." + std::to_string(getpid());
  unlink(g_state.c_str());
  setenv("SIMCUDA_STATE", g_state.c_str(), 1);
  const int rc = RUN_ALL_TESTS();
  unlink(g_state.c_str());
  return rc;
}

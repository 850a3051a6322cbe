// simcuda_test: the simulated driver's own promises (see README.md here).
//
// How the tests are arranged:
//   * main() sets SIMCUDA_DEVICES to kSpec (three devices) and SIMCUDA_STATE
//     to a fresh file of its own before any sim call, so the process under
//     test starts from an empty simulated GPU. $SIMCUDA_STATE, if given (CTest
//     gives one), is used as a prefix: "<prefix>.<pid>", removed at exit, so
//     concurrent runs and stale files from earlier runs cannot interfere.
//   * The sim reads its environment once per process, so scenarios that need
//     another SIMCUDA_DEVICES / SIMCUDA_STATE (the default device, malformed
//     specs, cuInit-not-yet-called, ...) run in a re-executed copy of this
//     binary: run_self() forks, changes the environment and execs
//     /proc/self/exe with SIMCUDA_TEST_CHILD=<name>, which runs only the test
//     InChild.<name>. Those tests skip themselves in the main process.
//   * Multi-process scenarios on the shared state use plain fork() children
//     (class Child): they report failed checks and values through pipes and
//     end with _exit(), never returning into GoogleTest.
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "simcuda.h"

namespace {

constexpr uint64_t kKiB = 1ull << 10;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMs = 1000000;  // ns

// The main process's devices. Device 1 has no uuid (it gets the index-derived
// default) and spaces around its values; device 2 gives its size in bytes, a
// context footprint of 0 and a UUID without the "GPU-" prefix or dashes.
constexpr const char* kSpec =
    "uuid=GPU-5eed0001-0000-4000-8000-0000000000a0,name=SimGPU Alpha,mem=1GiB,ctx=64MiB,sms=108;"
    " name = SimGPU Beta , mem=512M , ctx=16MiB ;"
    "name=SimGPU Gamma,mem=268435456,ctx=0,uuid=0123456789abcdef0123456789ABCDEF";
constexpr int kDevices = 3;
constexpr uint64_t kCap[kDevices] = {1 * kGiB, 512 * kMiB, 256 * kMiB};
constexpr uint64_t kCtx[kDevices] = {64 * kMiB, 16 * kMiB, 0};

std::string g_state;  // the main process's SIMCUDA_STATE

#define ASSERT_CU(expr) ASSERT_EQ(CUDA_SUCCESS, (expr)) << #expr
#define EXPECT_CU(expr) EXPECT_EQ(CUDA_SUCCESS, (expr)) << #expr

bool in_child(const char* name) {
  const char* c = std::getenv("SIMCUDA_TEST_CHILD");
  return c != nullptr && std::strcmp(c, name) == 0;
}
#define CHILD_ONLY(name)                                                        \
  if (!in_child(name)) GTEST_SKIP() << "runs in a re-executed child (run_self)"

// ---------------------------------------------------------------------------
// Re-executed children (another environment)
// ---------------------------------------------------------------------------

struct SelfResult {
  int status = -1;  // raw waitpid status
  std::string output;
  bool passed() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

using EnvChange = std::pair<std::string, std::optional<std::string>>;  // nullopt: unset

// Runs InChild.<scenario> in a fresh copy of this binary with the main
// process's environment changed by `env`.
SelfResult run_self(const std::string& scenario, const std::vector<EnvChange>& env) {
  SelfResult r;
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return r;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    dup2(out[1], 2);
    for (const auto& [k, v] : env) {
      if (v) setenv(k.c_str(), v->c_str(), 1);
      else unsetenv(k.c_str());
    }
    setenv("SIMCUDA_TEST_CHILD", scenario.c_str(), 1);
    execl("/proc/self/exe", "simcuda_test", "--gtest_brief=1", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR))
    if (n > 0) r.output.append(buf, static_cast<size_t>(n));
  close(out[0]);
  while (waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
  }
  return r;
}

// ---------------------------------------------------------------------------
// Forked children (same environment, same shared state)
// ---------------------------------------------------------------------------

class Child;
thread_local Child* t_child = nullptr;  // set in the child: where CHECKs report

class Child {
 public:
  // Forks; the child runs body(*this) and _exits with 0, or 1 if a CHECK failed.
  explicit Child(const std::function<void(Child&)>& body) {
    int up[2], down[2], rep[2];
    if (pipe(up) != 0 || pipe(down) != 0 || pipe(rep) != 0) std::abort();
    pid_ = fork();
    if (pid_ < 0) std::abort();
    if (pid_ == 0) {
      close(up[0]);
      close(down[1]);
      close(rep[0]);
      up_ = up[1];
      down_ = down[0];
      rep_ = rep[1];
      t_child = this;
      body(*this);
      _exit(failed_ ? 1 : 0);
    }
    close(up[1]);
    close(down[0]);
    close(rep[1]);
    up_ = up[0];
    down_ = down[1];
    rep_ = rep[0];
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      finish();
    }
    for (int fd : {up_, down_, rep_})
      if (fd >= 0) close(fd);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }

  // ---- child side ----
  void send(uint64_t v) { (void)!write(up_, &v, sizeof v); }
  uint64_t wait_parent() { return read_u64(down_).value_or(0); }
  void fail(int line, const std::string& what) {
    failed_ = true;
    std::string msg = "child line " + std::to_string(line) + ": " + what + "\n";
    if (reported_ + msg.size() < 8192) {  // stays far below the pipe's capacity
      (void)!write(rep_, msg.data(), msg.size());
      reported_ += msg.size();
    }
  }

  // ---- parent side ----
  // The next value the child sent, nullopt if it died or 10 s passed.
  std::optional<uint64_t> recv() { return read_u64(up_); }
  void release(uint64_t v = 1) { (void)!write(down_, &v, sizeof v); }
  // Waits for the child; returns its waitpid status. report() has its failures.
  int finish() {
    if (!reaped_) {
      while (waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
      }
      reaped_ = true;
      char buf[1024];
      ssize_t n;
      while ((n = read(rep_, buf, sizeof buf)) > 0) report_.append(buf, static_cast<size_t>(n));
    }
    return status_;
  }
  bool passed() {
    int st = finish();
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  const std::string& report() {
    finish();
    return report_;
  }

 private:
  static std::optional<uint64_t> read_u64(int fd) {
    uint64_t v = 0;
    size_t got = 0;
    while (got < sizeof v) {
      pollfd p{fd, POLLIN, 0};
      int pr = poll(&p, 1, 10000);
      if (pr < 0 && errno == EINTR) continue;
      if (pr <= 0) return std::nullopt;
      ssize_t n = read(fd, reinterpret_cast<char*>(&v) + got, sizeof v - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      got += static_cast<size_t>(n);
    }
    return v;
  }

  pid_t pid_ = -1;
  int up_ = -1, down_ = -1, rep_ = -1;
  bool failed_ = false, reaped_ = false;
  size_t reported_ = 0;
  int status_ = 0;
  std::string report_;
};

template <class A, class B>
void child_check_eq(int line, const char* text, const A& a, const B& b) {
  if (!(a == b)) {
    std::ostringstream os;
    os << text << ": " << a << " vs " << b;
    t_child->fail(line, os.str());
  }
}
#define CHECK(cond) \
  do {              \
    if (!(cond)) t_child->fail(__LINE__, #cond); \
  } while (0)
#define CHECK_EQ(a, b) child_check_eq(__LINE__, #a " == " #b, (a), (b))
#define CHECK_CU(expr) child_check_eq(__LINE__, #expr, static_cast<int>(expr), 0)

#define EXPECT_CHILD_PASSED(c) EXPECT_TRUE((c).passed()) << "status " << (c).finish() << "\n" << (c).report()

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

uint64_t used(int dev) { return simcuda_device_used(dev); }

// A created context, current while it lives.
struct ScopedCtx {
  CUcontext ctx = nullptr;
  CUresult result;
  explicit ScopedCtx(int dev, unsigned flags = 0) { result = cuCtxCreate_v2(&ctx, flags, dev); }
  ~ScopedCtx() {
    if (ctx != nullptr) cuCtxDestroy_v2(ctx);
  }
  ScopedCtx(const ScopedCtx&) = delete;
  ScopedCtx& operator=(const ScopedCtx&) = delete;
};

void* libcuda() {
  static void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return h;
}

// A function from a new module of the current context (freed with it).
CUfunction get_function(const char* name) {
  static const char image[] = "simulated";  // the sim accepts any image
  CUmodule module = nullptr;
  if (cuModuleLoadData(&module, image) != CUDA_SUCCESS) return nullptr;
  CUfunction f = nullptr;
  if (cuModuleGetFunction(&f, module, name) != CUDA_SUCCESS) return nullptr;
  return f;
}

CUresult launch(CUfunction f, CUstream s = nullptr) {
  return cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, nullptr, nullptr);
}

uint64_t pool_attr(CUmemoryPool pool, CUmemPool_attribute attr) {
  cuuint64_t v = ~0ull;
  if (cuMemPoolGetAttribute(pool, attr, &v) != CUDA_SUCCESS) return ~0ull;
  return v;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every test starts and ends with the main process's simulated GPU as it
// found it: whatever a test allocates it frees, so accounting is exact.
class Sim : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ASSERT_CU(cuInit(0)); }
  void SetUp() override {
    ASSERT_EQ(simcuda_live_process_count(), 1) << "a child of an earlier test is still alive";
    for (int d = 0; d < kDevices; ++d) base_[d] = used(d);
  }
  void TearDown() override {
    for (int d = 0; d < kDevices; ++d) EXPECT_EQ(used(d), base_[d]) << "device " << d << " memory leaked by the test";
    CUcontext cur = nullptr;
    EXPECT_CU(cuCtxGetCurrent(&cur));
    EXPECT_EQ(cur, nullptr) << "the test left a context current";
  }
  uint64_t base_[kDevices] = {};
};

// ===========================================================================
// Devices and configuration
// ===========================================================================

using Devices = Sim;

TEST_F(Devices, EnumeratedFromSpec) {
  EXPECT_STREQ(simcuda_state_path(), g_state.c_str());
  ASSERT_EQ(simcuda_device_count(), kDevices);
  int n = 0;
  ASSERT_CU(cuDeviceGetCount(&n));
  EXPECT_EQ(n, kDevices);

  const char* names[kDevices] = {"SimGPU Alpha", "SimGPU Beta", "SimGPU Gamma"};
  const unsigned char uuids[kDevices][16] = {
      {0x5e, 0xed, 0x00, 0x01, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00, 0, 0, 0, 0, 0, 0xa0},
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2},  // default: from the index
      {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef}};
  const int sms[kDevices] = {108, 132, 132};
  for (int d = 0; d < kDevices; ++d) {
    SCOPED_TRACE("device " + std::to_string(d));
    CUdevice dev = -1;
    ASSERT_CU(cuDeviceGet(&dev, d));
    EXPECT_EQ(dev, d);
    char name[256] = {};
    ASSERT_CU(cuDeviceGetName(name, sizeof name, dev));
    EXPECT_STREQ(name, names[d]);
    CUuuid u{}, u2{};
    ASSERT_CU(cuDeviceGetUuid(&u, dev));
    ASSERT_CU(cuDeviceGetUuid_v2(&u2, dev));
    EXPECT_EQ(0, std::memcmp(u.bytes, uuids[d], 16));
    EXPECT_EQ(0, std::memcmp(u2.bytes, uuids[d], 16));
    size_t total = 0;
    ASSERT_CU(cuDeviceTotalMem_v2(&total, dev));
    EXPECT_EQ(total, kCap[d]);
    unsigned total32 = 0;
    ASSERT_CU(cuDeviceTotalMem(&total32, dev));
    EXPECT_EQ(total32, kCap[d]);  // all below 4 GiB
    EXPECT_EQ(simcuda_device_capacity(d), kCap[d]);
    EXPECT_EQ(simcuda_device_ctx_bytes(d), kCtx[d]);
    int v = 0;
    ASSERT_CU(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    EXPECT_EQ(v, sms[d]);
    char bus[32] = {};
    ASSERT_CU(cuDeviceGetPCIBusId(bus, sizeof bus, dev));
    char want[32];
    std::snprintf(want, sizeof want, "0000:%02x:00.0", 0x10 + d);
    EXPECT_STREQ(bus, want);
    EXPECT_EQ(used(d), 0u) << "fresh state, nothing allocated yet";
  }
  CUdevice dev = -1;
  EXPECT_EQ(cuDeviceGet(&dev, kDevices), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceGet(&dev, -1), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(simcuda_device_capacity(kDevices), 0u);
  EXPECT_EQ(simcuda_device_used(-1), 0u);
  int drv = 0;
  EXPECT_CU(cuDriverGetVersion(&drv));
  EXPECT_EQ(drv, 13000);
}

// SIMCUDA_DEVICES unset: one default device; SIMCUDA_STATE unset: private state.
TEST(Config, DefaultDeviceAndPrivateState) {
  SelfResult r = run_self("DefaultDevice", {{"SIMCUDA_DEVICES", std::nullopt}, {"SIMCUDA_STATE", std::nullopt}});
  EXPECT_TRUE(r.passed()) << r.output;
}

TEST(InChild, DefaultDevice) {
  CHILD_ONLY("DefaultDevice");
  EXPECT_STREQ(simcuda_state_path(), "");
  ASSERT_EQ(simcuda_device_count(), 1);
  EXPECT_EQ(simcuda_device_capacity(0), 16 * kGiB);
  EXPECT_EQ(simcuda_device_ctx_bytes(0), 64 * kMiB);
  ASSERT_CU(cuInit(0));
  char name[64] = {};
  ASSERT_CU(cuDeviceGetName(name, sizeof name, 0));
  EXPECT_STREQ(name, "Simulated GPU");
  CUuuid u{};
  ASSERT_CU(cuDeviceGetUuid_v2(&u, 0));
  const unsigned char want[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  EXPECT_EQ(0, std::memcmp(u.bytes, want, 16));
  int sms = 0;
  ASSERT_CU(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
  EXPECT_EQ(sms, 132);
  // The 32-bit entry points saturate at UINT_MAX for a 16 GiB device.
  unsigned total32 = 0;
  ASSERT_CU(cuDeviceTotalMem(&total32, 0));
  EXPECT_EQ(total32, UINT_MAX);
  EXPECT_EQ(simcuda_live_process_count(), 1);

  ScopedCtx c(0);
  ASSERT_CU(c.result);
  unsigned free32 = 0;
  ASSERT_CU(cuMemGetInfo(&free32, &total32));
  EXPECT_EQ(free32, UINT_MAX);
  EXPECT_EQ(total32, UINT_MAX);
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc_v2(&p, kGiB));
  EXPECT_EQ(used(0), kGiB + 64 * kMiB);

  // Private state: a forked child gets a fresh simulated GPU of its own.
  Child child([](Child&) {
    CHECK_EQ(simcuda_device_used(0), 0u);
    CHECK_EQ(simcuda_live_process_count(), 1);
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUdeviceptr q = 0;
    CHECK_CU(cuMemAlloc_v2(&q, 16 * kGiB - 64 * kMiB));  // the whole device: nothing of the parent's
    CHECK_EQ(simcuda_device_used(0), 16 * kGiB);
  });
  EXPECT_CHILD_PASSED(child);
  EXPECT_EQ(used(0), kGiB + 64 * kMiB);
  EXPECT_CU(cuMemFree_v2(p));
}

TEST(Config, MalformedSpecRefusesToStart) {
  std::string many;
  for (int i = 0; i < 17; ++i) many += "name=d" + std::to_string(i) + ";";
  const std::pair<std::string, std::string> cases[] = {
      {"name=A,bogus=1", "unknown field 'bogus'"},
      {"name=A,mem=12XB", "bad value for 'mem'"},
      {"name=A,mem=0", "bad value for 'mem'"},
      {"uuid=GPU-1234", "bad value for 'uuid'"},
      {"name=A,sms=1.5", "bad value for 'sms'"},
      {"name", "field without '='"},
      {many, "at most 16 devices"},
  };
  for (const auto& [spec, why] : cases) {
    SelfResult r = run_self("MalformedSpec", {{"SIMCUDA_DEVICES", spec}, {"SIMCUDA_STATE", std::nullopt}});
    EXPECT_TRUE(r.passed()) << spec << "\n" << r.output;
    EXPECT_NE(r.output.find("simcuda: SIMCUDA_DEVICES"), std::string::npos) << spec << "\n" << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << spec << "\n" << r.output;
  }
}

TEST(InChild, MalformedSpec) {
  CHILD_ONLY("MalformedSpec");
  EXPECT_EQ(simcuda_device_count(), -1);
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
  int n = 0;
  EXPECT_EQ(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
}

TEST(Config, EmptySpecHasNoDevice) {
  SelfResult r = run_self("EmptySpec", {{"SIMCUDA_DEVICES", " ; "}, {"SIMCUDA_STATE", std::nullopt}});
  EXPECT_TRUE(r.passed()) << r.output;
}

TEST(InChild, EmptySpec) {
  CHILD_ONLY("EmptySpec");
  EXPECT_EQ(simcuda_device_count(), 0);
  EXPECT_EQ(cuInit(0), CUDA_ERROR_NO_DEVICE);
}

// A second process with another SIMCUDA_DEVICES joins the live state as it is.
// What a test that SIGSTOPs a process asks first: whether it holds one of
// the state's critical sections (byte 0, the global one; a device's
// scheduler byte, 1024 on) rather than only lock bytes it keeps for life
// (its slot's, 1 + slot).
TEST_F(Devices, ACriticalSectionIsToldFromALockHeldForLife) {
  const std::string state = simcuda_state_path();
  ASSERT_FALSE(state.empty());
  for (const off_t byte : {off_t{0}, off_t{1024}, off_t{1000}}) {
    Child child([&](Child& self) {
      const int fd = open(state.c_str(), O_RDWR | O_CLOEXEC);
      struct flock fl {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      fl.l_start = byte;
      fl.l_len = 1;
      self.send(fd >= 0 && fcntl(fd, F_OFD_SETLKW, &fl) == 0 ? 1 : 0);
      self.wait_parent();
    });
    ASSERT_EQ(child.recv().value_or(0), 1u) << "byte " << byte;
    EXPECT_EQ(simcuda_process_in_critical_section(child.pid()), byte == 1000 ? 0 : 1) << "byte " << byte;
    child.release();
    EXPECT_TRUE(child.passed()) << child.report();
    EXPECT_EQ(simcuda_process_in_critical_section(child.pid()), -1) << "a process that is gone";
  }
  EXPECT_EQ(simcuda_process_in_critical_section(getpid()), 0) << "this process, outside the driver";
}

TEST_F(Devices, SpecMismatchUsesTheLiveState) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc_v2(&p, 7 * kMiB));
  SelfResult r = run_self("SpecMismatch", {{"SIMCUDA_DEVICES", "name=Other,mem=2GiB"},
                                           {"SIMCUDA_TEST_ARG", std::to_string(used(0))}});
  EXPECT_TRUE(r.passed()) << r.output;
  EXPECT_NE(r.output.find("SIMCUDA_DEVICES differs from the live state"), std::string::npos) << r.output;
  EXPECT_CU(cuMemFree_v2(p));
}

TEST(InChild, SpecMismatch) {
  CHILD_ONLY("SpecMismatch");
  ASSERT_EQ(simcuda_device_count(), kDevices);
  ASSERT_CU(cuInit(0));
  char name[64] = {};
  ASSERT_CU(cuDeviceGetName(name, sizeof name, 0));
  EXPECT_STREQ(name, "SimGPU Alpha");
  EXPECT_EQ(simcuda_device_capacity(0), kGiB);
  EXPECT_EQ(simcuda_device_used(0), std::stoull(std::getenv("SIMCUDA_TEST_ARG")));
  EXPECT_EQ(simcuda_live_process_count(), 2);
}

TEST(Config, ForeignStateFileIsNotOverwritten) {
  std::string path = g_state + ".foreign";
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << "not a simcuda state file\n";
  }
  SelfResult r = run_self("ForeignFile", {{"SIMCUDA_STATE", path}});
  EXPECT_TRUE(r.passed()) << r.output;
  EXPECT_NE(r.output.find("refusing to overwrite"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(path), "not a simcuda state file\n");
  unlink(path.c_str());
}

TEST(InChild, ForeignFile) {
  CHILD_ONLY("ForeignFile");
  EXPECT_EQ(simcuda_device_count(), -1);
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
}

// ===========================================================================
// cuInit
// ===========================================================================

TEST(Config, FailingEntryPointsAnswerNotSupported) {
  std::string path = g_state + ".fail";
  unlink(path.c_str());
  SelfResult r = run_self("Failing", {{"SIMCUDA_STATE", path}, {"SIMCUDA_FAIL", "cuDeviceGetMemPool,cuMemAlloc_v2"}});
  EXPECT_TRUE(r.passed()) << r.output;
  unlink(path.c_str());
}

TEST(InChild, Failing) {
  CHILD_ONLY("Failing");
  ASSERT_CU(cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxRetain(&ctx, 0));
  ASSERT_CU(cuCtxSetCurrent(ctx));
  CUmemoryPool pool = nullptr;
  CUdeviceptr p = 0;
  EXPECT_EQ(cuDeviceGetMemPool(&pool, 0), CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(pool, nullptr) << "did nothing";
  EXPECT_EQ(cuMemAlloc_v2(&p, kMiB), CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(simcuda_call_count("cuMemAlloc_v2"), 1u) << "still counted";
  EXPECT_CU(cuDeviceGetDefaultMemPool(&pool, 0)) << "only the names given fail";
  EXPECT_CU(cuMemAllocAsync(&p, kMiB, nullptr));
  EXPECT_CU(cuDevicePrimaryCtxRelease_v2(0));
}

TEST(Init, RequiredBeforeDriverCalls) {
  std::string path = g_state + ".init";
  unlink(path.c_str());
  SelfResult r = run_self("InitRequired", {{"SIMCUDA_STATE", path}});
  EXPECT_TRUE(r.passed()) << r.output;
  unlink(path.c_str());
}

TEST(InChild, InitRequired) {
  CHILD_ONLY("InitRequired");
  int n = -1;
  CUdevice dev = -1;
  CUcontext ctx = nullptr;
  CUdeviceptr p = 0;
  EXPECT_EQ(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuDeviceGet(&dev, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuCtxCreate_v2(&ctx, 0, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemAlloc_v2(&p, 1), CUDA_ERROR_NOT_INITIALIZED);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h = 0;
  EXPECT_EQ(cuMemCreate(&h, 2 * kMiB, &prop, 0), CUDA_ERROR_NOT_INITIALIZED);
  // Stateless entry points and the control API work before cuInit.
  int drv = 0;
  EXPECT_CU(cuDriverGetVersion(&drv));
  void* fn = nullptr;
  EXPECT_CU(cuGetProcAddress_v2("cuInit", &fn, 13000, 0, nullptr));
  EXPECT_NE(fn, nullptr);
  EXPECT_EQ(simcuda_device_count(), kDevices);
  EXPECT_EQ(simcuda_live_process_count(), 0);  // attached, but no cuInit yet
  // A bad flag is refused and leaves the process uninitialized.
  EXPECT_EQ(cuInit(1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(simcuda_live_process_count(), 0);
  ASSERT_CU(cuInit(0));
  EXPECT_CU(cuDeviceGetCount(&n));
  EXPECT_EQ(n, kDevices);
  EXPECT_EQ(simcuda_live_process_count(), 1);
  ASSERT_CU(cuInit(0));  // idempotent: still one process
  EXPECT_EQ(simcuda_live_process_count(), 1);
  for (int d = 0; d < kDevices; ++d) EXPECT_EQ(simcuda_device_used(d), 0u) << "cuInit charges nothing";
}

// ===========================================================================
// Memory accounting
// ===========================================================================

using Memory = Sim;

TEST_F(Memory, LinearAllocationsAreChargedExactly) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB);
  EXPECT_EQ(simcuda_process_used(0, 0), used(0));  // the only live process
  EXPECT_EQ(simcuda_process_used(0, getpid()), used(0));

  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(cuMemAlloc_v2(&a, 1000));
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB + 1000) << "linear memory is charged its exact size";
  ASSERT_CU(cuMemAlloc_v2(&b, 3 * kMiB + 1));
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB + 1000 + 3 * kMiB + 1);
  EXPECT_NE(a, 0u);
  EXPECT_EQ(a % 512, 0u);
  EXPECT_EQ(b % 512, 0u);
  EXPECT_GE(a, 1ull << 32) << "v2 pointers are 64-bit";
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_CU(cuMemGetAddressRange_v2(&base, &size, a + 999));
  EXPECT_EQ(base, a);
  EXPECT_EQ(size, 1000u);
  // Past its size (inside the 512-byte alignment gap before b) is no allocation.
  ASSERT_EQ(b, a + 1024);
  EXPECT_EQ(cuMemGetAddressRange_v2(&base, &size, a + 1000), CUDA_ERROR_NOT_FOUND);
  size_t free_b = 0, total = 0;
  ASSERT_CU(cuMemGetInfo_v2(&free_b, &total));
  EXPECT_EQ(total, kGiB);
  EXPECT_EQ(free_b, kGiB - used(0));

  // The 32-bit entry point: same charge rule, an address below 4 GiB.
  CUdeviceptr_v1 small = 0;
  ASSERT_CU(cuMemAlloc(&small, 4096));
  EXPECT_NE(small, 0u);
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB + 1000 + 3 * kMiB + 1 + 4096);
  EXPECT_CU(cuMemFree(small));

  EXPECT_EQ(cuMemAlloc_v2(&a, 0), CUDA_ERROR_INVALID_VALUE) << "size 0";
  EXPECT_CU(cuMemFree_v2(a));
  EXPECT_EQ(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE) << "double free";
  EXPECT_EQ(cuMemFree_v2(b + 512), CUDA_ERROR_INVALID_VALUE) << "not the start of an allocation";
  EXPECT_CU(cuMemFree_v2(b));
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB);

  // Another device's memory is its own.
  {
    ScopedCtx c1(1);
    ASSERT_CU(c1.result);
    CUdeviceptr d1 = 0;
    ASSERT_CU(cuMemAlloc_v2(&d1, 5 * kMiB));
    EXPECT_EQ(used(1), base_[1] + 16 * kMiB + 5 * kMiB);
    EXPECT_EQ(used(0), base_[0] + 64 * kMiB);
    ASSERT_CU(cuMemGetInfo_v2(&free_b, &total));
    EXPECT_EQ(total, 512 * kMiB);
    EXPECT_EQ(free_b, 512 * kMiB - used(1));
    EXPECT_CU(cuMemFree_v2(d1));
  }
  EXPECT_EQ(used(1), base_[1]);

  EXPECT_EQ(cuCtxDestroy_v2(c.ctx), CUDA_SUCCESS);
  c.ctx = nullptr;
  CUdeviceptr x = 0;
  EXPECT_EQ(cuMemAlloc_v2(&x, 1), CUDA_ERROR_INVALID_CONTEXT) << "no current context";
}

TEST_F(Memory, CapacityIsEnforcedExactly) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  const uint64_t u = used(0);
  const uint64_t avail = kGiB - u;
  CUdeviceptr p = 0;
  EXPECT_EQ(cuMemAlloc_v2(&p, avail + 1), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(used(0), u) << "a failed allocation charges nothing";
  CUdeviceptr big = 0;
  ASSERT_CU(cuMemAlloc_v2(&big, avail - kMiB));  // leaves exactly 1 MiB
  size_t free_b = 0, total = 0;
  ASSERT_CU(cuMemGetInfo_v2(&free_b, &total));
  EXPECT_EQ(free_b, kMiB);

  // Everything that needs more than what is left fails with OUT_OF_MEMORY.
  EXPECT_EQ(cuMemAllocAsync(&p, 1, nullptr), CUDA_ERROR_OUT_OF_MEMORY) << "a pool grows by whole 2 MiB chunks";
  EXPECT_EQ(cuMemAllocManaged(&p, kMiB + 1, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_OUT_OF_MEMORY);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemGenericAllocationHandle h = 0;
  EXPECT_EQ(cuMemCreate(&h, 2 * kMiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CUarray arr = nullptr;
  CUDA_ARRAY_DESCRIPTOR ad{};
  ad.Width = 16;
  ad.Height = 16;
  ad.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  ad.NumChannels = 1;
  EXPECT_EQ(cuArrayCreate_v2(&arr, &ad), CUDA_ERROR_OUT_OF_MEMORY) << "an array is charged 2 MiB";
  CUcontext ctx2 = nullptr;
  EXPECT_EQ(cuCtxCreate_v2(&ctx2, 0, 0), CUDA_ERROR_OUT_OF_MEMORY) << "a context's footprint is charged";
  CUcontext prim = nullptr;
  EXPECT_EQ(cuDevicePrimaryCtxRetain(&prim, 0), CUDA_ERROR_OUT_OF_MEMORY);
  unsigned flags = 0;
  int active = 1;
  EXPECT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 0);
  EXPECT_EQ(used(0), kGiB - kMiB);
  CUcontext cur = nullptr;
  EXPECT_CU(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, c.ctx) << "a failed cuCtxCreate pushes nothing";

  // Up to the last byte still fits; then nothing does.
  ASSERT_CU(cuMemAlloc_v2(&p, kMiB));
  EXPECT_EQ(used(0), kGiB);
  ASSERT_CU(cuMemGetInfo_v2(&free_b, &total));
  EXPECT_EQ(free_b, 0u);
  CUdeviceptr q = 0;
  EXPECT_EQ(cuMemAlloc_v2(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(simcuda_device_peak(0), kGiB);
  EXPECT_CU(cuMemFree_v2(p));
  EXPECT_CU(cuMemFree_v2(big));
  EXPECT_EQ(used(0), u);
  EXPECT_EQ(used(1), base_[1]) << "other devices untouched";
}

TEST_F(Memory, PeakTracksTheHighWaterMark) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  const uint64_t u = used(0);
  simcuda_reset_peak(0);
  EXPECT_EQ(simcuda_device_peak(0), u);
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(cuMemAlloc_v2(&a, 100 * kMiB));
  ASSERT_CU(cuMemAlloc_v2(&b, 50 * kMiB));
  EXPECT_CU(cuMemFree_v2(a));
  ASSERT_CU(cuMemAlloc_v2(&a, 20 * kMiB));
  EXPECT_CU(cuMemFree_v2(a));
  EXPECT_CU(cuMemFree_v2(b));
  EXPECT_EQ(used(0), u);
  EXPECT_EQ(simcuda_device_peak(0), u + 150 * kMiB);
  simcuda_reset_peak(0);
  EXPECT_EQ(simcuda_device_peak(0), u);
}

TEST_F(Memory, PitchRowsRoundUpTo512Bytes) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  struct Case {
    size_t width, height, pitch;
  } cases[] = {{1000, 10, 1024}, {512, 3, 512}, {513, 7, 1024}, {1, 1, 512}, {4096, 100, 4096}};
  for (const auto& k : cases) {
    SCOPED_TRACE(std::to_string(k.width) + "x" + std::to_string(k.height));
    const uint64_t before = used(0);
    CUdeviceptr p = 0;
    size_t pitch = 0;
    ASSERT_CU(cuMemAllocPitch_v2(&p, &pitch, k.width, k.height, 4));
    EXPECT_EQ(pitch, k.pitch);
    EXPECT_EQ(used(0), before + k.pitch * k.height) << "charged pitch * height";
    CUdeviceptr base = 0;
    size_t size = 0;
    ASSERT_CU(cuMemGetAddressRange_v2(&base, &size, p));
    EXPECT_EQ(size, k.pitch * k.height);
    EXPECT_CU(cuMemFree_v2(p));
    EXPECT_EQ(used(0), before);
  }
  // The 32-bit entry point follows the same rule.
  const uint64_t before = used(0);
  CUdeviceptr_v1 p32 = 0;
  unsigned pitch32 = 0;
  ASSERT_CU(cuMemAllocPitch(&p32, &pitch32, 600, 4, 8));
  EXPECT_EQ(pitch32, 1024u);
  EXPECT_EQ(used(0), before + 4096);
  EXPECT_CU(cuMemFree(p32));
  CUdeviceptr p = 0;
  size_t pitch = 0;
  EXPECT_EQ(cuMemAllocPitch_v2(&p, &pitch, 100, 1, 3), CUDA_ERROR_INVALID_VALUE) << "element size 4, 8 or 16";
  EXPECT_EQ(cuMemAllocPitch_v2(&p, &pitch, 0, 1, 4), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(used(0), before);
}

TEST_F(Memory, ManagedMemoryIsChargedToTheCurrentDevice) {
  ScopedCtx c(1);
  ASSERT_CU(c.result);
  const uint64_t u = used(1);
  CUdeviceptr m = 0, g = 0, lin = 0;
  ASSERT_CU(cuMemAllocManaged(&m, 3000, CU_MEM_ATTACH_GLOBAL));
  ASSERT_CU(cuMemAllocManaged(&g, kMiB, CU_MEM_ATTACH_HOST));
  EXPECT_EQ(used(1), u + 3000 + kMiB);
  EXPECT_EQ(used(0), base_[0]);
  EXPECT_EQ(cuMemAllocManaged(&m, 1, 0x7), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemAlloc_v2(&lin, 4096));
  CUmemLocation loc{};
  loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
  loc.id = 1;
  EXPECT_CU(cuMemAdvise_v2(m, 3000, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, loc));
  EXPECT_CU(cuMemAdvise(m, 1000, CU_MEM_ADVISE_SET_READ_MOSTLY, 1));
  EXPECT_EQ(cuMemAdvise_v2(lin, 4096, CU_MEM_ADVISE_SET_READ_MOSTLY, loc), CUDA_ERROR_INVALID_VALUE)
      << "advice is for managed memory only";
  EXPECT_EQ(cuMemAdvise_v2(m, 3001, CU_MEM_ADVISE_SET_READ_MOSTLY, loc), CUDA_ERROR_INVALID_VALUE);
  EXPECT_CU(cuMemFree_v2(m));
  EXPECT_CU(cuMemFree_v2(g));
  EXPECT_CU(cuMemFree_v2(lin));
  EXPECT_EQ(used(1), u);
}

// ===========================================================================
// Contexts
// ===========================================================================

using Contexts = Sim;

TEST_F(Contexts, CreatedContextsChargeTheirFootprint) {
  CUcontext a = nullptr, b = nullptr, c3 = nullptr, c4 = nullptr, d1 = nullptr, d2 = nullptr;
  ASSERT_CU(cuCtxCreate_v2(&a, 0, 0));
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB);
  ASSERT_CU(cuCtxCreate(&b, CU_CTX_SCHED_YIELD, 0));
  EXPECT_EQ(used(0), base_[0] + 128 * kMiB);
  ASSERT_CU(cuCtxCreate_v3(&c3, nullptr, 0, 0, 0));
  ASSERT_CU(cuCtxCreate_v4(&c4, nullptr, 0, 0));
  EXPECT_EQ(used(0), base_[0] + 256 * kMiB);
  EXPECT_EQ(simcuda_process_used(0, 0), used(0));
  ASSERT_CU(cuCtxCreate_v2(&d1, 0, 1));
  EXPECT_EQ(used(1), base_[1] + 16 * kMiB);
  ASSERT_CU(cuCtxCreate_v2(&d2, 0, 2));
  EXPECT_EQ(used(2), base_[2]) << "ctx=0: a context costs nothing";

  CUcontext bad = nullptr;
  EXPECT_EQ(cuCtxCreate_v2(&bad, CU_CTX_SCHED_SPIN | CU_CTX_SCHED_YIELD, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuCtxCreate_v2(&bad, 0, kDevices), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(used(0), base_[0] + 256 * kMiB);

  // The last created is current; destroying the top pops it.
  CUcontext cur = nullptr;
  EXPECT_CU(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, d2);
  for (CUcontext x : {d2, d1, c4, c3, b, a}) EXPECT_CU(cuCtxDestroy_v2(x));
  EXPECT_EQ(used(0), base_[0]);
  EXPECT_EQ(used(1), base_[1]);
  EXPECT_EQ(cuCtxDestroy_v2(a), CUDA_ERROR_INVALID_CONTEXT) << "already destroyed";
}

TEST_F(Contexts, DestroyingAContextFreesWhatLivesInIt) {
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxCreate_v2(&ctx, 0, 0));
  CUdeviceptr lin = 0, pitch_p = 0, man = 0, block = 0;
  size_t pitch = 0;
  ASSERT_CU(cuMemAlloc_v2(&lin, 10 * kMiB));
  ASSERT_CU(cuMemAllocPitch_v2(&pitch_p, &pitch, 1000, 1000, 4));
  ASSERT_CU(cuMemAllocManaged(&man, kMiB, CU_MEM_ATTACH_GLOBAL));
  CUarray arr = nullptr;
  CUDA_ARRAY_DESCRIPTOR ad{};
  ad.Width = 1000;
  ad.Height = 1000;
  ad.Format = CU_AD_FORMAT_FLOAT;
  ad.NumChannels = 1;
  ASSERT_CU(cuArrayCreate_v2(&arr, &ad));
  ASSERT_CU(cuMemAllocAsync(&block, kMiB, nullptr));  // a pool block: device-level, survives
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h = 0;
  ASSERT_CU(cuMemCreate(&h, 2 * kMiB, &prop, 0));  // VMM: device-level, survives
  EXPECT_EQ(used(0), base_[0] + 64 * kMiB + 10 * kMiB + 1024 * 1000 + kMiB + 4 * kMiB + 2 * kMiB + 2 * kMiB);

  ASSERT_CU(cuCtxDestroy_v2(ctx));
  EXPECT_EQ(used(0), base_[0] + 2 * kMiB + 2 * kMiB) << "pool chunk and VMM memory remain";
  EXPECT_EQ(cuMemFree_v2(lin), CUDA_ERROR_INVALID_VALUE) << "freed with its context";
  EXPECT_EQ(cuArrayDestroy(arr), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_CU(cuMemFree_v2(block));  // no context needed for a pool block
  CUmemoryPool pool = nullptr;
  ASSERT_CU(cuDeviceGetDefaultMemPool(&pool, 0));
  EXPECT_CU(cuMemPoolTrimTo(pool, 0));
  EXPECT_CU(cuMemRelease(h));
  EXPECT_EQ(used(0), base_[0]);
}

TEST_F(Contexts, AttachCountsUsesAndDetachDestroysAtZero) {
  const uint64_t u = used(0);
  CUcontext ctx = nullptr, attached = nullptr;
  CUdeviceptr p = 0;
  ASSERT_CU(cuCtxCreate_v2(&ctx, 0, 0));
  ASSERT_CU(cuMemAlloc_v2(&p, 10 * kMiB));
  EXPECT_EQ(cuCtxAttach(&attached, 1), CUDA_ERROR_INVALID_VALUE) << "flags must be 0";
  ASSERT_CU(cuCtxAttach(&attached, 0));
  EXPECT_EQ(attached, ctx) << "the current context";
  EXPECT_CU(cuCtxDetach(ctx));
  EXPECT_EQ(used(0), u + 64 * kMiB + 10 * kMiB) << "attached once more than detached: alive";
  CUcontext other = nullptr;
  ASSERT_CU(cuCtxCreate_v2(&other, 0, 0));  // now current instead
  EXPECT_EQ(cuCtxDetach(ctx), CUDA_ERROR_INVALID_CONTEXT) << "must be current";
  ASSERT_CU(cuCtxDestroy_v2(other));
  ASSERT_CU(cuCtxSetCurrent(ctx));
  EXPECT_CU(cuCtxDetach(ctx));
  EXPECT_EQ(used(0), u) << "the last use: destroyed with its memory";
  EXPECT_EQ(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);
  CUdevice dev = -1;
  EXPECT_EQ(cuCtxPushCurrent_v2(ctx), CUDA_ERROR_CONTEXT_IS_DESTROYED);
  (void)dev;
}

TEST_F(Contexts, PrimaryContextIsRefcounted) {
  const uint64_t u = used(0);
  unsigned flags = 0;
  int active = -1;
  CUcontext p1 = nullptr, p2 = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 0);
  ASSERT_CU(cuDevicePrimaryCtxRetain(&p1, 0));
  EXPECT_EQ(used(0), u + 64 * kMiB);
  ASSERT_CU(cuDevicePrimaryCtxRetain(&p2, 0));
  EXPECT_EQ(p1, p2) << "one primary context per device";
  EXPECT_EQ(used(0), u + 64 * kMiB) << "charged once";
  ASSERT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 1);
  ASSERT_CU(cuDevicePrimaryCtxRelease_v2(0));
  EXPECT_EQ(used(0), u + 64 * kMiB) << "still retained once";
  ASSERT_CU(cuCtxSetCurrent(p1));
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc_v2(&p, 3 * kMiB));
  ASSERT_CU(cuDevicePrimaryCtxRelease(0));  // the last release destroys it, with its memory
  EXPECT_EQ(used(0), u);
  ASSERT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 0);
  EXPECT_EQ(cuDevicePrimaryCtxRelease_v2(0), CUDA_ERROR_INVALID_CONTEXT) << "not retained";
  EXPECT_EQ(cuMemAlloc_v2(&p, 1), CUDA_ERROR_CONTEXT_IS_DESTROYED) << "current but inactive";

  // Retained again: charged again. Reset drops everything however often retained.
  ASSERT_CU(cuDevicePrimaryCtxRetain(&p1, 0));
  ASSERT_CU(cuDevicePrimaryCtxRetain(&p1, 0));
  EXPECT_EQ(used(0), u + 64 * kMiB);
  ASSERT_CU(cuMemAlloc_v2(&p, 5 * kMiB));
  EXPECT_EQ(used(0), u + 69 * kMiB);
  ASSERT_CU(cuDevicePrimaryCtxReset_v2(0));
  EXPECT_EQ(used(0), u);
  ASSERT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 0);
  EXPECT_EQ(cuDevicePrimaryCtxRelease_v2(0), CUDA_ERROR_INVALID_CONTEXT) << "reset leaves it unretained";
  EXPECT_EQ(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);

  // Primary contexts of different devices are independent.
  CUcontext q = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxRetain(&q, 1));
  EXPECT_EQ(used(1), base_[1] + 16 * kMiB);
  EXPECT_EQ(used(0), u);
  EXPECT_NE(q, p1);
  ASSERT_CU(cuDevicePrimaryCtxReset(1));
  EXPECT_EQ(used(1), base_[1]);
  ASSERT_CU(cuCtxSetCurrent(nullptr));
}

// A green context with all of `dev`'s SMs.
CUresult create_green(CUgreenCtx* green, CUdevice dev) {
  CUdevResource sms{};
  CUdevResourceDesc desc = nullptr;
  if (CUresult r = cuDeviceGetDevResource(dev, &sms, CU_DEV_RESOURCE_TYPE_SM)) return r;
  if (CUresult r = cuDevResourceGenerateDesc(&desc, &sms, 1)) return r;
  return cuGreenCtxCreate(green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
}

TEST_F(Contexts, GreenContextsRunOnTheirDeviceWithoutAFootprint) {
  CUdevResource res{};
  ASSERT_CU(cuDeviceGetDevResource(0, &res, CU_DEV_RESOURCE_TYPE_SM));
  EXPECT_EQ(res.type, CU_DEV_RESOURCE_TYPE_SM);
  EXPECT_EQ(res.sm.smCount, 108u);
  EXPECT_EQ(cuDeviceGetDevResource(0, &res, CU_DEV_RESOURCE_TYPE_INVALID), CUDA_ERROR_INVALID_RESOURCE_TYPE);
  EXPECT_EQ(cuDeviceGetDevResource(kDevices, &res, CU_DEV_RESOURCE_TYPE_SM), CUDA_ERROR_INVALID_DEVICE);
  ASSERT_CU(cuDeviceGetDevResource(0, &res, CU_DEV_RESOURCE_TYPE_SM));
  CUdevResourceDesc desc = nullptr;
  ASSERT_CU(cuDevResourceGenerateDesc(&desc, &res, 1));

  CUgreenCtx green = nullptr;
  EXPECT_EQ(cuGreenCtxCreate(&green, desc, 0, 0), CUDA_ERROR_INVALID_VALUE) << "CU_GREEN_CTX_DEFAULT_STREAM is required";
  EXPECT_EQ(cuGreenCtxCreate(&green, nullptr, 0, CU_GREEN_CTX_DEFAULT_STREAM), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuGreenCtxCreate(&green, desc, 0, CU_GREEN_CTX_DEFAULT_STREAM));
  EXPECT_EQ(used(0), base_[0]) << "no context footprint";
  CUcontext cur = nullptr;
  EXPECT_CU(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, nullptr) << "not made current";

  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxFromGreenCtx(&ctx, green));
  ASSERT_NE(ctx, nullptr);
  ASSERT_CU(cuCtxSetCurrent(ctx));
  CUdevice dev = -1;
  EXPECT_CU(cuCtxGetDevice(&dev));
  EXPECT_EQ(dev, 0);
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc_v2(&p, 10 * kMiB));
  EXPECT_EQ(used(0), base_[0] + 10 * kMiB);
  EXPECT_EQ(cuCtxDestroy_v2(ctx), CUDA_ERROR_INVALID_CONTEXT) << "destroyed with cuGreenCtxDestroy only";

  ASSERT_CU(cuGreenCtxDestroy(green));
  EXPECT_CU(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, nullptr) << "destroying the current green context pops it";
  EXPECT_EQ(used(0), base_[0] + 10 * kMiB) << "its memory is the primary context's and stays";
  EXPECT_EQ(cuGreenCtxDestroy(green), CUDA_ERROR_CONTEXT_IS_DESTROYED);
  EXPECT_EQ(cuCtxFromGreenCtx(&ctx, green), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(cuCtxSetCurrent(ctx), CUDA_ERROR_CONTEXT_IS_DESTROYED);
  EXPECT_CU(cuMemFree_v2(p));
  EXPECT_EQ(used(0), base_[0]);
}

// SIMCUDA_REUSE_CONTEXTS=1: a green context's CUcontext is a context record
// like any other, recycled both ways.
TEST(Config, GreenContextHandlesAreReused) {
  std::string path = g_state + ".green";
  unlink(path.c_str());
  SelfResult r = run_self("GreenReuse", {{"SIMCUDA_STATE", path}, {"SIMCUDA_REUSE_CONTEXTS", "1"}});
  EXPECT_TRUE(r.passed()) << r.output;
  unlink(path.c_str());
}

TEST(InChild, GreenReuse) {
  CHILD_ONLY("GreenReuse");
  ASSERT_CU(cuInit(0));
  CUgreenCtx green = nullptr;
  CUcontext from_green = nullptr, ctx = nullptr;
  CUdevice dev = -1;
  ASSERT_CU(create_green(&green, 0));
  ASSERT_CU(cuCtxFromGreenCtx(&from_green, green));
  ASSERT_CU(cuGreenCtxDestroy(green));
  ASSERT_CU(cuCtxCreate_v2(&ctx, 0, 1));
  EXPECT_EQ(ctx, from_green) << "a destroyed green context's handle goes to the next context";
  EXPECT_CU(cuCtxGetDevice(&dev));
  EXPECT_EQ(dev, 1);
  EXPECT_EQ(used(1), kCtx[1]);
  ASSERT_CU(cuCtxDestroy_v2(ctx));
  ASSERT_CU(create_green(&green, 2));
  ASSERT_CU(cuCtxFromGreenCtx(&from_green, green));
  EXPECT_EQ(from_green, ctx) << "and a destroyed context's to the next green context";
  ASSERT_CU(cuCtxSetCurrent(from_green));
  EXPECT_CU(cuCtxGetDevice(&dev));
  EXPECT_EQ(dev, 2);
  ASSERT_CU(cuGreenCtxDestroy(green));
}

// ===========================================================================
// VMM
// ===========================================================================

using Vmm = Sim;

TEST_F(Vmm, PhysicalMemoryIsChargedUntilReleasedAndUnmapped) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  ASSERT_CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  EXPECT_EQ(gran, 2 * kMiB);
  ASSERT_CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  EXPECT_EQ(gran, 2 * kMiB);

  CUmemGenericAllocationHandle h = 0, h2 = 0, host = 0;
  EXPECT_EQ(cuMemCreate(&h, 3 * kMiB, &prop, 0), CUDA_ERROR_INVALID_VALUE) << "not a multiple of 2 MiB";
  EXPECT_EQ(used(0), base_[0]);
  const uint64_t vmm0 = simcuda_vmm_bytes(0), vmm1 = simcuda_vmm_bytes(1);
  ASSERT_CU(cuMemCreate(&h, 4 * kMiB, &prop, 0));
  EXPECT_EQ(used(0), base_[0] + 4 * kMiB);
  EXPECT_EQ(simcuda_vmm_bytes(0), vmm0 + 4 * kMiB);
  CUmemAllocationProp got{};
  ASSERT_CU(cuMemGetAllocationPropertiesFromHandle(&got, h));
  EXPECT_EQ(got.location.id, 0);
  EXPECT_EQ(got.location.type, CU_MEM_LOCATION_TYPE_DEVICE);

  CUmemAllocationProp hprop = prop;
  hprop.location.type = CU_MEM_LOCATION_TYPE_HOST;
  hprop.location.id = 0;
  ASSERT_CU(cuMemCreate(&host, 2 * kMiB, &hprop, 0));
  EXPECT_EQ(used(0), base_[0] + 4 * kMiB) << "host physical memory is not device memory";
  prop.location.id = 1;
  ASSERT_CU(cuMemCreate(&h2, 2 * kMiB, &prop, 0));
  EXPECT_EQ(used(1), base_[1] + 2 * kMiB);
  EXPECT_EQ(simcuda_vmm_bytes(1), vmm1 + 2 * kMiB);
  prop.location.id = kDevices;
  CUmemGenericAllocationHandle bad = 0;
  EXPECT_EQ(cuMemCreate(&bad, 2 * kMiB, &prop, 0), CUDA_ERROR_INVALID_DEVICE);

  // Released while mapped: the memory stays until the last unmap.
  CUdeviceptr va = 0;
  ASSERT_CU(cuMemAddressReserve(&va, 8 * kMiB, 0, 0, 0));
  EXPECT_EQ(va % (2 * kMiB), 0u);
  EXPECT_EQ(used(0), base_[0] + 4 * kMiB) << "address space costs nothing";
  ASSERT_CU(cuMemMap(va, 4 * kMiB, 0, h, 0));
  ASSERT_CU(cuMemMap(va + 4 * kMiB, 2 * kMiB, 2 * kMiB, h, 0));  // the same memory mapped twice
  CUmemAccessDesc acc{};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EXPECT_CU(cuMemSetAccess(va, 6 * kMiB, &acc, 1));
  CUdeviceptr rb = 0;
  size_t rs = 0;
  ASSERT_CU(cuMemGetAddressRange_v2(&rb, &rs, va + 4 * kMiB + 7));
  EXPECT_EQ(rb, va + 4 * kMiB);
  EXPECT_EQ(rs, 2 * kMiB);
  EXPECT_CU(cuMemRelease(h));
  EXPECT_EQ(used(0), base_[0] + 4 * kMiB) << "still mapped";
  EXPECT_EQ(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE) << "released twice";
  EXPECT_CU(cuMemUnmap(va, 4 * kMiB));
  EXPECT_EQ(used(0), base_[0] + 4 * kMiB) << "one mapping left";
  EXPECT_CU(cuMemAddressFree(va, 8 * kMiB));  // unmaps the rest
  EXPECT_EQ(used(0), base_[0]);
  EXPECT_EQ(simcuda_vmm_bytes(0), vmm0);

  EXPECT_CU(cuMemRelease(h2));
  EXPECT_CU(cuMemRelease(host));
  EXPECT_EQ(used(1), base_[1]);
  EXPECT_EQ(simcuda_vmm_bytes(1), vmm1);

  // A handle retained from a mapping is one more reference to release.
  prop.location.id = 0;
  ASSERT_CU(cuMemCreate(&h, 2 * kMiB, &prop, 0));
  ASSERT_CU(cuMemAddressReserve(&va, 2 * kMiB, 0, 0, 0));
  CUmemGenericAllocationHandle retained = 0;
  EXPECT_EQ(cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(va)), CUDA_ERROR_INVALID_VALUE)
      << "not mapped yet";
  ASSERT_CU(cuMemMap(va, 2 * kMiB, 0, h, 0));
  ASSERT_CU(cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(va + 4096)));
  EXPECT_EQ(retained, h) << "the handle it was mapped with";
  EXPECT_CU(cuMemRelease(h));
  EXPECT_CU(cuMemUnmap(va, 2 * kMiB));
  EXPECT_EQ(used(0), base_[0] + 2 * kMiB) << "the retained reference keeps it";
  EXPECT_CU(cuMemRelease(retained));
  EXPECT_EQ(used(0), base_[0]);
  EXPECT_CU(cuMemAddressFree(va, 2 * kMiB));
}

// ===========================================================================
// Arrays
// ===========================================================================

using Arrays = Sim;

TEST_F(Arrays, ReportedSizeIsWhatIsCharged) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  struct Case {
    const char* what;
    CUDA_ARRAY3D_DESCRIPTOR d;
    unsigned levels;  // 0: a plain array
    uint64_t bytes;   // the size rule: texels * bytes, summed over levels, rounded up to 2 MiB
    bool charged;
  };
  auto desc = [](size_t w, size_t h, size_t z, CUarray_format f, unsigned ch, unsigned flags) {
    CUDA_ARRAY3D_DESCRIPTOR d{};
    d.Width = w;
    d.Height = h;
    d.Depth = z;
    d.Format = f;
    d.NumChannels = ch;
    d.Flags = flags;
    return d;
  };
  const Case cases[] = {
      {"2D 1000x1000 float", desc(1000, 1000, 0, CU_AD_FORMAT_FLOAT, 1, 0), 0, 4 * kMiB, true},
      {"1D 100 uint8", desc(100, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0), 0, 2 * kMiB, true},
      {"3D 64^3 float4", desc(64, 64, 64, CU_AD_FORMAT_FLOAT, 4, 0), 0, 4 * kMiB, true},
      {"3D 64^3 float4 + 1 texel", desc(65, 64, 64, CU_AD_FORMAT_FLOAT, 4, 0), 0, 6 * kMiB, true},
      {"layered 256x256x10", desc(256, 256, 10, CU_AD_FORMAT_UNSIGNED_INT8, 1, CUDA_ARRAY3D_LAYERED), 0, 2 * kMiB,
       true},
      {"cubemap 512 half4", desc(512, 512, 6, CU_AD_FORMAT_HALF, 4, CUDA_ARRAY3D_CUBEMAP), 0, 12 * kMiB, true},
      {"packed unorm8x4", desc(1024, 1024, 0, CU_AD_FORMAT_UNORM_INT8X4, 4, 0), 0, 4 * kMiB, true},
      {"sparse", desc(1024, 1024, 0, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_SPARSE), 0, 4 * kMiB, false},
      {"deferred mapping", desc(1024, 1024, 0, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_DEFERRED_MAPPING), 0, 4 * kMiB,
       false},
      // Mipmaps: 4 MiB + 1 MiB + 256 KiB.
      {"mip 1024^2 uchar4 x3", desc(1024, 1024, 0, CU_AD_FORMAT_UNSIGNED_INT8, 4, 0), 3, 6 * kMiB, true},
      // 3D levels halve the depth (8 + 1 + 0.125 MiB), layered ones keep it (8 + 2 + 0.5 MiB).
      {"mip 3D 512x512x8 x3", desc(512, 512, 8, CU_AD_FORMAT_FLOAT, 1, 0), 3, 10 * kMiB, true},
      {"mip layered 512x512x8 x3", desc(512, 512, 8, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_LAYERED), 3, 12 * kMiB,
       true},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    const uint64_t before = used(0);
    CUDA_ARRAY_MEMORY_REQUIREMENTS req{};
    if (k.levels == 0) {
      CUarray a = nullptr;
      ASSERT_CU(cuArray3DCreate_v2(&a, &k.d));
      EXPECT_EQ(simcuda_array_bytes(a), k.bytes);
      ASSERT_CU(cuArrayGetMemoryRequirements(&req, a, 0));
      EXPECT_EQ(req.size, k.bytes);
      EXPECT_EQ(req.alignment, 2 * kMiB);
      EXPECT_EQ(used(0), before + (k.charged ? k.bytes : 0));
      CUDA_ARRAY3D_DESCRIPTOR back{};
      ASSERT_CU(cuArray3DGetDescriptor_v2(&back, a));
      EXPECT_EQ(back.Width, k.d.Width);
      EXPECT_EQ(back.Flags, k.d.Flags);
      EXPECT_CU(cuArrayDestroy(a));
      EXPECT_EQ(simcuda_array_bytes(a), 0u) << "destroyed";
    } else {
      CUmipmappedArray m = nullptr;
      ASSERT_CU(cuMipmappedArrayCreate(&m, &k.d, k.levels));
      EXPECT_EQ(simcuda_mipmapped_array_bytes(m), k.bytes);
      ASSERT_CU(cuMipmappedArrayGetMemoryRequirements(&req, m, 0));
      EXPECT_EQ(req.size, k.bytes);
      EXPECT_EQ(used(0), before + k.bytes);
      EXPECT_CU(cuMipmappedArrayDestroy(m));
    }
    EXPECT_EQ(used(0), before);
  }

  // The 2D entry points (v1 and v2) follow the same rule.
  const uint64_t before = used(0);
  CUDA_ARRAY_DESCRIPTOR_v1 d1{};
  d1.Width = 1000;
  d1.Height = 1000;
  d1.Format = CU_AD_FORMAT_FLOAT;
  d1.NumChannels = 2;
  CUarray a1 = nullptr, a2 = nullptr;
  ASSERT_CU(cuArrayCreate(&a1, &d1));
  EXPECT_EQ(simcuda_array_bytes(a1), 8 * kMiB);
  CUDA_ARRAY_DESCRIPTOR d2{};
  d2.Width = 2048;
  d2.Height = 1024;
  d2.Format = CU_AD_FORMAT_SIGNED_INT16;
  d2.NumChannels = 1;
  ASSERT_CU(cuArrayCreate_v2(&a2, &d2));
  EXPECT_EQ(simcuda_array_bytes(a2), 4 * kMiB);
  EXPECT_EQ(used(0), before + 12 * kMiB);
  EXPECT_CU(cuArrayDestroy(a1));
  EXPECT_CU(cuArrayDestroy(a2));
  EXPECT_EQ(cuArrayDestroy(a2), CUDA_ERROR_INVALID_HANDLE);

  // Refused descriptors charge nothing.
  CUarray bad = nullptr;
  CUmipmappedArray badm = nullptr;
  auto d = desc(64, 64, 0, CU_AD_FORMAT_FLOAT, 3, 0);
  EXPECT_EQ(cuArray3DCreate_v2(&bad, &d), CUDA_ERROR_INVALID_VALUE) << "3 channels";
  d = desc(64, 64, 0, CU_AD_FORMAT_BC1_UNORM, 4, 0);
  EXPECT_EQ(cuArray3DCreate_v2(&bad, &d), CUDA_ERROR_NOT_SUPPORTED) << "a format the sim does not model";
  d = desc(512, 256, 6, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_CUBEMAP);
  EXPECT_EQ(cuArray3DCreate_v2(&bad, &d), CUDA_ERROR_INVALID_VALUE) << "cubemap faces must be square";
  d = desc(1024, 1024, 0, CU_AD_FORMAT_FLOAT, 1, 0);
  EXPECT_EQ(cuMipmappedArrayCreate(&badm, &d, 12), CUDA_ERROR_INVALID_VALUE) << "1024 has 11 levels";
  EXPECT_EQ(used(0), before);
}

// ===========================================================================
// Stream-ordered pools
// ===========================================================================

using Pools = Sim;

TEST_F(Pools, DefaultPoolGrowsInChunksReusesAndReleasesAtSync) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  const uint64_t u = used(0);
  CUmemoryPool pool = nullptr, cur = nullptr;
  ASSERT_CU(cuDeviceGetDefaultMemPool(&pool, 0));
  ASSERT_CU(cuDeviceGetMemPool(&cur, 0));
  EXPECT_EQ(pool, cur);
  EXPECT_EQ(pool_attr(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), 0u);
  ASSERT_EQ(simcuda_pool_reserved(pool), 0u);

  CUdeviceptr a = 0, b = 0, d = 0, e = 0;
  ASSERT_CU(cuMemAllocAsync(&a, 1000, nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 2 * kMiB) << "one 2 MiB chunk";
  EXPECT_EQ(simcuda_pool_used(pool), 1024u) << "blocks round up to 512 bytes";
  EXPECT_EQ(used(0), u + 2 * kMiB) << "the device is charged the reservation";
  EXPECT_EQ(pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 2 * kMiB);
  EXPECT_EQ(pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 1024u);
  CUdeviceptr rb = 0;
  size_t rs = 0;
  ASSERT_CU(cuMemGetAddressRange_v2(&rb, &rs, a));
  EXPECT_EQ(rs, 1000u) << "the block reports the requested size";

  ASSERT_CU(cuMemAllocAsync(&b, 3 * kMiB, nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "grown to the chunk boundary of what is in use";
  EXPECT_EQ(used(0), u + 4 * kMiB);
  ASSERT_CU(cuMemAllocAsync(&d, kMiB - 1024, nullptr));
  EXPECT_EQ(simcuda_pool_used(pool), 4 * kMiB);
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "fits exactly: no growth";

  // Freed blocks go back to the pool; nothing is released before a synchronize.
  ASSERT_CU(cuMemFreeAsync(b, nullptr));
  EXPECT_EQ(simcuda_pool_used(pool), kMiB);
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB);
  EXPECT_EQ(used(0), u + 4 * kMiB);
  ASSERT_CU(cuMemAllocAsync(&e, 2 * kMiB, nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "reuses the freed space";
  EXPECT_EQ(cuStreamQuery(nullptr), CUDA_SUCCESS);
  ASSERT_CU(cuMemFreeAsync(e, nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "a query is not a synchronize";
  EXPECT_EQ(pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), 4 * kMiB);
  EXPECT_EQ(pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH), 4 * kMiB);

  // Synchronize with threshold 0: down to the chunks live blocks need.
  ASSERT_CU(cuStreamSynchronize(nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 2 * kMiB) << "1 MiB in use needs one chunk";
  EXPECT_EQ(used(0), u + 2 * kMiB);
  ASSERT_CU(cuMemFreeAsync(a, nullptr));
  ASSERT_CU(cuMemFreeAsync(d, nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 2 * kMiB);
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(simcuda_pool_reserved(pool), 0u);
  EXPECT_EQ(simcuda_pool_reserved_bytes(0), 0u);
  EXPECT_EQ(used(0), u);

  // A release threshold: a synchronize keeps up to the threshold (whole chunks).
  cuuint64_t threshold = 5 * kMiB;
  ASSERT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  ASSERT_CU(cuMemAllocAsync(&a, 7 * kMiB, nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 8 * kMiB);
  ASSERT_CU(cuMemFreeAsync(a, nullptr));
  CUevent ev = nullptr;
  ASSERT_CU(cuEventCreate(&ev, 0));
  ASSERT_CU(cuEventRecord(ev, nullptr));
  ASSERT_CU(cuEventSynchronize(ev));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "5 MiB rounded down to whole chunks";
  EXPECT_EQ(used(0), u + 4 * kMiB);
  ASSERT_CU(cuStreamSynchronize(nullptr));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "at or below the threshold: kept";
  threshold = 9 * kMiB;
  ASSERT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  ASSERT_CU(cuMemAllocAsync(&a, 8 * kMiB, nullptr));
  ASSERT_CU(cuMemFreeAsync(a, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(simcuda_pool_reserved(pool), 8 * kMiB);

  // Trim: down to max(keep rounded up to a chunk, what live blocks need).
  ASSERT_CU(cuMemPoolTrimTo(pool, 3 * kMiB));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB);
  ASSERT_CU(cuMemAllocAsync(&a, 2 * kMiB + 1, nullptr));
  ASSERT_CU(cuMemPoolTrimTo(pool, 0));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB) << "a live block keeps its chunks";
  EXPECT_EQ(used(0), u + 4 * kMiB);
  ASSERT_CU(cuMemFreeAsync(a, nullptr));
  ASSERT_CU(cuMemPoolTrimTo(pool, 0));
  EXPECT_EQ(simcuda_pool_reserved(pool), 0u);

  threshold = 0;
  ASSERT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  EXPECT_CU(cuEventDestroy_v2(ev));
  EXPECT_EQ(used(0), u);
}

TEST_F(Pools, CreatedPoolMaxSizeCurrentPoolAndDestroy) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  const uint64_t u = used(0);
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  props.maxSize = 4 * kMiB;
  CUmemoryPool pool = nullptr, def = nullptr, cur = nullptr;
  ASSERT_CU(cuMemPoolCreate(&pool, &props));
  ASSERT_CU(cuDeviceGetDefaultMemPool(&def, 0));
  EXPECT_NE(pool, def);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

  CUdeviceptr a = 0, b = 0, x = 0;
  ASSERT_CU(cuMemAllocFromPoolAsync(&a, kMiB, pool, s));
  ASSERT_CU(cuMemAllocFromPoolAsync(&b, 2 * kMiB, pool, s));
  EXPECT_EQ(simcuda_pool_reserved(pool), 4 * kMiB);
  EXPECT_EQ(cuMemAllocFromPoolAsync(&x, 2 * kMiB, pool, s), CUDA_ERROR_OUT_OF_MEMORY) << "maxSize 4 MiB";
  EXPECT_EQ(used(0), u + 4 * kMiB);
  EXPECT_EQ(simcuda_pool_reserved(def), 0u) << "the default pool is separate";

  // Made current, it serves cuMemAllocAsync.
  ASSERT_CU(cuDeviceSetMemPool(0, pool));
  ASSERT_CU(cuDeviceGetMemPool(&cur, 0));
  EXPECT_EQ(cur, pool);
  ASSERT_CU(cuMemFreeAsync(b, s));
  ASSERT_CU(cuMemAllocAsync(&b, 512, s));
  EXPECT_EQ(simcuda_pool_used(pool), kMiB + 512);
  EXPECT_EQ(simcuda_pool_reserved(def), 0u);
  EXPECT_EQ(simcuda_pool_reserved_bytes(0), 4 * kMiB);

  // Destroyed with blocks outstanding: shrinks to what they need, goes with the last.
  EXPECT_EQ(cuMemPoolDestroy(def), CUDA_ERROR_INVALID_VALUE) << "the default pool cannot be destroyed";
  ASSERT_CU(cuMemPoolDestroy(pool));
  EXPECT_EQ(simcuda_pool_reserved(pool), 2 * kMiB);
  EXPECT_EQ(used(0), u + 2 * kMiB);
  ASSERT_CU(cuDeviceGetMemPool(&cur, 0));
  EXPECT_EQ(cur, def) << "the device's current pool falls back to the default";
  EXPECT_EQ(cuMemAllocFromPoolAsync(&x, 512, pool, s), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFreeAsync(a, s));
  EXPECT_EQ(used(0), u + 2 * kMiB);
  ASSERT_CU(cuMemFreeAsync(b, s));
  EXPECT_EQ(used(0), u);
  EXPECT_EQ(simcuda_pool_reserved(pool), 0u) << "gone";

  CUmemPoolProps host = props;
  host.location.type = CU_MEM_LOCATION_TYPE_HOST;
  EXPECT_EQ(cuMemPoolCreate(&pool, &host), CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_CU(cuStreamDestroy_v2(s));
}

// ===========================================================================
// Graph memory
// ===========================================================================

using GraphMemory = Sim;

CUDA_MEM_ALLOC_NODE_PARAMS alloc_node_params(int dev, size_t bytes) {
  CUDA_MEM_ALLOC_NODE_PARAMS p{};
  p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.poolProps.location.id = dev;
  p.bytesize = bytes;
  return p;
}

// A new graph with one memory-alloc node per {device, bytes}; null on failure.
CUgraph graph_allocating(std::initializer_list<std::pair<int, size_t>> allocs) {
  CUgraph g = nullptr;
  if (cuGraphCreate(&g, 0) != CUDA_SUCCESS) return nullptr;
  for (auto [dev, bytes] : allocs) {
    CUDA_MEM_ALLOC_NODE_PARAMS p = alloc_node_params(dev, bytes);
    CUgraphNode n = nullptr;
    if (cuGraphAddMemAllocNode(&n, g, nullptr, 0, &p) != CUDA_SUCCESS) return nullptr;
  }
  return g;
}

// Appends a kernel node running f once (no dependencies); null on failure.
CUgraphNode add_kernel_node(CUgraph g, CUfunction f) {
  CUDA_KERNEL_NODE_PARAMS p{};
  p.func = f;
  p.gridDimX = p.gridDimY = p.gridDimZ = 1;
  p.blockDimX = p.blockDimY = p.blockDimZ = 1;
  CUgraphNode n = nullptr;
  return cuGraphAddKernelNode_v2(&n, g, nullptr, 0, &p) == CUDA_SUCCESS ? n : nullptr;
}

uint64_t graph_mem_attr(int dev, CUgraphMem_attribute attr) {
  cuuint64_t v = ~0ull;
  if (cuDeviceGetGraphMemAttribute(dev, attr, &v) != CUDA_SUCCESS) return ~0ull;
  return v;
}

CUresult reset_graph_mem_high(int dev, CUgraphMem_attribute attr) {
  cuuint64_t zero = 0;
  return cuDeviceSetGraphMemAttribute(dev, attr, &zero);
}

std::vector<CUgraphNode> graph_nodes(CUgraph g) {
  size_t n = 0;
  if (cuGraphGetNodes(g, nullptr, &n) != CUDA_SUCCESS) return {};
  std::vector<CUgraphNode> nodes(n);
  if (cuGraphGetNodes(g, nodes.data(), &n) != CUDA_SUCCESS) return {};
  return nodes;
}

CUgraphNodeType node_type(CUgraphNode n) {
  CUgraphNodeType t = static_cast<CUgraphNodeType>(-1);
  if (cuGraphNodeGetType(n, &t) != CUDA_SUCCESS) return static_cast<CUgraphNodeType>(-1);
  return t;
}

// Alloc and free nodes are checked, reported as given and virtual: adding
// them or instantiating their graph charges nothing.
TEST_F(GraphMemory, AllocAndFreeNodesOnlyReserveAddresses) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("graph_kernel");
  ASSERT_NE(f, nullptr);
  const uint64_t u0 = used(0), u1 = used(1);
  CUgraph g = nullptr, other = nullptr;
  ASSERT_CU(cuGraphCreate(&g, 0));
  ASSERT_CU(cuGraphCreate(&other, 0));
  CUgraphNode kernel = add_kernel_node(g, f), foreign = add_kernel_node(other, f);
  ASSERT_NE(kernel, nullptr);
  ASSERT_NE(foreign, nullptr);
  CUgraphNode alloc = nullptr, alloc1 = nullptr, freer = nullptr, n = nullptr;

  CUDA_MEM_ALLOC_NODE_PARAMS p = alloc_node_params(0, 3 * kMiB + 1);
  ASSERT_CU(cuGraphAddMemAllocNode(&alloc, g, &kernel, 1, &p));
  EXPECT_NE(p.dptr, 0u);
  EXPECT_EQ(p.dptr % (2 * kMiB), 0u) << "graph allocations are 2 MiB aligned";
  CUDA_MEM_ALLOC_NODE_PARAMS p1 = alloc_node_params(1, 1);
  ASSERT_CU(cuGraphAddMemAllocNode(&alloc1, g, nullptr, 0, &p1));
  EXPECT_TRUE(p1.dptr >= p.dptr + 4 * kMiB || p1.dptr + 2 * kMiB <= p.dptr) << "ranges of rounded sizes overlap";
  EXPECT_EQ(used(0), u0) << "an alloc node charges nothing";
  EXPECT_EQ(used(1), u1);

  CUDA_MEM_ALLOC_NODE_PARAMS bad = alloc_node_params(0, 0);
  EXPECT_EQ(cuGraphAddMemAllocNode(&n, g, nullptr, 0, &bad), CUDA_ERROR_INVALID_VALUE) << "zero bytes";
  bad = alloc_node_params(kDevices, kMiB);
  EXPECT_EQ(cuGraphAddMemAllocNode(&n, g, nullptr, 0, &bad), CUDA_ERROR_INVALID_VALUE) << "no such device";
  bad = alloc_node_params(0, kMiB);
  bad.poolProps.location.type = CU_MEM_LOCATION_TYPE_HOST;
  EXPECT_EQ(cuGraphAddMemAllocNode(&n, g, nullptr, 0, &bad), CUDA_ERROR_INVALID_VALUE) << "device memory only";
  bad = alloc_node_params(0, kMiB);
  bad.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_INVALID;
  EXPECT_EQ(cuGraphAddMemAllocNode(&n, g, nullptr, 0, &bad), CUDA_ERROR_INVALID_VALUE) << "pinned only";
  EXPECT_EQ(cuGraphAddMemAllocNode(&n, g, nullptr, 0, nullptr), CUDA_ERROR_INVALID_VALUE);
  bad = alloc_node_params(0, kMiB);
  EXPECT_EQ(cuGraphAddMemAllocNode(&n, g, &foreign, 1, &bad), CUDA_ERROR_INVALID_VALUE) << "another graph's node";
  EXPECT_EQ(cuGraphAddMemAllocNode(nullptr, g, nullptr, 0, &bad), CUDA_ERROR_INVALID_VALUE);

  ASSERT_CU(cuGraphAddMemFreeNode(&freer, g, &alloc, 1, p.dptr));
  EXPECT_EQ(cuGraphAddMemFreeNode(&n, g, nullptr, 0, p.dptr + 512), CUDA_ERROR_INVALID_VALUE)
      << "not the address of a graph allocation";
  CUdeviceptr linear = 0;
  ASSERT_CU(cuMemAlloc_v2(&linear, kMiB));
  EXPECT_EQ(cuGraphAddMemFreeNode(&n, g, nullptr, 0, linear), CUDA_ERROR_INVALID_VALUE) << "not graph memory";
  EXPECT_CU(cuMemFree_v2(linear));
  ASSERT_CU(cuGraphAddMemFreeNode(&n, other, nullptr, 0, p1.dptr)) << "any graph's allocation may be freed";

  CUDA_MEM_ALLOC_NODE_PARAMS out{};
  out.accessDescCount = 5;
  ASSERT_CU(cuGraphMemAllocNodeGetParams(alloc, &out));
  EXPECT_EQ(out.bytesize, 3 * kMiB + 1) << "as requested, not rounded";
  EXPECT_EQ(out.dptr, p.dptr);
  EXPECT_EQ(out.poolProps.allocType, CU_MEM_ALLOCATION_TYPE_PINNED);
  EXPECT_EQ(out.poolProps.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
  EXPECT_EQ(out.poolProps.location.id, 0);
  EXPECT_EQ(out.accessDescs, nullptr);
  EXPECT_EQ(out.accessDescCount, 0u);
  EXPECT_EQ(cuGraphMemAllocNodeGetParams(freer, &out), CUDA_ERROR_INVALID_VALUE) << "a free node";
  EXPECT_EQ(cuGraphMemAllocNodeGetParams(kernel, &out), CUDA_ERROR_INVALID_VALUE) << "a kernel node";
  CUdeviceptr freed = 0;
  ASSERT_CU(cuGraphMemFreeNodeGetParams(freer, &freed));
  EXPECT_EQ(freed, p.dptr);
  EXPECT_EQ(cuGraphMemFreeNodeGetParams(alloc, &freed), CUDA_ERROR_INVALID_VALUE);

  // cuGraphGetNodes: the count, or up to *count nodes in the order added.
  size_t count = 0;
  ASSERT_CU(cuGraphGetNodes(g, nullptr, &count));
  EXPECT_EQ(count, 4u);
  CUgraphNode nodes[8] = {};
  count = 2;
  ASSERT_CU(cuGraphGetNodes(g, nodes, &count));
  EXPECT_EQ(count, 4u) << "the total, even when fewer were asked for";
  EXPECT_EQ(nodes[0], kernel);
  EXPECT_EQ(nodes[1], alloc);
  EXPECT_EQ(nodes[2], nullptr) << "only as many as asked for are written";
  EXPECT_EQ(graph_nodes(g), (std::vector<CUgraphNode>{kernel, alloc, alloc1, freer}));
  EXPECT_EQ(cuGraphGetNodes(g, nodes, nullptr), CUDA_ERROR_INVALID_VALUE);
  int not_a_graph = 0;
  EXPECT_EQ(cuGraphGetNodes(reinterpret_cast<CUgraph>(&not_a_graph), nullptr, &count), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(node_type(kernel), CU_GRAPH_NODE_TYPE_KERNEL);
  EXPECT_EQ(node_type(alloc), CU_GRAPH_NODE_TYPE_MEM_ALLOC);
  EXPECT_EQ(node_type(alloc1), CU_GRAPH_NODE_TYPE_MEM_ALLOC);
  EXPECT_EQ(node_type(freer), CU_GRAPH_NODE_TYPE_MEM_FREE);
  CUgraphNodeType t{};
  EXPECT_EQ(cuGraphNodeGetType(reinterpret_cast<CUgraphNode>(&not_a_graph), &t), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuGraphNodeGetType(kernel, nullptr), CUDA_ERROR_INVALID_VALUE);

  // Instantiation only counts the memory.
  CUgraphExec exec = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&exec, g, 0));
  EXPECT_EQ(used(0), u0);
  EXPECT_EQ(used(1), u1);
  EXPECT_EQ(graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0u);
  EXPECT_EQ(graph_mem_attr(1, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 0u);
  EXPECT_CU(cuGraphExecDestroy(exec));

  // A destroyed graph's nodes are gone; its allocations' addresses stay valid for free nodes elsewhere.
  EXPECT_CU(cuGraphDestroy(g));
  EXPECT_EQ(cuGraphNodeGetType(alloc, &t), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuGraphMemAllocNodeGetParams(alloc, &out), CUDA_ERROR_INVALID_VALUE);
  EXPECT_CU(cuGraphAddMemFreeNode(&n, other, nullptr, 0, p.dptr));
  EXPECT_EQ(graph_nodes(other).size(), 3u);
  EXPECT_CU(cuGraphDestroy(other));
}

// During capture, stream-ordered allocations and frees become graph memory
// nodes: no pool grows and nothing is charged.
TEST_F(GraphMemory, CaptureRecordsAllocAsyncAndFreeAsync) {
  ScopedCtx c(1);
  ASSERT_CU(c.result);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  CUmemoryPool pool = nullptr;
  ASSERT_CU(cuDeviceGetDefaultMemPool(&pool, 1));
  const uint64_t u = used(1), reserved = simcuda_pool_reserved(pool), in_use = simcuda_pool_used(pool);
  ASSERT_CU(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(cuMemAllocAsync(&a, 5 * kMiB, s));
  ASSERT_CU(cuMemAllocFromPoolAsync_ptsz(&b, 1000, pool, s));
  EXPECT_NE(a, 0u);
  EXPECT_NE(b, 0u);
  ASSERT_CU(cuMemFreeAsync(a, s));
  ASSERT_CU(cuMemFreeAsync_ptsz(b, s));
  EXPECT_EQ(used(1), u) << "captured allocations are not charged";
  EXPECT_EQ(simcuda_pool_reserved(pool), reserved) << "nor taken from a pool";
  EXPECT_EQ(simcuda_pool_used(pool), in_use);
  CUgraph g = nullptr;
  ASSERT_CU(cuStreamEndCapture(s, &g));

  std::vector<CUgraphNode> nodes = graph_nodes(g);
  ASSERT_EQ(nodes.size(), 4u);
  EXPECT_EQ(node_type(nodes[0]), CU_GRAPH_NODE_TYPE_MEM_ALLOC);
  EXPECT_EQ(node_type(nodes[1]), CU_GRAPH_NODE_TYPE_MEM_ALLOC);
  EXPECT_EQ(node_type(nodes[2]), CU_GRAPH_NODE_TYPE_MEM_FREE);
  EXPECT_EQ(node_type(nodes[3]), CU_GRAPH_NODE_TYPE_MEM_FREE);
  CUDA_MEM_ALLOC_NODE_PARAMS p{};
  ASSERT_CU(cuGraphMemAllocNodeGetParams(nodes[0], &p));
  EXPECT_EQ(p.bytesize, 5 * kMiB);
  EXPECT_EQ(p.dptr, a);
  EXPECT_EQ(p.poolProps.location.id, 1) << "the stream's device";
  ASSERT_CU(cuGraphMemAllocNodeGetParams(nodes[1], &p));
  EXPECT_EQ(p.bytesize, 1000u);
  EXPECT_EQ(p.dptr, b);
  CUdeviceptr freed = 0;
  ASSERT_CU(cuGraphMemFreeNodeGetParams(nodes[2], &freed));
  EXPECT_EQ(freed, a);
  ASSERT_CU(cuGraphMemFreeNodeGetParams(nodes[3], &freed));
  EXPECT_EQ(freed, b);

  // Outside a capture, freeing a graph allocation's address does nothing.
  EXPECT_CU(cuMemFreeAsync(a, s));
  EXPECT_EQ(used(1), u);
  EXPECT_EQ(graph_nodes(g).size(), 4u);

  // The exec needs 6 + 2 MiB on device 1, charged at launch.
  CUgraphExec exec = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&exec, g, 0));
  ASSERT_CU(cuGraphLaunch(exec, s));
  EXPECT_EQ(used(1), u + 8 * kMiB);
  EXPECT_EQ(graph_mem_attr(1, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 8 * kMiB);
  EXPECT_EQ(simcuda_pool_reserved(pool), reserved) << "graph memory is not the default pool's";
  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_CU(cuGraphExecDestroy(exec));
  EXPECT_CU(cuDeviceGraphMemTrim(1));
  EXPECT_EQ(used(1), u);
  EXPECT_CU(cuGraphDestroy(g));
  EXPECT_CU(cuStreamDestroy_v2(s));
}

// The graph memory pool: charged at the first launch, kept when an exec is
// destroyed, reused by the next exec, released by a trim.
TEST_F(GraphMemory, ChargedAtLaunchCachedAfterDestroyReleasedByTrim) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  ASSERT_CU(reset_graph_mem_high(0, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH));
  ASSERT_CU(reset_graph_mem_high(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH));
  ASSERT_EQ(graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0u);
  ASSERT_EQ(graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH), 0u);
  const uint64_t u = used(0);
  auto attrs = [] {
    return std::vector<uint64_t>{graph_mem_attr(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
                                 graph_mem_attr(0, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH),
                                 graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
                                 graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)};
  };
  using V = std::vector<uint64_t>;

  CUgraph six = graph_allocating({{0, 3 * kMiB}, {0, 1}});  // 4 + 2 MiB
  CUgraph four = graph_allocating({{0, 4 * kMiB}});
  ASSERT_NE(six, nullptr);
  ASSERT_NE(four, nullptr);
  CUgraphExec e1 = nullptr, e2 = nullptr, e3 = nullptr;
  CUDA_GRAPH_INSTANTIATE_PARAMS ip{};
  ip.result_out = CUDA_GRAPH_INSTANTIATE_ERROR;
  ASSERT_CU(cuGraphInstantiateWithParams(&e1, six, &ip));
  EXPECT_EQ(ip.result_out, CUDA_GRAPH_INSTANTIATE_SUCCESS);
  EXPECT_EQ(used(0), u) << "instantiation charges nothing";
  EXPECT_EQ(attrs(), (V{0, 0, 0, 0}));

  ASSERT_CU(cuGraphLaunch(e1, s));
  EXPECT_EQ(used(0), u + 6 * kMiB) << "each allocation rounded up to 2 MiB";
  EXPECT_EQ(attrs(), (V{6 * kMiB, 6 * kMiB, 6 * kMiB, 6 * kMiB}));
  ASSERT_CU(cuGraphLaunch_ptsz(e1, s));
  EXPECT_EQ(used(0), u + 6 * kMiB) << "a relaunch takes nothing new";

  ASSERT_CU(cuGraphExecDestroy(e1));
  EXPECT_EQ(used(0), u + 6 * kMiB) << "the memory stays cached for graphs";
  EXPECT_EQ(attrs(), (V{0, 6 * kMiB, 6 * kMiB, 6 * kMiB}));

  // Another graph's exec fits in what is cached.
  ip = {};
  ASSERT_CU(cuGraphInstantiateWithParams_ptsz(&e2, four, &ip));
  EXPECT_EQ(ip.result_out, CUDA_GRAPH_INSTANTIATE_SUCCESS);
  ASSERT_CU(cuGraphLaunch(e2, s));
  EXPECT_EQ(used(0), u + 6 * kMiB) << "reuses the cached memory";
  EXPECT_EQ(attrs(), (V{4 * kMiB, 6 * kMiB, 6 * kMiB, 6 * kMiB}));
  // One that does not fit takes the free 2 MiB and is charged the other 4.
  ASSERT_CU(cuGraphInstantiateWithFlags(&e3, six, 0));
  ASSERT_CU(cuGraphLaunch(e3, s));
  EXPECT_EQ(used(0), u + 10 * kMiB);
  EXPECT_EQ(attrs(), (V{10 * kMiB, 10 * kMiB, 10 * kMiB, 10 * kMiB}));
  ASSERT_CU(cuGraphExecDestroy(e3));

  // The high-water marks reset to the current values, and only to them.
  cuuint64_t value = 1;
  EXPECT_EQ(cuDeviceSetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, &value), CUDA_ERROR_INVALID_VALUE);
  value = 0;
  EXPECT_EQ(cuDeviceSetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &value), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuDeviceSetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &value),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuDeviceSetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, nullptr), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(reset_graph_mem_high(0, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH));
  EXPECT_EQ(attrs(), (V{4 * kMiB, 4 * kMiB, 10 * kMiB, 10 * kMiB}));

  // A trim releases everything; an exec that held memory is charged again
  // at its next launch.
  ASSERT_CU(cuDeviceGraphMemTrim(0));
  EXPECT_EQ(used(0), u);
  EXPECT_EQ(attrs(), (V{0, 4 * kMiB, 0, 10 * kMiB}));
  ASSERT_CU(reset_graph_mem_high(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH));
  EXPECT_EQ(graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH), 0u);
  ASSERT_CU(cuGraphLaunch(e2, s));
  EXPECT_EQ(used(0), u + 4 * kMiB);
  EXPECT_EQ(attrs(), (V{4 * kMiB, 4 * kMiB, 4 * kMiB, 4 * kMiB}));
  ASSERT_CU(cuGraphExecDestroy(e2));
  ASSERT_CU(cuDeviceGraphMemTrim(0));
  EXPECT_EQ(used(0), u);

  // Devices and arguments.
  cuuint64_t v = 0;
  EXPECT_EQ(cuDeviceGraphMemTrim(kDevices), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceGetGraphMemAttribute(kDevices, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &v), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceSetGraphMemAttribute(-1, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, &value), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuDeviceGetGraphMemAttribute(0, static_cast<CUgraphMem_attribute>(99), &v), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuGraphInstantiateWithParams(&e1, six, nullptr), CUDA_ERROR_INVALID_VALUE);
  int not_a_graph = 0;
  ip = {};
  EXPECT_EQ(cuGraphInstantiateWithParams(&e1, reinterpret_cast<CUgraph>(&not_a_graph), &ip), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(ip.result_out, CUDA_GRAPH_INSTANTIATE_ERROR);

  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_CU(cuGraphDestroy(six));
  EXPECT_CU(cuGraphDestroy(four));
  EXPECT_CU(cuStreamDestroy_v2(s));
}

// cuGraphUpload gives an exec its memory without running it; the legacy
// cuGraphInstantiate forms build the same execs.
TEST_F(GraphMemory, UploadBacksWithoutRunning) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_1000us");
  ASSERT_NE(f, nullptr);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  const uint64_t u = used(0);
  CUgraph g = graph_allocating({{0, 8 * kMiB}});
  ASSERT_NE(g, nullptr);
  ASSERT_NE(add_kernel_node(g, f), nullptr);

  CUgraphExec e1 = nullptr, e2 = nullptr;
  CUgraphNode error_node = reinterpret_cast<CUgraphNode>(1);
  char log[16] = "unchanged";
  ASSERT_CU(cuGraphInstantiate(&e1, g, &error_node, log, sizeof log));
  EXPECT_EQ(error_node, nullptr);
  EXPECT_STREQ(log, "");
  ASSERT_CU(cuGraphInstantiate_v2(&e2, g, nullptr, nullptr, 0));
  EXPECT_EQ(used(0), u);

  const uint64_t busy = simcuda_busy_ns(0, 0), launches = simcuda_launch_count(0, 0);
  ASSERT_CU(cuGraphUpload(e1, s));
  EXPECT_EQ(used(0), u + 8 * kMiB) << "uploaded: backed";
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy) << "an upload runs nothing";
  EXPECT_EQ(simcuda_launch_count(0, 0), launches);
  ASSERT_CU(cuGraphLaunch(e1, s));
  EXPECT_EQ(used(0), u + 8 * kMiB) << "the launch after an upload takes nothing new";
  ASSERT_CU(cuStreamSynchronize(s));  // device time is recorded as it runs
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy + 1 * kMs);
  EXPECT_EQ(simcuda_launch_count(0, 0), launches + 1);
  ASSERT_CU(cuGraphUpload_ptsz(e2, nullptr));
  EXPECT_EQ(used(0), u + 16 * kMiB) << "the cached memory is e1's: e2 is charged its own";
  ASSERT_CU(cuGraphUpload(e2, s));
  EXPECT_EQ(used(0), u + 16 * kMiB) << "uploading twice takes nothing new";

  // A capturing stream refuses an upload.
  CUstream cs = nullptr;
  ASSERT_CU(cuStreamCreate(&cs, 0));
  ASSERT_CU(cuStreamBeginCapture(cs));
  EXPECT_EQ(cuGraphUpload(e1, cs), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  CUgraph captured = nullptr;
  ASSERT_CU(cuStreamEndCapture(cs, &captured));
  EXPECT_EQ(graph_nodes(captured).size(), 0u);
  int not_an_exec = 0;
  EXPECT_EQ(cuGraphUpload(reinterpret_cast<CUgraphExec>(&not_an_exec), s), CUDA_ERROR_INVALID_VALUE);

  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_CU(cuGraphExecDestroy(e1));
  EXPECT_CU(cuGraphExecDestroy(e2));
  EXPECT_EQ(used(0), u + 16 * kMiB);
  EXPECT_CU(cuDeviceGraphMemTrim(0));
  EXPECT_EQ(used(0), u);
  EXPECT_CU(cuGraphDestroy(captured));
  EXPECT_CU(cuGraphDestroy(g));
  EXPECT_CU(cuStreamDestroy_v2(cs));
  EXPECT_CU(cuStreamDestroy_v2(s));
}

// A launch or upload that cannot get its memory on every device returns
// OUT_OF_MEMORY and leaves everything as it was.
TEST_F(GraphMemory, LaunchPastCapacityFailsAndChangesNothing) {
  ScopedCtx c(2);  // 256 MiB, no context footprint
  ASSERT_CU(c.result);
  CUfunction f = get_function("graph_kernel");
  ASSERT_NE(f, nullptr);
  const uint64_t fill_bytes = kCap[2] - used(2) - 10 * kMiB;
  CUdeviceptr fill = 0;
  ASSERT_CU(cuMemAlloc_v2(&fill, fill_bytes));
  for (int d : {1, 2}) {
    ASSERT_CU(reset_graph_mem_high(d, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH));
    ASSERT_CU(reset_graph_mem_high(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH));
  }
  const uint64_t u1 = used(1), u2 = used(2);
  // Device 1's share is taken first, then device 2 has 10 MiB of the 12 it needs.
  CUgraph g = graph_allocating({{1, 2 * kMiB}, {2, 12 * kMiB}});
  ASSERT_NE(g, nullptr);
  CUgraphExec e = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&e, g, 0));
  const uint64_t launches = simcuda_launch_count(2, 0);
  EXPECT_EQ(cuGraphLaunch(e, nullptr), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(cuGraphUpload(e, nullptr), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(used(1), u1) << "device 1's share was given back";
  EXPECT_EQ(used(2), u2);
  EXPECT_EQ(simcuda_launch_count(2, 0), launches) << "nothing ran";
  for (int d : {1, 2}) {
    SCOPED_TRACE(d);
    EXPECT_EQ(graph_mem_attr(d, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 0u);
    EXPECT_EQ(graph_mem_attr(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0u);
    EXPECT_EQ(graph_mem_attr(d, CU_GRAPH_MEM_ATTR_USED_MEM_HIGH), 0u);
    EXPECT_EQ(graph_mem_attr(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH), 0u);
  }

  // With room, the same exec launches.
  ASSERT_CU(cuMemFree_v2(fill));
  ASSERT_CU(cuGraphLaunch(e, nullptr));
  EXPECT_EQ(used(1), u1 + 2 * kMiB);
  EXPECT_EQ(used(2), u2 - fill_bytes + 12 * kMiB);
  EXPECT_EQ(graph_mem_attr(2, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 12 * kMiB);
  // Trimming one device takes the exec's memory on the other back to its pool too.
  ASSERT_CU(cuDeviceGraphMemTrim(2));
  EXPECT_EQ(graph_mem_attr(1, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 0u);
  EXPECT_EQ(graph_mem_attr(1, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 2 * kMiB);
  EXPECT_CU(cuCtxSynchronize());
  EXPECT_CU(cuGraphExecDestroy(e));
  EXPECT_CU(cuDeviceGraphMemTrim(1));
  EXPECT_EQ(used(1), u1);
  EXPECT_EQ(used(2), u2 - fill_bytes);
  EXPECT_CU(cuGraphDestroy(g));
}

// ===========================================================================
// cuGetProcAddress and the entry-point table
// ===========================================================================

struct Row {
  std::string base, exported;
  int version;
  bool per_thread;
};

std::vector<Row> table() {
  std::vector<Row> rows;
  for (size_t i = 0; i < simcuda_proc_table_size(); ++i) {
    const char *base = nullptr, *exported = nullptr;
    int version = 0, pt = 0;
    if (simcuda_proc_table_entry(i, &base, &version, &pt, &exported) != 0) break;
    rows.push_back({base, exported, version, pt != 0});
  }
  return rows;
}

struct Lookup {
  CUresult result;
  void* pfn;
  CUdriverProcAddressQueryResult status;
};

Lookup lookup(const char* name, int version, cuuint64_t flags) {
  Lookup l{CUDA_ERROR_UNKNOWN, reinterpret_cast<void*>(1), static_cast<CUdriverProcAddressQueryResult>(99)};
  l.result = cuGetProcAddress_v2(name, &l.pfn, version, flags, &l.status);
  return l;
}

TEST(ProcAddress, PerVersionAnswers) {
  ASSERT_NE(libcuda(), nullptr) << "libcuda.so.1 (the sim) is not loaded";
  ASSERT_EQ(dlsym(libcuda(), "simcuda_device_count"), reinterpret_cast<void*>(&simcuda_device_count))
      << "libcuda.so.1 is not the simulated driver";
  constexpr cuuint64_t kLegacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
  constexpr cuuint64_t kPtds = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  struct Case {
    const char* base;
    int version;
    cuuint64_t flags;
    const char* expect;  // exported name, or null: not found
    CUdriverProcAddressQueryResult status;
  };
  const Case cases[] = {
      {"cuMemAlloc", 2000, 0, "cuMemAlloc", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAlloc", 3010, 0, "cuMemAlloc", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAlloc", 3019, kLegacy, "cuMemAlloc", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAlloc", 13000, 0, "cuMemAlloc_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAlloc", 13000, kPtds, "cuMemAlloc_v2", CU_GET_PROC_ADDRESS_SUCCESS},  // no per-thread variant
      {"cuMemAlloc", 1999, 0, nullptr, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
      {"cuMemAdvise", 8000, 0, "cuMemAdvise", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAdvise", 12010, 0, "cuMemAdvise", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAdvise", 12019, 0, "cuMemAdvise", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAdvise", 12020, 0, "cuMemAdvise_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAdvise", 7050, 0, nullptr, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
      {"cuCtxCreate", 2000, 0, "cuCtxCreate", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 3019, 0, "cuCtxCreate", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 3020, 0, "cuCtxCreate_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 11039, 0, "cuCtxCreate_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 11040, 0, "cuCtxCreate_v3", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 12049, 0, "cuCtxCreate_v3", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 12050, 0, "cuCtxCreate_v4", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuCtxCreate", 13000, 0, "cuCtxCreate_v4", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuLaunchKernel", 12000, kPtds, "cuLaunchKernel_ptsz", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuLaunchKernel", 12000, kLegacy, "cuLaunchKernel", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuLaunchKernel", 12000, 0, "cuLaunchKernel", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuLaunchKernel", 6050, kPtds, "cuLaunchKernel", CU_GET_PROC_ADDRESS_SUCCESS},  // _ptsz is 7000+
      {"cuStreamSynchronize", 13000, kPtds, "cuStreamSynchronize_ptsz", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemcpyHtoD", 13000, kPtds, "cuMemcpyHtoD_v2_ptds", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemcpyHtoD", 13000, kLegacy, "cuMemcpyHtoD_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAllocAsync", 11020, kPtds, "cuMemAllocAsync_ptsz", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAllocAsync", 11020, kLegacy, "cuMemAllocAsync", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuMemAllocAsync", 11010, kPtds, nullptr, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
      {"cuGetProcAddress", 11020, 0, nullptr, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
      {"cuGetProcAddress", 11030, 0, "cuGetProcAddress", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuInit", 1000, 0, nullptr, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
      {"cuInit", 2000, 0, "cuInit", CU_GET_PROC_ADDRESS_SUCCESS},
      {"cuNoSuchThing", 13000, 0, nullptr, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},
      {"cuMemAlloc_v2", 13000, 0, nullptr, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},  // base names only
      {"simcuda_device_count", 13000, 0, nullptr, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(k.base) + " @" + std::to_string(k.version) + " flags " + std::to_string(k.flags));
    Lookup l = lookup(k.base, k.version, k.flags);
    EXPECT_EQ(l.status, k.status);
    if (k.expect != nullptr) {
      EXPECT_EQ(l.result, CUDA_SUCCESS);
      void* want = dlsym(libcuda(), k.expect);
      ASSERT_NE(want, nullptr) << k.expect << " is not exported";
      EXPECT_EQ(l.pfn, want) << "expected " << k.expect;
    } else {
      EXPECT_EQ(l.result, CUDA_ERROR_NOT_FOUND);
      EXPECT_EQ(l.pfn, nullptr);
    }
    // cuGetProcAddress (v1) gives the same answer without the status.
    void* pfn = reinterpret_cast<void*>(1);
    EXPECT_EQ(cuGetProcAddress(k.base, &pfn, k.version, k.flags), l.result);
    EXPECT_EQ(pfn, l.pfn);
  }

  void* pfn = nullptr;
  CUdriverProcAddressQueryResult st{};
  EXPECT_EQ(cuGetProcAddress_v2("cuInit", &pfn, 13000, kLegacy | kPtds, &st), CUDA_ERROR_INVALID_VALUE)
      << "both stream flags";
  EXPECT_EQ(cuGetProcAddress_v2("cuInit", &pfn, 13000, 1u << 5, &st), CUDA_ERROR_INVALID_VALUE) << "unknown flag";
  EXPECT_EQ(cuGetProcAddress_v2(nullptr, &pfn, 13000, 0, &st), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuGetProcAddress_v2("cuInit", nullptr, 13000, 0, &st), CUDA_ERROR_INVALID_VALUE);
}

// Every row of the table: exported, distinct, and what cuGetProcAddress
// answers for its (base, version, variant): the newest row of the variant
// at or below the version, legacy rows when no per-thread row qualifies.
TEST(ProcAddress, EveryTableRowIsExportedAndSelectedByVersion) {
  ASSERT_NE(libcuda(), nullptr);
  const std::vector<Row> rows = table();
  ASSERT_GE(rows.size(), 100u);
  const char* base = nullptr;
  EXPECT_EQ(simcuda_proc_table_entry(rows.size(), &base, nullptr, nullptr, nullptr), -1);
  std::vector<void*> seen;
  auto expected = [&](const std::string& b, int version, bool ptds) -> const Row* {
    for (int pass = ptds ? 0 : 1; pass < 2; ++pass) {
      const Row* best = nullptr;
      for (const Row& r : rows)
        if (r.base == b && r.per_thread == (pass == 0) && r.version <= version &&
            (best == nullptr || r.version > best->version))
          best = &r;
      if (best != nullptr) return best;
    }
    return nullptr;
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.exported);
    void* sym = dlsym(libcuda(), r.exported.c_str());
    ASSERT_NE(sym, nullptr) << "not exported";
    for (void* s : seen) EXPECT_NE(s, sym) << "two rows export one function";
    seen.push_back(sym);
    EXPECT_EQ(r.base.rfind("cu", 0), 0u);
    EXPECT_EQ(r.exported.rfind(r.base, 0), 0u) << "an exported name extends its base name";
    const cuuint64_t flags =
        r.per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
    Lookup l = lookup(r.base.c_str(), r.version, flags);
    EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
    EXPECT_EQ(l.pfn, sym) << "its own version must select it";
    for (int v : {r.version - 1, r.version + 9, 13000}) {
      const Row* want = expected(r.base, v, r.per_thread);
      Lookup lv = lookup(r.base.c_str(), v, flags);
      if (want == nullptr) {
        EXPECT_EQ(lv.result, CUDA_ERROR_NOT_FOUND) << "@" << v;
        EXPECT_EQ(lv.status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT) << "@" << v;
      } else {
        EXPECT_EQ(lv.pfn, dlsym(libcuda(), want->exported.c_str())) << "@" << v << " expected " << want->exported;
      }
    }
  }
}

// ===========================================================================
// Call counters
// ===========================================================================

TEST(CallCount, CountsEveryEntryIncludingFailures) {
  ASSERT_CU(cuInit(0));
  simcuda_reset_call_counts();
  EXPECT_EQ(simcuda_call_count("cuDriverGetVersion"), 0u);
  int v = 0;
  for (int i = 0; i < 3; ++i) EXPECT_CU(cuDriverGetVersion(&v));
  EXPECT_EQ(simcuda_call_count("cuDriverGetVersion"), 3u);
  // Failed calls count too, per exported name.
  EXPECT_EQ(cuMemAlloc_v2(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAlloc_v2(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(simcuda_call_count("cuMemAlloc_v2"), 2u);
  EXPECT_EQ(simcuda_call_count("cuMemAlloc"), 0u);
  // A call through a cuGetProcAddress pointer is the same entry point.
  void* pfn = nullptr;
  ASSERT_CU(cuGetProcAddress_v2("cuDriverGetVersion", &pfn, 13000, 0, nullptr));
  EXPECT_CU(reinterpret_cast<CUresult (*)(int*)>(pfn)(&v));
  EXPECT_EQ(simcuda_call_count("cuDriverGetVersion"), 4u);
  EXPECT_EQ(simcuda_call_count("cuGetProcAddress_v2"), 1u);
  EXPECT_EQ(simcuda_call_count("cuNoSuchThing"), 0u);
  EXPECT_EQ(simcuda_call_count("simcuda_call_count"), 0u);
  EXPECT_EQ(simcuda_call_count(nullptr), 0u);

  // A forked child starts from zero; the parent's counts are its own.
  Child child([](Child&) {
    CHECK_EQ(simcuda_call_count("cuDriverGetVersion"), 0u);
    int x = 0;
    CHECK_CU(cuDriverGetVersion(&x));
    CHECK_EQ(simcuda_call_count("cuDriverGetVersion"), 1u);
  });
  EXPECT_CHILD_PASSED(child);
  EXPECT_EQ(simcuda_call_count("cuDriverGetVersion"), 4u);
  simcuda_reset_call_counts();
  EXPECT_EQ(simcuda_call_count("cuDriverGetVersion"), 0u);
  EXPECT_EQ(simcuda_call_count("cuMemAlloc_v2"), 0u);
}

// ===========================================================================
// Processes sharing one device
// ===========================================================================

using Processes = Sim;

TEST_F(Processes, TwoProcessesSeeOneDevicesMemory) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUdeviceptr mine = 0;
  ASSERT_CU(cuMemAlloc_v2(&mine, 100 * kMiB));
  const uint64_t parent = used(0);  // base + 164 MiB
  ASSERT_EQ(parent, base_[0] + 164 * kMiB);

  Child child([mine, parent](Child& me) {
    // A fresh process: no contexts or allocations inherited, its own slot.
    CUcontext cur = reinterpret_cast<CUcontext>(1);
    CHECK_CU(cuCtxGetCurrent(&cur));
    CHECK(cur == nullptr);
    CHECK_EQ(simcuda_process_used(0, 0), 0u);
    CHECK_EQ(simcuda_live_process_count(), 2);
    CHECK_EQ(simcuda_device_used(0), parent);
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CHECK(cuMemFree_v2(mine) == CUDA_ERROR_INVALID_VALUE);  // the parent's pointer means nothing here
    CUdeviceptr p = 0;
    CHECK_CU(cuMemAlloc_v2(&p, 200 * kMiB));
    CHECK(p != mine);
    size_t free_b = 0, total = 0;
    CHECK_CU(cuMemGetInfo_v2(&free_b, &total));
    CHECK_EQ(free_b, kGiB - parent - 264 * kMiB);  // the parent's memory is gone from this process's view
    // What is left is all it can have.
    CUdeviceptr q = 0;
    CHECK(cuMemAlloc_v2(&q, free_b + 1) == CUDA_ERROR_OUT_OF_MEMORY);
    me.send(1);         // ready
    me.wait_parent();   // then exit without freeing anything
  });
  ASSERT_EQ(child.recv(), std::optional<uint64_t>(1)) << child.report();
  EXPECT_EQ(used(0), parent + 264 * kMiB);
  EXPECT_EQ(simcuda_process_used(0, child.pid()), 264 * kMiB);
  EXPECT_EQ(simcuda_process_used(0, 0), parent);
  EXPECT_EQ(simcuda_live_process_count(), 2);
  size_t free_b = 0, total = 0;
  ASSERT_CU(cuMemGetInfo_v2(&free_b, &total));
  EXPECT_EQ(free_b, kGiB - parent - 264 * kMiB);
  CUdeviceptr q = 0;
  EXPECT_EQ(cuMemAlloc_v2(&q, free_b + 1), CUDA_ERROR_OUT_OF_MEMORY) << "the child's memory counts here too";
  child.release();
  EXPECT_CHILD_PASSED(child);
  // An exited process's memory is dropped.
  EXPECT_EQ(used(0), parent);
  EXPECT_EQ(simcuda_process_used(0, child.pid()), 0u);
  EXPECT_EQ(simcuda_live_process_count(), 1);
  EXPECT_CU(cuMemFree_v2(mine));
}

TEST_F(Processes, KilledProcessMemoryIsDropped) {
  Child child([](Child& me) {
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUdeviceptr p = 0;
    CHECK_CU(cuMemAlloc_v2(&p, 300 * kMiB));
    CHECK_CU(cuMemAllocAsync(&p, kMiB, nullptr));
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h = 0;
    CHECK_CU(cuMemCreate(&h, 4 * kMiB, &prop, 0));
    CUcontext c1 = nullptr;
    CHECK_CU(cuCtxCreate_v2(&c1, 0, 1));
    CHECK_CU(cuMemAlloc_v2(&p, 10 * kMiB));
    CHECK_CU(cuCtxSetCurrent(ctx));
    CUfunction f = get_function("sleep_100us");
    CHECK(f != nullptr);
    CHECK_CU(launch(f));
    CHECK_CU(cuCtxSynchronize());
    me.send(1);
    for (;;) pause();  // until killed
  });
  ASSERT_EQ(child.recv(), std::optional<uint64_t>(1)) << child.report();
  const uint64_t child_bytes = 64 * kMiB + 300 * kMiB + 2 * kMiB + 4 * kMiB;
  EXPECT_EQ(used(0), base_[0] + child_bytes);
  EXPECT_EQ(used(1), base_[1] + 26 * kMiB);
  EXPECT_EQ(simcuda_process_used(0, child.pid()), child_bytes);
  EXPECT_EQ(simcuda_live_process_count(), 2);
  ASSERT_EQ(kill(child.pid(), SIGKILL), 0);
  int st = child.finish();
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << child.report();
  EXPECT_EQ(child.report(), "");
  // The next read after waitpid no longer includes it.
  EXPECT_EQ(used(0), base_[0]);
  EXPECT_EQ(used(1), base_[1]);
  EXPECT_EQ(simcuda_process_used(0, child.pid()), 0u);
  EXPECT_EQ(simcuda_live_process_count(), 1);
  // Its kernel time stays on record.
  EXPECT_EQ(simcuda_busy_ns(0, child.pid()), 100000u);
  EXPECT_EQ(simcuda_launch_count(0, child.pid()), 1u);
  // And its memory is usable again.
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUdeviceptr all = 0;
  ASSERT_CU(cuMemAlloc_v2(&all, kGiB - used(0)));
  EXPECT_EQ(used(0), kGiB);
  EXPECT_CU(cuMemFree_v2(all));
}

// Graph memory is charged to the process's slot like any other: a killed
// process's cached graph memory goes with it.
TEST_F(Processes, KilledProcessGraphMemoryIsDropped) {
  Child child([](Child& me) {
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUgraph g = graph_allocating({{0, 5 * kMiB}});
    CHECK(g != nullptr);
    CUgraphExec e = nullptr;
    CHECK_CU(cuGraphInstantiateWithFlags(&e, g, 0));
    CHECK_CU(cuGraphLaunch(e, nullptr));
    CHECK_CU(cuGraphExecDestroy(e));  // the memory stays reserved
    me.send(1);
    for (;;) pause();  // until killed
  });
  ASSERT_EQ(child.recv(), std::optional<uint64_t>(1)) << child.report();
  const uint64_t child_bytes = 64 * kMiB + 6 * kMiB;
  EXPECT_EQ(used(0), base_[0] + child_bytes);
  EXPECT_EQ(simcuda_process_used(0, child.pid()), child_bytes);
  EXPECT_EQ(graph_mem_attr(0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0u) << "the pool is per process";
  ASSERT_EQ(kill(child.pid(), SIGKILL), 0);
  int st = child.finish();
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << child.report();
  EXPECT_EQ(child.report(), "");
  EXPECT_EQ(used(0), base_[0]);
  EXPECT_EQ(simcuda_process_used(0, child.pid()), 0u);
}

// ===========================================================================
// Kernel timeline
// ===========================================================================

using Timeline = Sim;

// A forked child's body: makes a context, says 1, waits for the parent, then
// launches `count` kernels named `kernel` at once, synchronizes, sends the
// instant it returned and waits for the parent again.
std::function<void(Child&)> kernels_then_sync(const char* kernel, int count) {
  return [kernel, count](Child& me) {
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUfunction f = get_function(kernel);
    CHECK(f != nullptr);
    me.send(1);
    me.wait_parent();
    for (int i = 0; i < count; ++i) CHECK_CU(launch(f));
    CHECK_CU(cuCtxSynchronize());
    me.send(simcuda_now_ns());
    me.wait_parent();
  };
}

TEST_F(Timeline, KernelDurationsComeFromNames) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  struct Case {
    const char* name;
    uint64_t ns;
  } cases[] = {{"sleep_20000us", 20 * kMs},
               {"_Z12sleep_1500usPfi", 1500000},
               {"my_sleep_7us_kernel", 7000},
               {"plain_kernel", 10000},
               {"sleep_us", 10000},
               {"sleep_12ms", 10000}};
  CUmodule m = nullptr;
  static const char image[] = "x";
  ASSERT_CU(cuModuleLoadData(&m, image));
  for (const auto& k : cases) {
    CUfunction f = nullptr, again = nullptr;
    ASSERT_CU(cuModuleGetFunction(&f, m, k.name)) << k.name;
    EXPECT_EQ(simcuda_function_duration_ns(f), k.ns) << k.name;
    ASSERT_CU(cuModuleGetFunction(&again, m, k.name));
    EXPECT_EQ(again, f) << "same name, same handle";
  }
  CUfunction f = nullptr;
  EXPECT_EQ(cuModuleGetFunction(&f, m, "simcuda_missing_kernel"), CUDA_ERROR_NOT_FOUND);
  ASSERT_CU(cuModuleGetFunction(&f, m, "plain_kernel"));
  simcuda_set_function_duration_ns(f, 123456);
  EXPECT_EQ(simcuda_function_duration_ns(f), 123456u);
  EXPECT_CU(cuModuleUnload(m));
  EXPECT_EQ(simcuda_function_duration_ns(f), 0u) << "unloaded with its module";
}

// gputime_load kernels=ptx's spin kernel: its work is its first parameter,
// 100 iterations a microsecond; without parameters it is any kernel (10 us).
TEST_F(Timeline, TheSpinKernelTakesTheTimeOfItsIterations) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("fracgpu_spin");
  ASSERT_NE(f, nullptr);
  const uint64_t busy = simcuda_busy_ns(0, 0);
  unsigned long long iterations = 250000, sink = 0;
  void* args[] = {&iterations, &sink};
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy + 2500 * 1000ull) << "250,000 iterations: 2.5 ms";
  ASSERT_CU(launch(f));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy + 2510 * 1000ull) << "no parameters: 10 us";
}

TEST_F(Timeline, SleepKernelAdvancesBusyTimeAndSynchronizeWaits) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_20000us");
  ASSERT_NE(f, nullptr);
  const uint64_t dev_busy = simcuda_device_busy_ns(0), my_busy = simcuda_busy_ns(0, 0),
                 my_launches = simcuda_launch_count(0, 0);
  const uint64_t t0 = simcuda_now_ns();
  ASSERT_CU(launch(f));
  const uint64_t until = simcuda_device_busy_until_ns(0);
  EXPECT_GE(until, t0 + 20 * kMs);
  EXPECT_EQ(simcuda_launch_count(0, 0), my_launches + 1);
  EXPECT_EQ(cuStreamQuery(nullptr), CUDA_ERROR_NOT_READY) << "20 ms of work just enqueued";
  ASSERT_CU(cuCtxSynchronize());
  const uint64_t t1 = simcuda_now_ns();
  // Device time is recorded as it runs (under the queue model: when placed).
  EXPECT_EQ(simcuda_device_busy_ns(0), dev_busy + 20 * kMs);
  EXPECT_EQ(simcuda_busy_ns(0, 0), my_busy + 20 * kMs);
  EXPECT_EQ(simcuda_busy_ns(0, getpid()), my_busy + 20 * kMs);
  EXPECT_GE(t1, until) << "synchronize returns when the kernel is done";
  EXPECT_GE(t1 - t0, 20 * kMs);
  EXPECT_CU(cuStreamQuery(nullptr));
  EXPECT_LE(simcuda_device_busy_until_ns(0), t1) << "idle now";

  // A set duration replaces the name's.
  simcuda_set_function_duration_ns(f, 5 * kMs);
  ASSERT_CU(launch(f));
  ASSERT_CU(cuStreamSynchronize(nullptr));
  EXPECT_EQ(simcuda_device_busy_ns(0), dev_busy + 25 * kMs);
  simcuda_set_function_duration_ns(f, 20 * kMs);

  // Copies take stream time, not device (kernel) time.
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc_v2(&p, kMiB));
  std::vector<char> host(kMiB);
  ASSERT_CU(cuMemcpyHtoD_v2(p, host.data(), kMiB));
  ASSERT_CU(cuMemcpyDtoH_v2(host.data(), p, kMiB));
  EXPECT_EQ(simcuda_device_busy_ns(0), dev_busy + 25 * kMs);
  EXPECT_EQ(simcuda_launch_count(0, 0), my_launches + 2);
  EXPECT_EQ(cuMemcpyHtoD_v2(p + 512, host.data(), kMiB), CUDA_ERROR_INVALID_VALUE) << "past the allocation";
  EXPECT_CU(cuMemFree_v2(p));

  // Events on the timeline.
  CUevent a = nullptr, b = nullptr;
  ASSERT_CU(cuEventCreate(&a, 0));
  ASSERT_CU(cuEventCreate(&b, 0));
  ASSERT_CU(cuEventRecord(a, nullptr));
  ASSERT_CU(launch(get_function("sleep_3000us")));
  ASSERT_CU(cuEventRecord(b, nullptr));
  ASSERT_CU(cuEventSynchronize(b));
  float ms = 0;
  ASSERT_CU(cuEventElapsedTime_v2(&ms, a, b));
  EXPECT_GE(ms, 2.999f);
  EXPECT_CU(cuEventDestroy_v2(a));
  EXPECT_CU(cuEventDestroy_v2(b));
}

TEST_F(Timeline, StreamsOfOneProcessShareTheDevice) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_10000us");
  ASSERT_NE(f, nullptr);
  CUstream s1 = nullptr, s2 = nullptr;
  ASSERT_CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  const uint64_t t0 = simcuda_now_ns();
  ASSERT_CU(launch(f, s1));
  ASSERT_CU(launch(f, s2));
  // s2's kernel starts after s1's: one kernel at a time on the device.
  ASSERT_CU(cuStreamSynchronize(s2));
  EXPECT_GE(simcuda_now_ns() - t0, 20 * kMs);
  EXPECT_CU(cuStreamQuery(s1)) << "done before s2's";
  EXPECT_CU(cuStreamDestroy_v2(s1));
  EXPECT_CU(cuStreamDestroy_v2(s2));

  // A graph is one interval: the sum of its kernels.
  CUgraph g = nullptr;
  ASSERT_CU(cuGraphCreate(&g, 0));
  CUgraphNode n1 = nullptr, n2 = nullptr;
  CUDA_KERNEL_NODE_PARAMS p{};
  p.func = get_function("sleep_1000us");
  p.gridDimX = p.gridDimY = p.gridDimZ = 1;
  p.blockDimX = p.blockDimY = p.blockDimZ = 1;
  ASSERT_CU(cuGraphAddKernelNode_v2(&n1, g, nullptr, 0, &p));
  p.func = get_function("sleep_2000us");
  ASSERT_CU(cuGraphAddKernelNode_v2(&n2, g, &n1, 1, &p));
  CUgraphExec exec = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&exec, g, 0));
  const uint64_t busy = simcuda_device_busy_ns(0), launches = simcuda_launch_count(0, 0);
  ASSERT_CU(cuGraphLaunch(exec, nullptr));
  EXPECT_EQ(simcuda_launch_count(0, 0), launches + 2);
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(simcuda_device_busy_ns(0), busy + 3 * kMs);
  EXPECT_CU(cuGraphExecDestroy(exec));
  EXPECT_CU(cuGraphDestroy(g));
}

TEST_F(Timeline, LegacyLaunchesRunLikeLaunchKernel) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_2000us");
  ASSERT_NE(f, nullptr);
  int not_a_function = 0;
  CUfunction bad = reinterpret_cast<CUfunction>(&not_a_function);
  float value = 1.5f;
  // The old API's setters are accepted (and ignored) for a known function.
  EXPECT_CU(cuFuncSetBlockShape(f, 32, 2, 1));
  EXPECT_CU(cuFuncSetSharedSize(f, 1024));
  EXPECT_CU(cuParamSetSize(f, 8));
  EXPECT_CU(cuParamSeti(f, 0, 7));
  EXPECT_CU(cuParamSetf(f, 4, value));
  EXPECT_CU(cuParamSetv(f, 0, &value, sizeof value));
  for (CUfunction h : {bad, static_cast<CUfunction>(nullptr)}) {
    EXPECT_EQ(cuFuncSetBlockShape(h, 32, 1, 1), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(cuFuncSetSharedSize(h, 0), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(cuParamSetSize(h, 8), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(cuParamSeti(h, 0, 7), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(cuParamSetf(h, 4, value), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(cuParamSetv(h, 0, &value, sizeof value), CUDA_ERROR_INVALID_HANDLE);
  }

  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const uint64_t dev_busy = simcuda_device_busy_ns(0), my_busy = simcuda_busy_ns(0, 0),
                 launches = simcuda_launch_count(0, 0);
  // Refused launches take no time and are not counted.
  EXPECT_EQ(cuLaunch(bad), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(cuLaunchGrid(nullptr, 1, 1), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(cuLaunchGridAsync(bad, 1, 1, s), CUDA_ERROR_INVALID_HANDLE);
  for (auto [w, h] : {std::pair{0, 1}, {1, 0}, {-1, 1}, {1, -4}}) {
    EXPECT_EQ(cuLaunchGrid(f, w, h), CUDA_ERROR_INVALID_VALUE) << w << "x" << h;
    EXPECT_EQ(cuLaunchGridAsync(f, w, h, s), CUDA_ERROR_INVALID_VALUE) << w << "x" << h;
  }
  int not_a_stream = 0;
  EXPECT_EQ(cuLaunchGridAsync(f, 1, 1, reinterpret_cast<CUstream>(&not_a_stream)), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(simcuda_device_busy_ns(0), dev_busy);
  EXPECT_EQ(simcuda_launch_count(0, 0), launches);

  const uint64_t t0 = simcuda_now_ns();
  ASSERT_CU(cuLaunchGridAsync(f, 1, 1, s));
  ASSERT_CU(cuLaunch(f));
  ASSERT_CU(cuLaunchGrid(f, 4, 2));
  ASSERT_CU(cuLaunchGridAsync(f, 3, 1, nullptr));
  // Four kernels of the function's duration, whatever the grid.
  EXPECT_EQ(simcuda_launch_count(0, 0), launches + 4);
  EXPECT_GE(simcuda_device_busy_until_ns(0), t0 + 8 * kMs);
  EXPECT_EQ(cuStreamQuery(nullptr), CUDA_ERROR_NOT_READY) << "they ran on the legacy stream";
  // The legacy stream waits for the process's other streams too: syncing it
  // drains the kernel launched on s.
  ASSERT_CU(cuStreamSynchronize(nullptr));
  EXPECT_EQ(simcuda_device_busy_ns(0), dev_busy + 8 * kMs);
  EXPECT_EQ(simcuda_busy_ns(0, 0), my_busy + 8 * kMs);
  EXPECT_GE(simcuda_now_ns() - t0, 8 * kMs);
  EXPECT_CU(cuStreamQuery(s));
  EXPECT_LE(simcuda_device_busy_until_ns(0), simcuda_now_ns());
  EXPECT_CU(cuStreamDestroy_v2(s));
}

TEST_F(Timeline, NoStreamCapturesUnlessAsked) {
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  EXPECT_EQ(cuStreamIsCapturing(nullptr, &st), CUDA_ERROR_INVALID_CONTEXT) << "the null stream needs a context";
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  for (CUstream h : {static_cast<CUstream>(nullptr), CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, s}) {
    SCOPED_TRACE(reinterpret_cast<uintptr_t>(h));
    st = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    EXPECT_CU(cuStreamIsCapturing(h, &st));
    EXPECT_EQ(st, CU_STREAM_CAPTURE_STATUS_NONE);
    st = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    EXPECT_CU(cuStreamIsCapturing_ptsz(h, &st));
    EXPECT_EQ(st, CU_STREAM_CAPTURE_STATUS_NONE);
    EXPECT_EQ(cuStreamIsCapturing(h, nullptr), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cuStreamIsCapturing_ptsz(h, nullptr), CUDA_ERROR_INVALID_VALUE);
  }
  int not_a_stream = 0;
  EXPECT_EQ(cuStreamIsCapturing(reinterpret_cast<CUstream>(&not_a_stream), &st), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(cuStreamIsCapturing_ptsz(reinterpret_cast<CUstream>(&not_a_stream), &st), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_CU(cuStreamDestroy_v2(s));
  EXPECT_EQ(cuStreamIsCapturing(s, &st), CUDA_ERROR_INVALID_HANDLE) << "destroyed";
}

// Between cuStreamBeginCapture and cuStreamEndCapture a user stream records
// its kernel and graph launches into a graph: nothing runs until the graph
// is launched.
TEST_F(Timeline, CaptureRecordsLaunchesIntoAGraph) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_20000us");
  ASSERT_NE(f, nullptr);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  EXPECT_EQ(cuStreamBeginCapture_v2(nullptr, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(cuStreamBeginCapture_v2(s, static_cast<CUstreamCaptureMode>(7)), CUDA_ERROR_INVALID_VALUE);
  CUgraph graph = nullptr;
  EXPECT_EQ(cuStreamEndCapture(s, &graph), CUDA_ERROR_ILLEGAL_STATE) << "not capturing";
  ASSERT_CU(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  EXPECT_EQ(cuStreamBeginCapture(s), CUDA_ERROR_ILLEGAL_STATE) << "already capturing";
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  EXPECT_CU(cuStreamIsCapturing(s, &st));
  EXPECT_EQ(st, CU_STREAM_CAPTURE_STATUS_ACTIVE);
  const uint64_t busy = simcuda_busy_ns(0, 0), launches = simcuda_launch_count(0, 0);
  const uint64_t t0 = simcuda_now_ns();
  EXPECT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr));
  EXPECT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr));
  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_LT(simcuda_now_ns() - t0, 20 * kMs) << "captured kernels do not run";
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy);
  EXPECT_EQ(simcuda_launch_count(0, 0), launches);
  ASSERT_CU(cuStreamEndCapture(s, &graph));
  ASSERT_NE(graph, nullptr);
  EXPECT_CU(cuStreamIsCapturing(s, &st));
  EXPECT_EQ(st, CU_STREAM_CAPTURE_STATUS_NONE);
  CUgraphExec exec = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&exec, graph, 0));
  EXPECT_CU(cuGraphLaunch(exec, s));
  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy + 40 * kMs) << "the graph runs its two kernels";
  EXPECT_EQ(simcuda_launch_count(0, 0), launches + 2);
  // A graph launched into a capturing stream is captured too.
  ASSERT_CU(cuStreamBeginCapture(s));
  EXPECT_CU(cuGraphLaunch(exec, s));
  CUgraph outer = nullptr;
  ASSERT_CU(cuStreamEndCapture(s, &outer));
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy + 40 * kMs);
  CUgraphExec outer_exec = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&outer_exec, outer, 0));
  EXPECT_CU(cuGraphLaunch(outer_exec, s));
  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_EQ(simcuda_busy_ns(0, 0), busy + 80 * kMs);
  EXPECT_CU(cuGraphExecDestroy(outer_exec));
  EXPECT_CU(cuGraphExecDestroy(exec));
  EXPECT_CU(cuGraphDestroy(outer));
  EXPECT_CU(cuGraphDestroy(graph));
  EXPECT_CU(cuStreamDestroy_v2(s));
}

// The kernel log says who ran when: under the time-slice model, stretches of
// residency as they ran; under the queue model, one record per launch where
// it was placed (InChild.QueueModelLogsEveryLaunchInPlace).
TEST_F(Timeline, KernelLogRecordsWhoRanWhen) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_1000us");
  ASSERT_NE(f, nullptr);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  const uint64_t first = simcuda_kernel_log_next(0);
  const uint64_t t0 = simcuda_now_ns();
  for (int i = 0; i < 3; ++i) EXPECT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr));
  EXPECT_CU(cuStreamSynchronize(s));
  const uint64_t t1 = simcuda_now_ns();
  simcuda_kernel_record log[64] = {};
  const size_t n = simcuda_kernel_log(0, first, log, 64);
  ASSERT_GE(n, 1u);
  uint64_t ran = 0;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(log[i].index, first + i);
    EXPECT_EQ(log[i].pid, getpid());
    EXPECT_GE(log[i].start_ns, t0);
    EXPECT_LE(log[i].end_ns, t1);
    if (i > 0) {
      EXPECT_GE(log[i].start_ns, log[i - 1].end_ns) << "one process at a time, in order";
    }
    ran += log[i].end_ns - log[i].start_ns;
  }
  EXPECT_EQ(ran, 3 * kMs) << "three 1 ms kernels";
  EXPECT_EQ(simcuda_kernel_log(0, first + n, log, 8), 0u);
  EXPECT_EQ(simcuda_kernel_log(99, 0, log, 8), 0u) << "bad ordinal";
  EXPECT_CU(cuStreamDestroy_v2(s));
}

TEST(Config, QueueModelLogsEveryLaunchInPlace) {
  SelfResult r = run_self("QueueLog", {{"SIMCUDA_SCHED", "queue"}, {"SIMCUDA_STATE", g_state + ".queue"}});
  unlink((g_state + ".queue").c_str());
  EXPECT_TRUE(r.passed()) << r.output;
}

TEST(InChild, QueueLog) {
  CHILD_ONLY("QueueLog");
  ASSERT_CU(cuInit(0));
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_1000us");
  ASSERT_NE(f, nullptr);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  const uint64_t first = simcuda_kernel_log_next(0);
  for (int i = 0; i < 3; ++i) EXPECT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr));
  EXPECT_EQ(simcuda_kernel_log_next(0), first + 3) << "placed when launched, before it runs";
  simcuda_kernel_record log[8] = {};
  ASSERT_EQ(simcuda_kernel_log(0, first, log, 8), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(log[i].index, first + static_cast<uint64_t>(i));
    EXPECT_EQ(log[i].pid, getpid());
    EXPECT_EQ(log[i].end_ns - log[i].start_ns, 1000000u);
    if (i > 0) {
      EXPECT_GE(log[i].start_ns, log[i - 1].end_ns) << "one kernel at a time";
    }
  }
  EXPECT_EQ(simcuda_kernel_log(0, first + 1, log, 1), 1u);
  EXPECT_EQ(log[0].index, first + 1);
  EXPECT_EQ(simcuda_kernel_log(0, first + 3, log, 8), 0u);
  EXPECT_CU(cuStreamSynchronize(s));
  EXPECT_CU(cuStreamDestroy_v2(s));
}

TEST_F(Timeline, CaptureModeIsExchangedPerThread) {
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  ASSERT_CU(cuThreadExchangeStreamCaptureMode(&mode));
  EXPECT_EQ(mode, CU_STREAM_CAPTURE_MODE_GLOBAL) << "the default";
  EXPECT_EQ(cuThreadExchangeStreamCaptureMode(nullptr), CUDA_ERROR_INVALID_VALUE);
  mode = static_cast<CUstreamCaptureMode>(7);
  EXPECT_EQ(cuThreadExchangeStreamCaptureMode(&mode), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(mode, static_cast<CUstreamCaptureMode>(7)) << "a refused exchange changes nothing";

  // Another thread starts from the default and its changes stay its own.
  CUresult r1 = CUDA_ERROR_UNKNOWN, r2 = CUDA_ERROR_UNKNOWN;
  CUstreamCaptureMode first = CU_STREAM_CAPTURE_MODE_RELAXED, second = CU_STREAM_CAPTURE_MODE_RELAXED;
  std::thread([&] {
    first = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    r1 = cuThreadExchangeStreamCaptureMode(&first);
    second = CU_STREAM_CAPTURE_MODE_GLOBAL;
    r2 = cuThreadExchangeStreamCaptureMode(&second);
  }).join();
  EXPECT_CU(r1);
  EXPECT_CU(r2);
  EXPECT_EQ(first, CU_STREAM_CAPTURE_MODE_GLOBAL);
  EXPECT_EQ(second, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);

  // A forked child is a new process: its thread starts from the default.
  Child child([](Child&) {
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    CHECK_CU(cuThreadExchangeStreamCaptureMode(&m));
    CHECK_EQ(static_cast<int>(m), static_cast<int>(CU_STREAM_CAPTURE_MODE_GLOBAL));
  });
  EXPECT_CHILD_PASSED(child);

  mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  ASSERT_CU(cuThreadExchangeStreamCaptureMode(&mode));
  EXPECT_EQ(mode, CU_STREAM_CAPTURE_MODE_RELAXED) << "what this thread stored, untouched by the others";
}

TEST_F(Timeline, AnotherThreadDrainsTheProcessByPushingItsContext) {
  ScopedCtx c(0);
  ASSERT_CU(c.result);
  CUfunction f = get_function("sleep_20000us");
  ASSERT_NE(f, nullptr);
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  // This thread queues 80 ms on its legacy, per-thread and created streams.
  ASSERT_CU(launch(f));
  ASSERT_CU(cuLaunchKernel_ptsz(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(launch(f, s));
  ASSERT_CU(cuLaunch(f));
  const uint64_t until = simcuda_device_busy_until_ns(0);

  struct Seen {
    CUcontext before = reinterpret_cast<CUcontext>(1), popped = nullptr, after = reinterpret_cast<CUcontext>(1);
    CUresult unbound = CUDA_SUCCESS, push = CUDA_ERROR_UNKNOWN, sync = CUDA_ERROR_UNKNOWN,
             pop = CUDA_ERROR_UNKNOWN;
    uint64_t started = 0, returned = 0;
  } seen;
  std::thread([&] {
    cuCtxGetCurrent(&seen.before);
    seen.unbound = cuCtxSynchronize();
    seen.push = cuCtxPushCurrent_v2(c.ctx);
    seen.started = simcuda_now_ns();
    seen.sync = cuCtxSynchronize();
    seen.returned = simcuda_now_ns();
    seen.pop = cuCtxPopCurrent_v2(&seen.popped);
    cuCtxGetCurrent(&seen.after);
  }).join();
  EXPECT_EQ(seen.before, nullptr) << "contexts are current per thread";
  EXPECT_EQ(seen.unbound, CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_CU(seen.push);
  EXPECT_CU(seen.sync);
  EXPECT_CU(seen.pop);
  EXPECT_EQ(seen.popped, c.ctx);
  EXPECT_EQ(seen.after, nullptr);
  EXPECT_LT(seen.started, until) << "the work was still queued when it synchronized";
  EXPECT_GE(seen.returned, until) << "synchronize returned before the launching thread's kernels finished";
  EXPECT_LE(simcuda_device_busy_until_ns(0), seen.returned);
  // Every stream of the launching thread is drained.
  EXPECT_CU(cuStreamQuery(nullptr));
  EXPECT_CU(cuStreamQuery_ptsz(nullptr));
  EXPECT_CU(cuStreamQuery(s));
  EXPECT_CU(cuStreamDestroy_v2(s));
}

TEST_F(Timeline, KernelsOfTwoProcessesSerializeOnTheDevice) {
  constexpr int kKernels = 5;
  constexpr uint64_t kEach = 20 * kMs;
  auto body = kernels_then_sync("sleep_20000us", kKernels);
  Child a(body), b(body);
  ASSERT_EQ(a.recv(), std::optional<uint64_t>(1)) << a.report();
  ASSERT_EQ(b.recv(), std::optional<uint64_t>(1)) << b.report();
  const uint64_t busy = simcuda_device_busy_ns(0);
  const uint64_t t0 = simcuda_now_ns();
  a.release();
  b.release();
  std::optional<uint64_t> ea = a.recv(), eb = b.recv();
  ASSERT_TRUE(ea && eb) << a.report() << b.report();
  // 10 kernels of 20 ms, one at a time: the last process is done >= 200 ms after the start.
  EXPECT_GE(std::max(*ea, *eb) - t0, 2 * kKernels * kEach);
  EXPECT_GE(simcuda_device_busy_until_ns(0) - t0, 2 * kKernels * kEach);
  EXPECT_EQ(simcuda_device_busy_ns(0), busy + 2 * kKernels * kEach);
  EXPECT_EQ(simcuda_busy_ns(0, a.pid()), kKernels * kEach);
  EXPECT_EQ(simcuda_busy_ns(0, b.pid()), kKernels * kEach);
  a.release();
  b.release();
  EXPECT_CHILD_PASSED(a);
  EXPECT_CHILD_PASSED(b);
  // Exited processes keep their busy-time records.
  EXPECT_EQ(simcuda_busy_ns(0, a.pid()), kKernels * kEach);
  EXPECT_EQ(simcuda_launch_count(0, b.pid()), static_cast<uint64_t>(kKernels));
}

// ===========================================================================
// The time-slice model (the default): one process's context on the device at
// a time, slices of SIMCUDA_TIMESLICE_US (1024 us), a switch costs
// SIMCUDA_SWITCH_US (40 us) of idle device.
// ===========================================================================

constexpr uint64_t kSlice = 1024000, kSwitch = 40000;

// The kernel log since `first`, with back-to-back records of one process
// joined: each entry is one stretch of residency.
std::vector<simcuda_kernel_record> residency_since(uint64_t first) {
  std::vector<simcuda_kernel_record> out;
  std::vector<simcuda_kernel_record> buf(16384);
  const size_t n = simcuda_kernel_log(0, first, buf.data(), buf.size());
  for (size_t i = 0; i < n; ++i) {
    if (!out.empty() && out.back().pid == buf[i].pid && out.back().end_ns == buf[i].start_ns) {
      out.back().end_ns = buf[i].end_ns;
    } else {
      out.push_back(buf[i]);
    }
  }
  return out;
}

// Two children made by kernels_then_sync (or sending as it does), released
// at once: the residency stretches from then until both have finished
// (empty, with a failure, if either did not get there), and what `a` sent
// when it finished.
std::vector<simcuda_kernel_record> residency_of_pair(Child& a, Child& b, uint64_t* a_said = nullptr) {
  if (a.recv() != std::optional<uint64_t>(1) || b.recv() != std::optional<uint64_t>(1)) {
    ADD_FAILURE() << a.report() << b.report();
    return {};
  }
  const uint64_t first = simcuda_kernel_log_next(0);
  a.release();
  b.release();
  const std::optional<uint64_t> said = a.recv();
  if (!said || !b.recv()) {
    ADD_FAILURE() << a.report() << b.report();
    return {};
  }
  if (a_said != nullptr) *a_said = *said;
  return residency_since(first);
}

TEST_F(Timeline, TwoSaturatingProcessesAlternateSlices) {
  constexpr int kKernels = 4;  // of 20 ms each, launched at once
  auto body = kernels_then_sync("sleep_20000us", kKernels);
  Child a(body), b(body);
  ASSERT_EQ(a.recv(), std::optional<uint64_t>(1)) << a.report();
  ASSERT_EQ(b.recv(), std::optional<uint64_t>(1)) << b.report();
  const uint64_t first = simcuda_kernel_log_next(0);
  const uint64_t t0 = simcuda_now_ns();
  a.release();
  b.release();
  std::optional<uint64_t> ea = a.recv(), eb = b.recv();
  ASSERT_TRUE(ea && eb) << a.report() << b.report();
  const auto runs = residency_since(first);
  // Both were busy until near the end: they took turns all along, so both
  // finish late (a first-come queue would finish the first one at 80 ms).
  EXPECT_GE(std::min(*ea, *eb) - t0, 2 * kKernels * 20 * kMs * 9 / 10);
  uint64_t ran_a = 0, ran_b = 0;
  size_t turns = 0, full_slices = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const uint64_t len = runs[i].end_ns - runs[i].start_ns;
    (runs[i].pid == a.pid() ? ran_a : ran_b) += len;
    if (i == 0) continue;
    ASSERT_NE(runs[i].pid, runs[i - 1].pid) << "a stretch ends only to hand over";
    ++turns;
    EXPECT_EQ(runs[i].start_ns - runs[i - 1].end_ns, kSwitch) << "each switch costs the switch time";
    if (i + 2 < runs.size()) {
      // While the other has work, a stretch is one slice (the last two end
      // when their process's work runs out).
      EXPECT_EQ(len, kSlice) << "stretch " << i;
      full_slices += len == kSlice;
    }
  }
  EXPECT_EQ(ran_a, kKernels * 20 * kMs) << "cut kernels resume: all the work runs";
  EXPECT_EQ(ran_b, kKernels * 20 * kMs);
  EXPECT_GE(turns, 2 * kKernels * 20 * kMs / kSlice - 4) << "about one turn per slice";
  EXPECT_GT(full_slices, 0u);
  a.release();
  b.release();
  EXPECT_CHILD_PASSED(a);
  EXPECT_CHILD_PASSED(b);
}

// A process whose work runs out hands the device over at once (after the
// switch), not at its slice's end; one that arrives waits at most the rest of
// the resident's slice.
TEST_F(Timeline, AProcessThatDrainsHandsOverAtOnce) {
  constexpr int kShort = 20;  // 300 us kernels, each synchronized
  auto saturating = [](Child& me) {
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUfunction f = get_function("sleep_50000us");
    CHECK(f != nullptr);
    me.send(1);
    me.wait_parent();
    CHECK_CU(launch(f));
    CHECK_CU(cuCtxSynchronize());
    me.send(2);
    me.wait_parent();
  };
  auto light = [](Child& me) {
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUfunction f = get_function("sleep_300us");
    CHECK(f != nullptr);
    me.send(1);
    me.wait_parent();
    uint64_t worst = 0;
    for (int i = 0; i < kShort; ++i) {
      const uint64_t t = simcuda_now_ns();
      CHECK_CU(launch(f));
      CHECK_CU(cuCtxSynchronize());
      worst = std::max(worst, simcuda_now_ns() - t);
    }
    me.send(worst);
    me.wait_parent();
  };
  Child heavy(saturating), lite(light);
  ASSERT_EQ(heavy.recv(), std::optional<uint64_t>(1)) << heavy.report();
  ASSERT_EQ(lite.recv(), std::optional<uint64_t>(1)) << lite.report();
  const uint64_t first = simcuda_kernel_log_next(0);
  heavy.release();
  usleep(2000);  // the heavy one is resident
  lite.release();
  const std::optional<uint64_t> worst = lite.recv();
  ASSERT_TRUE(worst) << lite.report();
  // At most the rest of a slice, a switch, its kernel and a switch back,
  // plus the host's wake-ups (slack for a loaded machine): far below the
  // 50 ms kernel a first-come queue would make it wait behind.
  EXPECT_LT(*worst, kSlice + 300000 + 2 * kSwitch + 10 * kMs);
  ASSERT_EQ(heavy.recv(), std::optional<uint64_t>(2)) << heavy.report();
  const auto runs = residency_since(first);
  size_t light_runs = 0;
  for (size_t i = 1; i + 1 < runs.size(); ++i) {
    if (runs[i].pid != lite.pid()) continue;
    ++light_runs;
    EXPECT_EQ(runs[i].end_ns - runs[i].start_ns, 300000u) << "its kernel runs whole: nobody else asks for a slice";
    EXPECT_EQ(runs[i + 1].start_ns - runs[i].end_ns, kSwitch) << "handed back as soon as its work ran out";
  }
  EXPECT_EQ(light_runs, static_cast<size_t>(kShort));
  heavy.release();
  lite.release();
  EXPECT_CHILD_PASSED(heavy);
  EXPECT_CHILD_PASSED(lite);
}

// A process may set its own contexts' slice (the driver's channel-group
// control needs no privilege): it then keeps the device that much longer
// at each of its turns, and the other gets the driver's turn as before.
TEST_F(Timeline, AProcessThatSetsItsOwnSliceKeepsTheDeviceLongerAtEachTurn) {
  constexpr int kKernels = 3;  // of 20 ms each, launched at once
  constexpr uint64_t kOwnSlice = 3 * kSlice;
  auto plain = kernels_then_sync("sleep_20000us", kKernels);
  auto own_slice = [plain](Child& me) {
    setenv("SIMCUDA_OWN_TIMESLICE_US", std::to_string(kOwnSlice / 1000).c_str(), 1);
    plain(me);
  };
  Child a(own_slice), b(plain);
  const auto runs = residency_of_pair(a, b);
  ASSERT_GE(runs.size(), 10u);
  // While both have work (all but the last two stretches), each turn is its
  // process's slice: three of the device's for a, one for b.
  uint64_t ran_a = 0, ran_b = 0;
  for (size_t i = 1; i + 2 < runs.size(); ++i) {
    const uint64_t len = runs[i].end_ns - runs[i].start_ns;
    EXPECT_EQ(len, runs[i].pid == a.pid() ? kOwnSlice : kSlice) << "stretch " << i;
    (runs[i].pid == a.pid() ? ran_a : ran_b) += len;
  }
  // Turns alternate, so their counts differ by one at most: a had three
  // quarters of the device while both asked.
  EXPECT_LE(ran_a, 3 * ran_b + kOwnSlice);
  EXPECT_GE(ran_a + kOwnSlice, 3 * ran_b);
  a.release();
  b.release();
  EXPECT_CHILD_PASSED(a);
  EXPECT_CHILD_PASSED(b);
}

// The control may come at any time: a process that sets its slice while
// its work runs keeps the driver's turns until then and its own after (a
// tenant that looks fair, then lengthens its turns).
TEST_F(Timeline, AProcessMaySetItsOwnSliceWhileItsWorkRuns) {
  constexpr int kKernels = 3;  // of 20 ms each, launched at once
  constexpr uint64_t kOwnSlice = 3 * kSlice;
  auto setter = [](Child& me) {
    CUcontext ctx = nullptr;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 0));
    CUfunction f = get_function("sleep_20000us");
    CHECK(f != nullptr);
    me.send(1);
    me.wait_parent();
    for (int i = 0; i < kKernels; ++i) CHECK_CU(launch(f));
    const uint64_t launched = simcuda_now_ns();
    while (simcuda_now_ns() < launched + 10 * kMs) usleep(500);
    const uint64_t set_at = simcuda_now_ns();
    CHECK(simcuda_set_own_timeslice_us(kOwnSlice / 1000) == 0);
    CHECK(simcuda_set_own_timeslice_us(1000001) == -1);
    CHECK_CU(cuCtxSynchronize());
    me.send(set_at);
    me.wait_parent();
  };
  Child a(setter), b(kernels_then_sync("sleep_20000us", kKernels));
  uint64_t set_at = 0;
  const auto runs = residency_of_pair(a, b, &set_at);
  ASSERT_GE(runs.size(), 10u);
  // While both have work (all but the last two stretches): b's turns are the
  // driver's; a's too until the call, and its own once it began after it.
  size_t before = 0, after = 0;
  for (size_t i = 1; i + 2 < runs.size(); ++i) {
    const uint64_t len = runs[i].end_ns - runs[i].start_ns;
    if (runs[i].pid != a.pid()) {
      EXPECT_EQ(len, kSlice) << "stretch " << i;
    } else if (runs[i].end_ns <= set_at) {
      EXPECT_EQ(len, kSlice) << "stretch " << i << ", before the call";
      ++before;
    } else if (runs[i].start_ns >= set_at) {
      EXPECT_EQ(len, kOwnSlice) << "stretch " << i << ", after the call";
      ++after;
    }
  }
  EXPECT_GE(before, 3u);
  EXPECT_GE(after, 3u);
  a.release();
  b.release();
  EXPECT_CHILD_PASSED(a);
  EXPECT_CHILD_PASSED(b);
}

TEST(Config, TimeSliceKnobsAreTakenFromTheEnvironment) {
  SelfResult r = run_self("Knobs", {{"SIMCUDA_TIMESLICE_US", "200"}, {"SIMCUDA_SWITCH_US", "0"},
                                    {"SIMCUDA_STATE", g_state + ".knobs"}});
  unlink((g_state + ".knobs").c_str());
  EXPECT_TRUE(r.passed()) << r.output;
}

TEST(InChild, Knobs) {
  CHILD_ONLY("Knobs");
  ASSERT_CU(cuInit(0));
  auto body = kernels_then_sync("sleep_5000us", 1);
  Child a(body), b(body);
  const auto runs = residency_of_pair(a, b);
  ASSERT_GE(runs.size(), 10u);
  for (size_t i = 1; i + 1 < runs.size(); ++i) {
    EXPECT_EQ(runs[i].end_ns - runs[i].start_ns, 200000u);
    EXPECT_EQ(runs[i].start_ns, runs[i - 1].end_ns) << "no switch cost";
  }
  a.release();
  b.release();
  EXPECT_CHILD_PASSED(a);
  EXPECT_CHILD_PASSED(b);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (const char* child = std::getenv("SIMCUDA_TEST_CHILD")) {
    // A re-executed child (run_self): its environment is already what the
    // scenario needs; run that one test.
    GTEST_FLAG_SET(filter, std::string("InChild.") + child);
    int rc = RUN_ALL_TESTS();
    if (rc == 0 && ::testing::UnitTest::GetInstance()->successful_test_count() != 1) {
      std::fprintf(stderr, "simcuda_test: no scenario InChild.%s\n", child);
      return 3;
    }
    return rc;
  }
  // Before any sim call: the devices, and a state file of this run's own.
  setenv("SIMCUDA_DEVICES", kSpec, 1);
  const char* prefix = std::getenv("SIMCUDA_STATE");
  std::string base = prefix != nullptr && *prefix != 0 ? prefix : "/tmp/simcuda_test.state";
  g_state = base + "." + std::to_string(getpid());
  unlink(g_state.c_str());
  setenv("SIMCUDA_STATE", g_state.c_str(), 1);
  if (GTEST_FLAG_GET(filter) == "*") GTEST_FLAG_SET(filter, "-InChild.*");
  int rc = RUN_ALL_TESTS();
  unlink(g_state.c_str());
  return rc;
}

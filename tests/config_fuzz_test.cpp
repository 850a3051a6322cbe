// The config loader against hostile input, in-process and through
// `fracgpud --check`:
//  - files that are not plain files of a sane size: a FIFO, /dev/zero, a
//    directory, a symlink to a FIFO, a 10 MB file, a file the reader may not
//    read, a read error, a /proc file larger than its reported size;
//  - a few hundred seeded mutations of the example configs (byte flips,
//    truncations, duplicated, removed and swapped lines, huge numbers, bad
//    UTF-8, deep nesting, control characters, long lines).
// Every case must finish within a time bound and never crash, and every
// error must name the file and a line of it, or (refused as a whole) the
// file and the reason. The mutations are deterministic (fixed seed), so a
// failure names a case that reproduces.
//
// Built twice (tests/controller_tests.cmake): linked with the controller
// library, and with the config sources compiled under AddressSanitizer and
// UBSan (config_fuzz_test_asan), where only the in-process cases run.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "config/config.h"
#include "config/config_file.h"
#include "controller_test_util.h"

using namespace fracgpu::controller;
using namespace fracgpu::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
const std::string kUuid0 = "GPU-5a1c0de0-0000-4000-8000-00000000f000";
const std::string kUuid1 = "GPU-5a1c0de0-0000-4000-8000-00000000f001";

// The node every case is checked against: in-process, and simcuda's devices
// for fracgpud --check.
std::vector<DiscoveredGpu> node() { return {{0, kUuid0, "Sim A", 16 * kGiB}, {1, kUuid1, "Sim B", 16 * kGiB}}; }
const std::string kSimDevices = "uuid=" + kUuid0 + ",name=Sim A,mem=16GiB;uuid=" + kUuid1 + ",name=Sim B,mem=16GiB";

// A refusal of the file as a whole: load_config's message for it.
constexpr std::string_view kFileRefusal = "cannot read the config file: ";

// ---- Running something that may hang or crash ----

struct Outcome {
  bool finished = false;  // exited within the bound (else killed)
  int exit_code = -1;     // when it exited normally
  int signal = 0;         // when a signal ended it
  std::string output;     // what it wrote to the pipe (or stdout+stderr)
  std::chrono::milliseconds took{0};
};

// Reads `fd` until EOF or `deadline`; false on timeout.
bool read_until(int fd, std::chrono::steady_clock::time_point deadline, std::string* out) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    struct pollfd p {fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    char buf[4096];
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true;
    out->append(buf, static_cast<size_t>(n));
  }
}

// Waits for `pid` after its output ended (or the bound passed: then kills it).
Outcome reap(pid_t pid, bool in_time, std::string output, std::chrono::steady_clock::time_point start) {
  Outcome o;
  o.output = std::move(output);
  if (!in_time) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  o.took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  o.finished = in_time;
  if (WIFEXITED(status)) o.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) o.signal = WTERMSIG(status);
  return o;
}

// Runs `fn` in a child process (as `uid` when not -1), bounded by `timeout`:
// a loader that blocks on a FIFO must fail the test, not hang it.
template <typename Fn>
Outcome run_bounded(Fn fn, std::chrono::milliseconds timeout, int uid = -1) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return {};
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    if (uid >= 0 && (setgid(static_cast<gid_t>(uid)) != 0 || setuid(static_cast<uid_t>(uid)) != 0)) _exit(120);
    const std::string out = fn();
    if (write(pipe_fds[1], out.data(), out.size()) != static_cast<ssize_t>(out.size())) _exit(121);
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string out;
  const bool in_time = read_until(pipe_fds[0], start + timeout, &out);
  close(pipe_fds[0]);
  return reap(pid, in_time, std::move(out), start);
}

// The errors of load_config(path), one per line, from a bounded child.
Outcome load_bounded(const std::string& path, int uid = -1) {
  return run_bounded(
      [&] {
        std::string text;
        for (const ConfigError& e : load_config(path, node()).errors) text += e.to_string() + "\n";
        return text;
      },
      5s, uid);
}

#ifdef FRACGPUD_PATH
// fracgpud --check -c <path> on the simulated GPUs, bounded; stdout and stderr.
Outcome check_bounded(const std::string& path, int uid = -1) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return {};
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(pipe_fds[1], 1);
    dup2(pipe_fds[1], 2);
    if (uid >= 0 && (setgid(static_cast<gid_t>(uid)) != 0 || setuid(static_cast<uid_t>(uid)) != 0)) _exit(120);
    setenv("LD_LIBRARY_PATH", SIMCUDA_DIR, 1);
    setenv("SIMCUDA_DEVICES", kSimDevices.c_str(), 1);
    unsetenv("SIMCUDA_STATE");
    execl(FRACGPUD_PATH, FRACGPUD_PATH, "--check", "--config", path.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(pipe_fds[1]);
  std::string out;
  const bool in_time = read_until(pipe_fds[0], start + 10s, &out);
  close(pipe_fds[0]);
  return reap(pid, in_time, std::move(out), start);
}
#endif

// ---- What every error must look like ----

size_t line_count(const std::string& text) { return static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) + 1; }

// "<path>:<line>: <reason>" with 1 <= line <= max_line, or "<path>: cannot
// read the config file: <reason>". Empty if it is, else what is wrong.
std::string bad_error_line(const std::string& line, const std::string& path, size_t max_line) {
  if (line.rfind(path + ": ", 0) == 0) {
    const std::string rest = line.substr(path.size() + 2);
    if (rest.rfind(kFileRefusal, 0) == 0 && rest.size() > kFileRefusal.size()) return "";
    return "a file-level error that is not a refusal to read: " + line;
  }
  if (line.rfind(path + ":", 0) != 0) return "does not name the file: " + line;
  const char* number = line.c_str() + path.size() + 1;
  char* end = nullptr;
  const long n = strtol(number, &end, 10);
  if (end == number || strncmp(end, ": ", 2) != 0) return "does not name a line: " + line;
  if (n < 1 || static_cast<size_t>(n) > max_line) return "names line " + std::to_string(n) + " of " + std::to_string(max_line) + ": " + line;
  if (strlen(end + 2) == 0) return "gives no reason: " + line;
  return "";
}

// Every error of a result, as load_config or parse_config made it.
void expect_well_formed(const ConfigResult& r, const std::string& path, size_t max_line, const std::string& what) {
  EXPECT_EQ(r.ok(), r.errors.empty()) << what;
  for (const ConfigError& e : r.errors) {
    EXPECT_EQ(e.file, path) << what;
    const std::string problem = bad_error_line(e.to_string(), path, max_line);
    EXPECT_EQ(problem, "") << what;
  }
}

// ---- Files that are not plain, small files ----

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Readable by an unprivileged user, for the cases run as one.
    ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
  }

  // load_config refuses `path` as a whole, within the bound, naming it and
  // `reason`; and so does fracgpud --check (exit 1, the same line).
  void expect_refused(const std::string& path, const std::string& reason, int uid = -1) {
    const Outcome in_process = load_bounded(path, uid);
    ASSERT_TRUE(in_process.finished) << path << ": load_config still running after 5 s (killed)";
    ASSERT_EQ(in_process.exit_code, 0) << path << ": load_config crashed (signal " << in_process.signal << ")";
    EXPECT_EQ(in_process.output.rfind(path + ": cannot read the config file: ", 0), 0u) << in_process.output;
    EXPECT_NE(in_process.output.find(reason), std::string::npos) << "expected \"" << reason << "\", got: " << in_process.output;
    EXPECT_EQ(std::count(in_process.output.begin(), in_process.output.end(), '\n'), 1) << in_process.output;
#ifdef FRACGPUD_PATH
    const Outcome check = check_bounded(path, uid);
    ASSERT_TRUE(check.finished) << path << ": fracgpud --check still running after 10 s (killed); output:\n" << check.output;
    EXPECT_EQ(check.exit_code, kExitCheckFailedCode) << check.output;
    EXPECT_NE(check.output.find(path + ": cannot read the config file: "), std::string::npos) << check.output;
    EXPECT_NE(check.output.find(reason), std::string::npos) << check.output;
#endif
  }

  static constexpr int kExitCheckFailedCode = 1;  // fracgpud --check: invalid
  TempDir dir_;
};

TEST_F(ConfigFileTest, AFifoIsRefusedWithoutBlocking) {
  const std::string fifo = dir_ / "fifo.toml";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  expect_refused(fifo, "it is a FIFO (named pipe), not a regular file");
}

TEST_F(ConfigFileTest, ASymlinkToAFifoIsRefused) {
  const std::string fifo = dir_ / "fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  const std::string link = dir_ / "link.toml";
  ASSERT_EQ(symlink(fifo.c_str(), link.c_str()), 0);
  expect_refused(link, "it is a FIFO (named pipe), not a regular file");
}

TEST_F(ConfigFileTest, DevZeroIsRefused) { expect_refused("/dev/zero", "it is a character device, not a regular file"); }

TEST_F(ConfigFileTest, ADirectoryIsRefused) {
  const std::string sub = dir_ / "conf.d";
  ASSERT_EQ(mkdir(sub.c_str(), 0755), 0);
  expect_refused(sub, "it is a directory, not a regular file");
}

TEST_F(ConfigFileTest, ATenMegabyteFileIsRefused) {
  const std::string big = dir_ / "big.toml";
  // Valid TOML all the way (a comment per line): only its size is wrong.
  std::string text = "[[gpu]]\nindex = 0\n";
  const std::string comment = "# " + std::string(77, 'x') + "\n";
  while (text.size() < 10'000'000) text += comment;
  write_file(big, text);
  expect_refused(big, "it is " + std::to_string(text.size()) + " bytes, above the 1 MiB a config file may have");
}

TEST_F(ConfigFileTest, AFileOfExactlyTheLimitIsRead) {
  const std::string path = dir_ / "limit.toml";
  std::string text = "[[gpu]]\nindex = 0\n";
  text += "#" + std::string(kMaxConfigBytes - text.size() - 2, 'y') + "\n";
  ASSERT_EQ(text.size(), kMaxConfigBytes);
  write_file(path, text);
  const ConfigResult r = load_config(path, node());
  EXPECT_TRUE(r.ok()) << (r.errors.empty() ? "" : r.errors[0].to_string());
}

TEST_F(ConfigFileTest, AnUnreadableFileIsRefused) {
  const std::string path = dir_ / "secret.toml";
  write_file(path, "[[gpu]]\nindex = 0\n");
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  if (geteuid() == 0) {
    ASSERT_EQ(chown(path.c_str(), 0, 0), 0);
    expect_refused(path, "cannot open: Permission denied", 65534);  // as nobody
  } else {
    ASSERT_EQ(chmod(path.c_str(), 0), 0);
    expect_refused(path, "cannot open: Permission denied");
  }
}

TEST_F(ConfigFileTest, AReadErrorIsNotAnEmptyConfig) {
  // A regular file whose read fails: /proc/self/mem at offset 0 (not mapped)
  // gives EIO. Before, this was reported as "no [[gpu]] table".
  expect_refused("/proc/self/mem", "read failed: Input/output error");
}

TEST_F(ConfigFileTest, AProcFileIsBoundedByWhatItHoldsNotItsSize) {
  // st_size 0, several MiB of content: the size cap must hold while reading.
  struct stat st {};
  if (stat("/proc/kallsyms", &st) != 0 || access("/proc/kallsyms", R_OK) != 0)
    GTEST_SKIP() << "no readable /proc/kallsyms here";
  ASSERT_EQ(st.st_size, 0);
  std::string why;
  EXPECT_FALSE(read_config_file("/proc/kallsyms", &why, 4096));
  EXPECT_EQ(why, "it holds more than the 4 KiB a config file may have");
}

// ---- Seeded mutations of real configs ----

std::string read_whole(const std::string& path) {
  std::string why;
  std::optional<std::string> text = read_config_file(path, &why);
  EXPECT_TRUE(text) << path << ": " << why;
  return text.value_or("");
}

// The configs mutated: the shipped examples, and one that uses every kind
// of key (both GPU forms, devices, limits, priorities, explicit and inline memory
// tables).
std::vector<std::string> seeds() {
  std::vector<std::string> out = {read_whole(FRACGPU_EXAMPLES_DIR "/fracgpud.toml"),
                                  read_whole(FRACGPU_EXAMPLES_DIR "/demo.toml")};
  out.push_back(
      "[daemon]\n"
      "run_dir = \"/nonexistent/fracgpu-fuzz\"\n"
      "log_level = \"debug\"\n"
      "reap_interval_ms = 100\n"
      "allow_overcommit = true\n"
      "time_slice = \"2500us\"\n"
      "placement = \"spread\"\n"
      "metrics_address = \"[::1]:0\"\n"
      "health_interval = \"1.5s\"\n"
      "audit_interval = \"10s\"\n"
      "audit_action = \"deny\"\n"
      "liveness_timeout = \"30s\"\n"
      "\n"
      "[[gpu]]\n"
      "uuid = \"" + kUuid0 + "\"\n"
      "memory = \"15GiB\"\n"
      "context_memory = \"256MiB\"\n"
      "\n"
      "[[gpu]]\n"
      "index = 1\n"
      "context_memory = 268435456\n"
      "\n"
      "[[tenant]]\n"
      "name = \"alice\"\n"
      "gpus = 1.5\n"
      "devices = [\"" + kUuid1 + "\", 0]\n"
      "limit = 0.75\n"
      "priority = \"latency\"\n"
      "[tenant.memory]\n"
      "\"0\" = \"4 GiB\"\n"
      "\n"
      "[[tenant]]\n"
      "name = \"bob-2.x\"\n"
      "gpus = 0.25\n"
      "count_managed = false\n"
      "priority = \"batch\"\n"
      "\n"
      "[[tenant]]\n"
      "name = \"m\"\n"
      "memory = { \"1\" = 1073741824, \"" + kUuid0 + "\" = \"512MiB\" }\n");
  // The examples run on /run/fracgpu: keep --check away from the host's.
  for (std::string& s : out) {
    const size_t at = s.find("run_dir = \"/run/fracgpu\"");
    if (at != std::string::npos) s.replace(at, 24, "run_dir = \"/nonexistent/fracgpu-fuzz\"");
  }
  return out;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  // One to three mutations of `text`; *what names them, for failure messages.
  std::string mutate(std::string text, std::string* what) {
    const int rounds = 1 + static_cast<int>(below(3));
    for (int i = 0; i < rounds; ++i) text = once(std::move(text), what);
    return text;
  }

 private:
  size_t below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }

  static std::vector<std::string> split(const std::string& text) {
    std::vector<std::string> lines;
    size_t at = 0;
    while (at <= text.size()) {
      size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      lines.push_back(text.substr(at, end - at));
      at = end + 1;
    }
    return lines;
  }
  static std::string join(const std::vector<std::string>& lines) {
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" : "") + lines[i];
    return out;
  }

  std::string nested(size_t depth) {
    static const char* const kOpen[] = {"[", "{a=", "[{a="};
    static const char* const kClose[] = {"]", "}", "}]"};
    const size_t kind = below(3);
    std::string s = "deep = ";
    for (size_t i = 0; i < depth; ++i) s += kOpen[kind];
    s += "1";
    for (size_t i = 0; i < depth; ++i) s += kClose[kind];
    return s;
  }

  std::string once(std::string text, std::string* what) {
    static const char* const kHuge[] = {"99999999999999999999999999", "-9223372036854775809", "9223372036854775807",
                                        "1e400",  "-1e400", "1e-400", "nan", "-inf", "0x7fffffffffffffff",
                                        "18446744073709551616", "\"18446744073709551615 GiB\"", "\"1e30GiB\"",
                                        "\"999999999999999999999us\"", "1.0000000000000000000000001", "0.0000001",
                                        "-0.0"};
    static const char* const kBadUtf8[] = {"\xff", "\xc3\x28", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                                           "\xe2\x82", "\xfe\xfe\xff\xff"};
    // The first stands for a NUL byte.
    static const char* const kControl[] = {"", "\x01", "\x1b[31m", "\r", "\x7f", "\b", "\v", "\f"};
    std::vector<std::string> lines = split(text);
    switch (below(11)) {
      case 0: {  // flip one bit of a few bytes
        const size_t flips = 1 + below(4);
        for (size_t i = 0; i < flips && !text.empty(); ++i) text[below(text.size())] ^= static_cast<char>(1u << below(8));
        *what += " flip" + std::to_string(flips);
        return text;
      }
      case 1:  // truncate
        *what += " truncate";
        return text.substr(0, below(text.size() + 1));
      case 2: {  // duplicate a line (a key twice, a table header twice)
        const size_t at = below(lines.size());
        lines.insert(lines.begin() + static_cast<long>(at), lines[at]);
        *what += " dup-line" + std::to_string(at + 1);
        return join(lines);
      }
      case 3: {  // remove a line
        const size_t at = below(lines.size());
        lines.erase(lines.begin() + static_cast<long>(at));
        *what += " drop-line" + std::to_string(at + 1);
        return join(lines);
      }
      case 4: {  // swap two lines (a key moves to another table)
        const size_t a = below(lines.size()), b = below(lines.size());
        std::swap(lines[a], lines[b]);
        *what += " swap";
        return join(lines);
      }
      case 5: {  // a value replaced by a huge, tiny or special number
        const size_t at = below(lines.size());
        const size_t eq = lines[at].find('=');
        const char* huge = kHuge[below(std::size(kHuge))];
        if (eq == std::string::npos) lines.insert(lines.begin() + static_cast<long>(at), std::string("gpus = ") + huge);
        else lines[at] = lines[at].substr(0, eq + 1) + " " + huge;
        *what += std::string(" huge(") + huge + ")";
        return join(lines);
      }
      case 6: {  // bad UTF-8, anywhere (often inside a string or a key)
        const char* bad = kBadUtf8[below(std::size(kBadUtf8))];
        text.insert(below(text.size() + 1), bad);
        *what += " bad-utf8";
        return text;
      }
      case 7: {  // deep nesting, on a line of its own
        const size_t depth = below(2) ? 10 + below(300) : 1000 + below(20000);
        lines.insert(lines.begin() + static_cast<long>(below(lines.size() + 1)), nested(depth));
        *what += " nest" + std::to_string(depth);
        return join(lines);
      }
      case 8: {  // control characters
        const size_t n = 1 + below(3);
        for (size_t i = 0; i < n; ++i) {
          const size_t pick = below(std::size(kControl));
          text.insert(below(text.size() + 1), pick == 0 ? std::string(1, '\0') : std::string(kControl[pick]));
        }
        *what += " control";
        return text;
      }
      case 9: {  // a very long line: a key, a string or a dotted key
        const size_t n = 10'000 + below(200'000);
        std::string line;
        switch (below(3)) {
          case 0: line = std::string(n, 'k') + " = 1"; break;
          case 1: line = "name = \"" + std::string(n, 's') + "\""; break;
          default:
            for (size_t i = 0; i < n / 2; ++i) line += i ? ".a" : "a";
            line += " = 1";
        }
        lines.insert(lines.begin() + static_cast<long>(below(lines.size() + 1)), line);
        *what += " long" + std::to_string(line.size());
        return join(lines);
      }
      default: {  // many tables or tenants
        const size_t n = 100 + below(2000);
        std::string block;
        for (size_t i = 0; i < n; ++i)
          block += below(2) ? "[[tenant]]\nname = \"t" + std::to_string(i) + "\"\ngpus = 0.001\n" : "[[gpu]]\nindex = 0\n";
        *what += " many" + std::to_string(n);
        return text + "\n" + block;
      }
    }
  }

  std::mt19937_64 rng_;
};

struct FuzzCase {
  std::string text;
  std::string what;  // seed index, mutations
};

// The same cases on every run: seed 0x5eed, 300 mutations.
std::vector<FuzzCase> fuzz_cases() {
  constexpr size_t kCases = 300;
  const std::vector<std::string> base = seeds();
  Mutator m(0x5eed);
  std::vector<FuzzCase> out;
  for (size_t i = 0; i < kCases; ++i) {
    FuzzCase c;
    const size_t seed = i % base.size();
    c.what = "case " + std::to_string(i) + " (seed config " + std::to_string(seed) + ":";
    c.text = m.mutate(base[seed], &c.what);
    c.what += ")";
    out.push_back(std::move(c));
  }
  return out;
}

// In-process: the parser itself (sanitizers watch in the ASan build), one
// case after another, each bounded in time. A watchdog ends the process if
// one never returns, naming the case.
TEST(ConfigFuzz, MutatedConfigsInProcess) {
  TempDir dir;
  const std::string path = dir / "fuzz.toml";
  std::atomic<const char*> current{nullptr};
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    auto last = current.load();
    auto since = std::chrono::steady_clock::now();
    while (!done.load()) {
      std::this_thread::sleep_for(100ms);
      const auto now_case = current.load();
      if (now_case != last) {
        last = now_case;
        since = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - since > 60s) {
        fprintf(stderr, "config fuzz: %s has run for 60 s: hung\n", now_case ? now_case : "?");
        std::abort();
      }
    }
  });
  size_t valid = 0, rejected = 0;
  std::chrono::milliseconds slowest{0};
  std::string slowest_case;
  for (const FuzzCase& c : fuzz_cases()) {
    current.store(c.what.c_str());
    write_file(path, c.text);
    const auto start = std::chrono::steady_clock::now();
    const ConfigResult from_file = load_config(path, node());
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    if (took > slowest) {
      slowest = took;
      slowest_case = c.what;
    }
    const bool too_big = c.text.size() > kMaxConfigBytes;
    if (too_big) {
      ASSERT_EQ(from_file.errors.size(), 1u) << c.what;
      EXPECT_EQ(from_file.errors[0].line, 0) << c.what;
    }
    expect_well_formed(from_file, path, line_count(c.text), c.what);
    // And the text itself, whatever its size, straight to the parser.
    const ConfigResult parsed = parse_config(c.text, "fuzz.toml", node());
    expect_well_formed(parsed, "fuzz.toml", line_count(c.text), c.what);
    for (const ConfigError& e : parsed.errors) EXPECT_GE(e.line, 1) << c.what << ": " << e.to_string();
    (from_file.ok() ? valid : rejected) += 1;
  }
  done.store(true);
  watchdog.join();
  // Parsing is fast; the bound is for sanitizers and a loaded machine.
  EXPECT_LT(slowest, 5000ms) << "slowest: " << slowest_case;
  // Mutations that leave a valid config must be a minority, or the cases
  // would test nothing but the happy path.
  EXPECT_GT(rejected, valid) << valid << " valid, " << rejected << " rejected";
  printf("config fuzz: %zu cases, %zu valid, %zu rejected; slowest %lld ms (%s)\n", valid + rejected, valid, rejected,
         static_cast<long long>(slowest.count()), slowest_case.c_str());
}

#ifdef FRACGPUD_PATH
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  return lines;
}

// The same cases through the binary: exit 0 (valid) or 1 (invalid) within
// the bound, and every line it prints on refusal names the file and a line.
// Two at a time: each run discovers the simulated GPUs first.
TEST(ConfigFuzz, MutatedConfigsThroughFracgpudCheck) {
  TempDir dir;
  const std::vector<FuzzCase> cases = fuzz_cases();
  std::atomic<size_t> next{0};
  std::vector<std::string> failures[2];
  auto worker = [&](int w) {
    const std::string path = dir / ("fuzz" + std::to_string(w) + ".toml");
    for (size_t i; (i = next.fetch_add(1)) < cases.size();) {
      const FuzzCase& c = cases[i];
      write_file(path, c.text);
      const Outcome o = check_bounded(path);
      auto fail = [&](const std::string& why) { failures[w].push_back(c.what + ": " + why + "\noutput:\n" + o.output); };
      if (!o.finished) {
        fail("still running after 10 s (killed)");
        continue;
      }
      if (o.signal != 0) {
        fail("killed by signal " + std::to_string(o.signal));
        continue;
      }
      if (o.exit_code == 0) continue;
      if (o.exit_code != 1) {
        fail("exit code " + std::to_string(o.exit_code));
        continue;
      }
      size_t errors = 0;
      for (const std::string& line : lines_of(o.output)) {
        if (line.empty() || line.rfind("note: ", 0) == 0 || line.rfind("warning: ", 0) == 0) continue;
        if (line.find(" error(s); nothing was changed") != std::string::npos) continue;
        ++errors;
        const std::string problem = bad_error_line(line, path, line_count(c.text));
        if (!problem.empty()) fail(problem);
      }
      if (errors == 0) fail("refused without naming an error");
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  for (const auto& list : failures)
    for (const std::string& f : list) ADD_FAILURE() << f;
}
#endif

}  // namespace

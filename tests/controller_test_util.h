// Helpers shared by the controller tests: temporary directories, polling, and
// a stand-in tenant process that attaches to a ledger as the interposer does.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ledger.h"

namespace fracgpu::testing {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/fracgpu-ctl-XXXXXX";
    if (mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Polls `done` every 5 ms until it holds or `timeout` passes.
inline bool eventually(const std::function<bool()>& done,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Exit status of `pid` if it ends within `timeout`; -1 if it is still
// running (then left running), -2 if it died by a signal.
inline int wait_exit(pid_t pid, std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  int status = 0;
  const bool ended = eventually([&] { return waitpid(pid, &status, WNOHANG) == pid; }, timeout);
  if (!ended) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
}

// Runs `args` (argv[0] a path) in a child whose stdout and stderr are
// appended to `log`, after applying `env` to the inherited environment:
// "NAME=value" sets NAME, a bare "NAME" removes it; later entries win.
// With a `gate` descriptor, the child waits for a byte (or end of file) on it
// before it execs: the caller knows the pid the program will run as first.
inline pid_t spawn_logged(const std::vector<std::string>& args, const std::string& log,
                          const std::vector<std::string>& env, int gate = -1) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (gate >= 0) {
      char go = 0;
      if (read(gate, &go, 1) < 0) _exit(126);
      close(gate);
    }
    for (const std::string& e : env) {
      if (e.find('=') == std::string::npos) unsetenv(e.c_str());
      else putenv(const_cast<char*>(e.c_str()));
    }
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

inline void kill_and_reap(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// Runs `body` in a forked child (a fresh process: another user, another
// driver attachment) and returns the text it returned; "" if the child died
// before writing it.
inline std::string output_of_child(const std::function<std::string()>& body) {
  int fds[2];
  if (pipe(fds) != 0) return "";
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const std::string text = body();
    if (write(fds[1], text.data(), text.size()) < 0) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return text;
}

// Forks a process named `comm` that runs `setup` (attach to a ledger, claim
// an arbiter entry: whatever the test needs it to hold) and then sleeps
// until killed, keeping its record locks. Returns its pid once `setup`
// returned true, or -1 (the child is then reaped).
inline pid_t spawn_holder(const std::function<bool()>& setup, const char* comm = "holder") {
  int ready[2];
  if (pipe(ready) != 0) return -1;
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    close(ready[0]);
    prctl(PR_SET_NAME, comm);
    const char result = setup() ? 1 : 0;
    if (write(ready[1], &result, 1) != 1 || result == 0) _exit(1);
    for (;;) pause();
  }
  close(ready[1]);
  char result = 0;
  const bool ok = read(ready[0], &result, 1) == 1 && result == 1;
  close(ready[0]);
  if (!ok) {
    kill_and_reap(pid);
    return -1;
  }
  return pid;
}

// Forks a process that attaches to the tenant ledger in `dir` the way the
// interposer does (claims a slot, charges `bytes` on GPU entry `gpu`), then
// sleeps until killed. Returns its pid once it holds the charge, or -1.
inline pid_t spawn_tenant_process(const std::string& dir, uint32_t gpu, uint64_t bytes, const char* comm = "trainer") {
  return spawn_holder(
      [&] {
        ledger::TenantLedger l;
        char err[256];
        ledger::ProcessIdentity self{};
        if (ledger::open_ledger(dir.c_str(), ledger::AccessMode::kTenant, nullptr, &l, err, sizeof err) !=
                ledger::LedgerError::kOk ||
            !ledger::read_self_identity(&self))
          return false;
        ledger::LedgerError e{};
        const int slot = ledger::claim_slot(l, self, &e);
        return slot >= 0 && ledger::try_charge(l, gpu, static_cast<uint32_t>(slot), bytes);
      },
      comm);
}

// An HTTP GET over loopback; the whole response, or "" if unreachable. A
// server that does not answer within 10 s gets what it sent until then.
inline std::string http_get(uint16_t port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const struct timeval timeout {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::string out;
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

// The port fracgpud logged for its metrics endpoint ("metrics: serving
// http://127.0.0.1:<port>/metrics"), or 0 if not logged yet.
inline uint16_t logged_metrics_port(const std::string& log) {
  const std::string marker = "metrics: serving http://127.0.0.1:";
  const size_t at = log.rfind(marker);
  if (at == std::string::npos) return 0;
  return static_cast<uint16_t>(std::stoi(log.substr(at + marker.size())));
}

}  // namespace fracgpu::testing

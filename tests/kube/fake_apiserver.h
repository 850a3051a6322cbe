// Runs tests/kube/fake_apiserver.py (the stand-in API server) for a test:
// started in a scratch folder of its own, stopped (SIGTERM, then SIGKILL) when
// the object goes. Needs PYTHON3 and FAKE_APISERVER defined by CMake.
#pragma once

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace fracgpu::kube::testing {

struct FakeApiServerOptions {
  bool tls = true;
  std::string host = "127.0.0.1";
  std::vector<std::string> tokens;  // accepted bearer tokens
  std::string token_file;           // or the token in this file, re-read per request
  bool client_ca = false;           // accept client certificates signed by the server's CA
  std::vector<std::string> fail;    // --fail METHOD:PATH_REGEX:STATUS:COUNT[:RETRY_AFTER]
  std::string fixtures;             // ResourceClaims: <fixtures>/<ns>/<name>.json
  bool canonical = true;            // store quantities in the API server's canonical form
  std::string tls_dir;              // reuse certificates (e.g. another server's); default: its own
  bool device_taints = true;        // false: as with the gate DRADeviceTaints off (taints dropped on write)
  // How long after a change its garbage collector looks at the objects it
  // concerns (--gc-delay; POST /fake/gc changes it at run time).
  std::chrono::milliseconds gc_delay{100};
};

class FakeApiServer {
 public:
  explicit FakeApiServer(FakeApiServerOptions options = {}) : options_(std::move(options)) {
    char pattern[] = "/tmp/fake-apiserver-XXXXXX";
    const char* made = ::mkdtemp(pattern);
    if (!made) throw std::runtime_error("mkdtemp failed");
    dir_ = made;
    if (options_.tls_dir.empty()) options_.tls_dir = dir_ + "/tls";
    std::vector<std::string> args = {PYTHON3, FAKE_APISERVER, "--port-file", dir_ + "/port", "--log", log_path(),
                                     "--host", options_.host};
    if (options_.tls) args.insert(args.end(), {"--tls-dir", options_.tls_dir});
    for (const auto& t : options_.tokens) args.insert(args.end(), {"--token", t});
    if (!options_.token_file.empty()) args.insert(args.end(), {"--token-file", options_.token_file});
    if (options_.client_ca) args.insert(args.end(), {"--client-ca", options_.tls_dir + "/ca.crt"});
    for (const auto& f : options_.fail) args.insert(args.end(), {"--fail", f});
    if (!options_.fixtures.empty()) args.insert(args.end(), {"--fixtures", options_.fixtures});
    if (!options_.canonical) args.push_back("--no-canonical");
    if (!options_.device_taints) args.insert(args.end(), {"--feature-gates", "DRADeviceTaints=false"});
    args.insert(args.end(), {"--gc-delay", std::to_string(options_.gc_delay.count() / 1000.0)});

    std::string stderr_path = dir_ + "/stderr";
    pid_ = ::fork();
    if (pid_ == 0) {
      FILE* err = std::freopen(stderr_path.c_str(), "w", stderr);
      (void)err;
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    // Certificates are made first: allow a slow machine some time.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(dir_ + "/port");
      if (in >> port_ && port_ > 0) return;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("fake_apiserver.py exited: " + read_file(stderr_path));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    throw std::runtime_error("fake_apiserver.py did not start: " + read_file(stderr_path));
  }

  ~FakeApiServer() {
    stop();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  FakeApiServer(const FakeApiServer&) = delete;
  FakeApiServer& operator=(const FakeApiServer&) = delete;

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  int port() const { return port_; }
  const std::string& dir() const { return dir_; }
  std::string url() const {
    std::string host = options_.host.find(':') != std::string::npos ? "[" + options_.host + "]" : options_.host;
    return (options_.tls ? "https://" : "http://") + host + ":" + std::to_string(port_);
  }
  std::string ca_file() const { return options_.tls_dir + "/ca.crt"; }
  std::string client_cert_file() const { return options_.tls_dir + "/client.crt"; }
  std::string client_key_file() const { return options_.tls_dir + "/client.key"; }
  std::string log_path() const { return dir_ + "/writes.log"; }

  // The ResourceSlice writes recorded so far, oldest first.
  std::vector<nlohmann::json> writes() const {
    std::vector<nlohmann::json> out;
    std::ifstream in(log_path());
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    return out;
  }

  static std::string read_file(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  FakeApiServerOptions options_;
  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
};

}  // namespace fracgpu::kube::testing

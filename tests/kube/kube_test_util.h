// Helpers of the Kubernetes API tests: clients of the stand-in API server,
// kubeconfigs, a logger whose lines a test can read, a NODE object.
#pragma once

#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <spdlog/logger.h>
#include <spdlog/sinks/ostream_sink.h>

#include "controller_test_util.h"
#include "kube/api_client.h"
#include "kube/kubeconfig.h"
#include "kube/fake_apiserver.h"

namespace fracgpu::kube::testing {

using fracgpu::testing::read_file;
using fracgpu::testing::TempDir;
using fracgpu::testing::write_file;
using nlohmann::json;

// Quick retries, so tests of failures take fractions of a second.
inline RetryPolicy fast_retries() {
  RetryPolicy policy;
  policy.connect_timeout = std::chrono::milliseconds(2000);
  policy.attempt_timeout = std::chrono::milliseconds(5000);
  policy.total_timeout = std::chrono::milliseconds(10000);
  policy.initial_backoff = std::chrono::milliseconds(20);
  policy.max_backoff = std::chrono::milliseconds(100);
  return policy;
}

// A logger writing into a string the test reads.
struct CapturedLog {
  std::ostringstream lines;
  std::shared_ptr<spdlog::logger> logger;
  CapturedLog() {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(lines);
    logger = std::make_shared<spdlog::logger>("kube-test", sink);
    logger->set_level(spdlog::level::trace);
    logger->flush_on(spdlog::level::trace);
  }
  std::string text() const { return lines.str(); }
};

// A kubeconfig with one context; `cluster` and `user` are YAML mappings' bodies,
// indented by the caller's six spaces.
inline std::string kubeconfig_yaml(const std::string& cluster, const std::string& user) {
  return "apiVersion: v1\n"
         "kind: Config\n"
         "current-context: test\n"
         "contexts:\n"
         "  - name: test\n"
         "    context:\n"
         "      cluster: fake\n"
         "      user: plugin\n"
         "clusters:\n"
         "  - name: fake\n"
         "    cluster:\n" +
         cluster +
         "users:\n"
         "  - name: plugin\n"
         "    user:\n" +
         user;
}

// A client of the server's own control paths (/fake/...): trusts its CA, no user.
inline std::unique_ptr<ApiClient> control_client(const FakeApiServer& server, const TempDir& dir) {
  std::string path = dir / "control.kubeconfig";
  write_file(path, kubeconfig_yaml("      server: " + server.url() + "\n      certificate-authority: " +
                                       server.ca_file() + "\n",
                                   "      {}\n"));
  std::string error;
  auto client = ApiClient::from_kubeconfig(path, &error);
  EXPECT_TRUE(client) << error;
  if (client) client->set_retry_policy(fast_retries());
  return client;
}

// The requests the server answered under /apis (not its control paths).
inline json api_requests(ApiClient& control) {
  HttpResult result = control.get("/fake/requests");
  EXPECT_TRUE(result.ok()) << result.error;
  json out = json::array();
  for (const json& r : json::parse(result.body))
    if (r["path"].get<std::string>().rfind("/apis", 0) == 0) out.push_back(r);
  return out;
}

inline std::string base64(const std::string& bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kAlphabet[(v >> s) & 63]);
  }
  if (i + 1 == bytes.size()) {
    uint32_t v = uint8_t(bytes[i]) << 16;
    out += {kAlphabet[(v >> 18) & 63], kAlphabet[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8);
    out += {kAlphabet[(v >> 18) & 63], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], '='};
  }
  return out;
}

// A stand-in API server (token "t") and a client of it logging into `log`,
// with `control` for the server's own paths.
struct StandInServerTest : ::testing::Test {
  std::unique_ptr<FakeApiServer> server;
  TempDir dir;
  std::unique_ptr<ApiClient> client;
  std::unique_ptr<ApiClient> control;
  CapturedLog log;

  void start(FakeApiServerOptions options = {}) {
    options.tokens = {"t"};
    server = std::make_unique<FakeApiServer>(options);
    std::string path = dir / "kubeconfig";
    write_file(path, kubeconfig_yaml("      server: " + server->url() + "\n      certificate-authority: " +
                                         server->ca_file() + "\n",
                                     "      token: t\n"));
    std::string error;
    client = ApiClient::from_kubeconfig(path, &error);
    ASSERT_TRUE(client) << error;
    client->set_retry_policy(fast_retries());
    client->set_logger(log.logger);
    control = control_client(*server, dir);
  }

  // The next `count` requests matching `method` and `path` (a regex) get `status`.
  void fail_next(const std::string& method, const std::string& path, int status, int count,
                 std::optional<int> retry_after = std::nullopt, const std::string& message = "") {
    json failure = {{"method", method}, {"path", path}, {"status", status}, {"count", count}};
    if (retry_after) failure["retry_after"] = *retry_after;
    if (!message.empty()) failure["message"] = message;
    ASSERT_TRUE(control->post("/fake/fail", failure).ok());
  }
};

// The control API's NODE object for `gpus` H100-like GPUs, none held by config tenants.
inline json node_object(int gpus = 2) {
  json node = {{"driver_version", "550.54.15"},
               {"cuda_driver_version", 12040},
               {"allow_overcommit", false},
               {"generation", 1},
               {"gpus", json::array()}};
  for (int i = 0; i < gpus; ++i) {
    node["gpus"].push_back({{"uuid", "GPU-0000000" + std::to_string(i) + "-1111-2222-3333-444444444444"},
                            {"index", i},
                            {"name", "NVIDIA H100 80GB HBM3"},
                            {"memory", 85899345920ull},
                            {"compute_capability", "9.0"},
                            {"fenced", false},
                            {"fence_reason", ""},
                            {"config_memory", 0},
                            {"config_share", 0.0},
                            {"api_memory", 0},
                            {"api_share", 0.0},
                            {"free_memory", 85899345920ull},
                            {"free_share", 1.0}});
  }
  return node;
}

}  // namespace fracgpu::kube::testing

// The kubelet plugin's client for the Kubernetes API server: HTTPS through
// libcurl, JSON through nlohmann_json, credentials the way in-cluster clients
// and kubectl find them.
//
// Every call is retried with exponential backoff and jitter on what may pass
// (no answer, 429, 5xx but 501; Retry-After honoured) until RetryPolicy's
// total time is spent, and every failure is logged with the method, the
// object's path, the HTTP status and the API's Status message. Nothing here
// throws to the caller. Calls may come from several threads at once: each
// call uses a curl handle of its own (idle handles are pooled, under a
// mutex, so connections are reused).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

namespace fracgpu::kube {

struct Credentials;  // kube/kubeconfig.h

// Where a pod's service-account credentials are mounted.
inline constexpr const char* kDefaultSecretsDir = "/var/run/secrets/kubernetes.io/serviceaccount";

// One call's outcome. status 0: no HTTP answer (error says why). Otherwise the
// last answer's status and body; error is empty on 2xx and else reads
// "HTTP 403 Forbidden: <the Status object's message>".
struct HttpResult {
  long status = 0;
  std::string body;
  std::string error;
  bool ok() const { return status >= 200 && status < 300; }
};

// How long calls may take and how they are retried.
struct RetryPolicy {
  std::chrono::milliseconds connect_timeout{5'000};   // per attempt, TCP + TLS
  std::chrono::milliseconds attempt_timeout{20'000};  // per attempt, whole exchange
  std::chrono::milliseconds total_timeout{60'000};    // all attempts and waits of one call; no attempt
                                                      // begins with less than connect_timeout / 4 left
  std::chrono::milliseconds initial_backoff{250};     // doubled after each failure ...
  std::chrono::milliseconds max_backoff{8'000};       // ... up to this; a random part is added
  int max_attempts = 10;
};

class ApiClient {
 public:
  // In-cluster: token and CA from `secrets_dir` (token re-read whenever the
  // file changes: projected tokens rotate), server from
  // KUBERNETES_SERVICE_HOST/PORT (IPv6 addresses bracketed).
  // Returns nullptr with *error naming what is missing.
  static std::unique_ptr<ApiClient> in_cluster(std::string* error,
                                               const std::string& secrets_dir = kDefaultSecretsDir);
  // A kubeconfig (YAML) as kubectl reads it: current-context's cluster
  // (server, certificate-authority[-data], insecure-skip-tls-verify) and user
  // (token, tokenFile, client-certificate[-data] + client-key[-data]). Paths
  // are relative to the kubeconfig's folder. Unsupported credentials (exec,
  // auth-provider, username/password) are refused, naming the field.
  static std::unique_ptr<ApiClient> from_kubeconfig(const std::string& path, std::string* error);

  // What an operator must be told about how the client reaches the API
  // server: TLS verification turned off, or plain HTTP (the bearer token
  // then travels to whoever answers). Empty when neither.
  std::string transport_warning() const;

  ~ApiClient();
  ApiClient(const ApiClient&) = delete;
  ApiClient& operator=(const ApiClient&) = delete;

  // `path` begins with "/" ("/apis/resource.k8s.io/v1/resourceslices?...");
  // query values must already be escaped (escape_query_value).
  HttpResult get(const std::string& path);
  HttpResult post(const std::string& path, const nlohmann::json& body);
  HttpResult put(const std::string& path, const nlohmann::json& body);
  HttpResult del(const std::string& path);
  // Server-side apply: PATCH with Content-Type application/apply-patch+yaml
  // (JSON is YAML); `path` carries ?fieldManager=...[&force=true].
  HttpResult apply(const std::string& path, const nlohmann::json& body);

  // Failures are logged here (default: spdlog's default logger).
  void set_logger(std::shared_ptr<spdlog::logger> log);
  void set_retry_policy(const RetryPolicy& policy);
  // "https://10.0.0.1:443": where calls go.
  const std::string& server() const;

  struct Impl;

 private:
  explicit ApiClient(std::unique_ptr<Impl> impl);
  static std::unique_ptr<ApiClient> with_credentials(std::optional<Credentials> creds);
  HttpResult call(const char* method, const std::string& path, const nlohmann::json* body,
                  const char* content_type = "application/json");
  std::unique_ptr<Impl> impl_;
};

// Percent-encodes everything but RFC 3986's unreserved characters, for a value
// in a query ("spec.nodeName=node-1" as one fieldSelector value).
std::string escape_query_value(std::string_view value);

}  // namespace fracgpu::kube

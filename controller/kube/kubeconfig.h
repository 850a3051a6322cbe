// Where the API server is and how to prove who we are: from a pod's
// service-account mount, or from a kubeconfig file (YAML).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace fracgpu::kube {

struct Credentials {
  std::string server;  // "https://10.0.0.1:443" (a path prefix is kept; no trailing "/")
  // The CA that signs the server's certificate: a PEM file or PEM text. Neither
  // (and no insecure flag): the system's trusted roots.
  std::string ca_file;
  std::string ca_pem;
  bool insecure_skip_tls_verify = false;
  // Bearer token: fixed, or a file re-read whenever it changes (it wins when both).
  std::string token;
  std::string token_file;
  // Client certificate and key (PEM file or PEM text each), or none.
  std::string client_cert_file;
  std::string client_cert_pem;
  std::string client_key_file;
  std::string client_key_pem;
  std::string origin;  // for messages: "in-cluster (<dir>)" or "kubeconfig <path>"
};

// From `secrets_dir` (token, ca.crt) and KUBERNETES_SERVICE_HOST/PORT.
std::optional<Credentials> in_cluster_credentials(const std::string& secrets_dir, std::string* error);

// current-context's cluster and user in the kubeconfig at `path`. Errors name
// the file and the field ("kubeconfig /x: users[0].user.exec: credential
// plugins are not supported (use a token or a client certificate)").
std::optional<Credentials> kubeconfig_credentials(const std::string& path, std::string* error);

// Standard base64 (RFC 4648, padding optional, whitespace skipped); nullopt
// with *why on any other character.
std::optional<std::string> decode_base64(std::string_view text, std::string* why);

// A small file's content (<= max_bytes), or nullopt with *why.
std::optional<std::string> read_small_file(const std::string& path, size_t max_bytes, std::string* why);

}  // namespace fracgpu::kube

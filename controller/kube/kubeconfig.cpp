#include "kube/kubeconfig.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "common/text_escape.h"

namespace fracgpu::kube {
namespace {

using controller::escape_terminal;

// A kubeconfig holds a few certificates at most; a larger file is a mistake.
constexpr size_t kMaxKubeconfigBytes = 4 << 20;
constexpr size_t kMaxCredentialFileBytes = 1 << 20;

std::string join_path(const std::string& dir, const std::string& path) {
  if (path.empty() || path.front() == '/' || dir.empty()) return path;
  return (std::filesystem::path(dir) / path).string();
}

// Reads one kubeconfig; each accessor fails with the field's path.
class KubeconfigReader {
 public:
  KubeconfigReader(std::string path, std::string* error) : path_(std::move(path)), error_(error) {}

  bool fail(const std::string& field, const std::string& reason) {
    if (error_) *error_ = fmt::format("kubeconfig {}: {}{}{}", path_, field, field.empty() ? "" : ": ", reason);
    return false;
  }

  // `node[key]` as a string: absent leaves *out untouched; not a scalar fails.
  bool string_field(const YAML::Node& node, const char* key, const std::string& where, std::string* out) {
    YAML::Node value = node[key];
    if (!value || value.IsNull()) return true;
    if (!value.IsScalar()) return fail(where + "." + key, "expected a string");
    *out = value.Scalar();
    return true;
  }

  bool bool_field(const YAML::Node& node, const char* key, const std::string& where, bool* out) {
    YAML::Node value = node[key];
    if (!value || value.IsNull()) return true;
    bool parsed = false;
    if (!value.IsScalar() || !YAML::convert<bool>::decode(value, parsed))
      return fail(where + "." + key, fmt::format("expected true or false, not \"{}\"",
                                                 escape_terminal(value.IsScalar() ? value.Scalar() : "")));
    *out = parsed;
    return true;
  }

  // The entry of list `section` ("clusters") whose name is `name`; its index in *index.
  bool named_entry(const YAML::Node& root, const char* section, const std::string& name, YAML::Node* out,
                   size_t* index) {
    YAML::Node list = root[section];
    if (list && !list.IsNull() && !list.IsSequence()) return fail(section, "expected a list");
    if (list && list.IsSequence()) {
      for (size_t i = 0; i < list.size(); ++i) {
        YAML::Node entry = list[i];
        if (!entry.IsMap()) return fail(fmt::format("{}[{}]", section, i), "expected a mapping");
        YAML::Node entry_name = entry["name"];
        if (entry_name && entry_name.IsScalar() && entry_name.Scalar() == name) {
          *out = entry;
          *index = i;
          return true;
        }
      }
    }
    return fail(section, fmt::format("no entry named \"{}\"", escape_terminal(name)));
  }

  // `entry[key]` as a mapping (a context's "context", a cluster's "cluster").
  bool mapping_field(const YAML::Node& entry, const char* key, const std::string& where, YAML::Node* out) {
    *out = entry[key];
    if (!*out || !out->IsMap()) return fail(where, "expected a mapping");
    return true;
  }

  // base64 text (*-data) into *pem.
  bool data_field(const YAML::Node& node, const char* key, const std::string& where, std::string* pem) {
    std::string text;
    if (!string_field(node, key, where, &text)) return false;
    if (text.empty()) return true;
    std::string why;
    auto decoded = decode_base64(text, &why);
    if (!decoded) return fail(where + "." + key, why);
    *pem = std::move(*decoded);
    return true;
  }

  std::optional<Credentials> read();

 private:
  std::string path_;
  std::string* error_;
};

std::optional<Credentials> KubeconfigReader::read() {
  std::string why;
  auto text = read_small_file(path_, kMaxKubeconfigBytes, &why);
  if (!text) {
    fail("", why);
    return std::nullopt;
  }
  YAML::Node root;
  try {
    root = YAML::Load(*text);
  } catch (const YAML::Exception& e) {
    // yaml-cpp's marks count from 0.
    fail(fmt::format("line {} column {}", e.mark.line + 1, e.mark.column + 1), e.msg);
    return std::nullopt;
  }
  if (!root.IsMap()) {
    fail("", "not a kubeconfig (expected a YAML mapping at the top)");
    return std::nullopt;
  }
  const std::string dir = std::filesystem::path(path_).parent_path().string();

  std::string context_name;
  if (!string_field(root, "current-context", "", &context_name)) return std::nullopt;
  if (context_name.empty()) {
    fail("current-context", "is not set (kubectl config use-context NAME)");
    return std::nullopt;
  }
  YAML::Node context_entry;
  size_t context_index = 0;
  if (!named_entry(root, "contexts", context_name, &context_entry, &context_index)) return std::nullopt;
  const std::string context_where = fmt::format("contexts[{}].context", context_index);
  YAML::Node context;
  if (!mapping_field(context_entry, "context", context_where, &context)) return std::nullopt;
  std::string cluster_name, user_name;
  if (!string_field(context, "cluster", context_where, &cluster_name) ||
      !string_field(context, "user", context_where, &user_name))
    return std::nullopt;
  if (cluster_name.empty()) {
    fail(context_where + ".cluster", "is not set");
    return std::nullopt;
  }

  Credentials creds;
  creds.origin = "kubeconfig " + path_;

  YAML::Node cluster_entry;
  size_t cluster_index = 0;
  if (!named_entry(root, "clusters", cluster_name, &cluster_entry, &cluster_index)) return std::nullopt;
  const std::string cluster_where = fmt::format("clusters[{}].cluster", cluster_index);
  YAML::Node cluster;
  if (!mapping_field(cluster_entry, "cluster", cluster_where, &cluster)) return std::nullopt;
  std::string ca_file, tls_server_name, proxy_url;
  if (!string_field(cluster, "server", cluster_where, &creds.server) ||
      !string_field(cluster, "certificate-authority", cluster_where, &ca_file) ||
      !data_field(cluster, "certificate-authority-data", cluster_where, &creds.ca_pem) ||
      !bool_field(cluster, "insecure-skip-tls-verify", cluster_where, &creds.insecure_skip_tls_verify) ||
      !string_field(cluster, "tls-server-name", cluster_where, &tls_server_name) ||
      !string_field(cluster, "proxy-url", cluster_where, &proxy_url))
    return std::nullopt;
  if (creds.server.rfind("https://", 0) != 0 && creds.server.rfind("http://", 0) != 0) {
    fail(cluster_where + ".server", creds.server.empty() ? "is not set"
                                                         : fmt::format("\"{}\" is not an http(s) URL",
                                                                       escape_terminal(creds.server)));
    return std::nullopt;
  }
  while (creds.server.size() > 8 && creds.server.back() == '/') creds.server.pop_back();
  if (!tls_server_name.empty()) {
    fail(cluster_where + ".tls-server-name", "is not supported");
    return std::nullopt;
  }
  if (!proxy_url.empty()) {
    fail(cluster_where + ".proxy-url", "is not supported (HTTPS_PROXY in the environment is honoured)");
    return std::nullopt;
  }
  // cluster-level CA data wins over the file, as in client-go.
  if (creds.ca_pem.empty()) creds.ca_file = join_path(dir, ca_file);
  if (creds.insecure_skip_tls_verify && (!creds.ca_file.empty() || !creds.ca_pem.empty())) {
    fail(cluster_where, "certificate-authority and insecure-skip-tls-verify are both set (choose one)");
    return std::nullopt;
  }

  if (user_name.empty()) return creds;  // anonymous
  YAML::Node user_entry;
  size_t user_index = 0;
  if (!named_entry(root, "users", user_name, &user_entry, &user_index)) return std::nullopt;
  const std::string user_where = fmt::format("users[{}].user", user_index);
  YAML::Node user = user_entry["user"];
  if (!user || user.IsNull()) return creds;
  if (!user.IsMap()) {
    fail(user_where, "expected a mapping");
    return std::nullopt;
  }
  for (const char* unsupported : {"exec", "auth-provider"}) {
    if (user[unsupported]) {
      fail(user_where + "." + unsupported, "credential plugins are not supported (use a token or a client certificate)");
      return std::nullopt;
    }
  }
  for (const char* unsupported : {"username", "password", "as", "as-groups", "as-uid", "as-user-extra"}) {
    if (user[unsupported]) {
      fail(user_where + "." + unsupported, "is not supported (use a token or a client certificate)");
      return std::nullopt;
    }
  }
  std::string token_file, cert_file, key_file;
  if (!string_field(user, "token", user_where, &creds.token) ||
      !string_field(user, "tokenFile", user_where, &token_file) ||
      !string_field(user, "client-certificate", user_where, &cert_file) ||
      !data_field(user, "client-certificate-data", user_where, &creds.client_cert_pem) ||
      !string_field(user, "client-key", user_where, &key_file) ||
      !data_field(user, "client-key-data", user_where, &creds.client_key_pem))
    return std::nullopt;
  // As client-go: a token written in the file wins over tokenFile; data over files.
  if (creds.token.empty()) creds.token_file = join_path(dir, token_file);
  if (creds.client_cert_pem.empty()) creds.client_cert_file = join_path(dir, cert_file);
  if (creds.client_key_pem.empty()) creds.client_key_file = join_path(dir, key_file);
  bool has_cert = !creds.client_cert_file.empty() || !creds.client_cert_pem.empty();
  bool has_key = !creds.client_key_file.empty() || !creds.client_key_pem.empty();
  if (has_cert != has_key) {
    fail(user_where, has_cert ? "client-certificate without client-key" : "client-key without client-certificate");
    return std::nullopt;
  }
  if (!creds.token_file.empty()) {
    if (!read_small_file(creds.token_file, kMaxCredentialFileBytes, &why)) {
      fail(user_where + ".tokenFile", why);
      return std::nullopt;
    }
  }
  return creds;
}

}  // namespace

std::optional<std::string> read_small_file(const std::string& path, size_t max_bytes, std::string* why) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (why) *why = fmt::format("{}: {}", path, std::strerror(errno));
    return std::nullopt;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    if (why) *why = fmt::format("{}: not a regular file", path);
    return std::nullopt;
  }
  std::string content;
  char buffer[8192];
  for (;;) {
    ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      if (why) *why = fmt::format("{}: {}", path, std::strerror(err));
      return std::nullopt;
    }
    if (n == 0) break;
    content.append(buffer, static_cast<size_t>(n));
    if (content.size() > max_bytes) {
      ::close(fd);
      if (why) *why = fmt::format("{}: larger than {} bytes", path, max_bytes);
      return std::nullopt;
    }
  }
  ::close(fd);
  return content;
}

std::optional<std::string> decode_base64(std::string_view text, std::string* why) {
  std::string out;
  out.reserve(text.size() * 3 / 4);
  uint32_t bits = 0;
  int nbits = 0;
  size_t padding = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    int v;
    if (c >= 'A' && c <= 'Z') v = c - 'A';
    else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
    else if (c >= '0' && c <= '9') v = c - '0' + 52;
    else if (c == '+') v = 62;
    else if (c == '/') v = 63;
    else if (c == '=') { ++padding; continue; }
    else if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    else {
      if (why) *why = fmt::format("not base64: character {} at offset {}", escape_terminal(std::string(1, c)), i);
      return std::nullopt;
    }
    if (padding != 0) {
      if (why) *why = fmt::format("not base64: data after padding at offset {}", i);
      return std::nullopt;
    }
    bits = (bits << 6) | static_cast<uint32_t>(v);
    nbits += 6;
    if (nbits >= 8) {
      nbits -= 8;
      out.push_back(static_cast<char>((bits >> nbits) & 0xff));
    }
  }
  // A lone 6-bit group cannot encode a byte.
  if (nbits >= 6 || padding > 2) {
    if (why) *why = "not base64: truncated";
    return std::nullopt;
  }
  return out;
}

std::optional<Credentials> in_cluster_credentials(const std::string& secrets_dir, std::string* error) {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (!host || !*host || !port || !*port) {
    if (error) *error = "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set: not in a pod (give a kubeconfig)";
    return std::nullopt;
  }
  char* end = nullptr;
  long port_number = std::strtol(port, &end, 10);
  if (*end != '\0' || port_number < 1 || port_number > 65535) {
    if (error) *error = fmt::format("KUBERNETES_SERVICE_PORT \"{}\" is not a port number", escape_terminal(port));
    return std::nullopt;
  }
  std::string host_part = host;
  for (char c : host_part) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '[' || c == ']')) {
      if (error) *error = fmt::format("KUBERNETES_SERVICE_HOST \"{}\" is not a host name or address", escape_terminal(host));
      return std::nullopt;
    }
  }
  // An IPv6 address goes in brackets in a URL.
  if (host_part.find(':') != std::string::npos && host_part.front() != '[') host_part = "[" + host_part + "]";

  Credentials creds;
  creds.origin = "in-cluster (" + secrets_dir + ")";
  creds.server = fmt::format("https://{}:{}", host_part, port_number);
  creds.token_file = secrets_dir + "/token";
  creds.ca_file = secrets_dir + "/ca.crt";
  std::string why;
  if (!read_small_file(creds.token_file, kMaxCredentialFileBytes, &why) ||
      !read_small_file(creds.ca_file, kMaxCredentialFileBytes, &why)) {
    if (error) *error = "in-cluster credentials: " + why;
    return std::nullopt;
  }
  return creds;
}

std::optional<Credentials> kubeconfig_credentials(const std::string& path, std::string* error) {
  try {
    KubeconfigReader reader(path, error);
    return reader.read();
  } catch (const std::exception& e) {
    // yaml-cpp throws on conversions the reader did not foresee.
    if (error) *error = fmt::format("kubeconfig {}: {}", path, e.what());
    return std::nullopt;
  }
}

}  // namespace fracgpu::kube

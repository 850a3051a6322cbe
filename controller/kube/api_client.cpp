#include "kube/api_client.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <curl/curl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/text_escape.h"
#include "kube/kubeconfig.h"

namespace fracgpu::kube {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using controller::escape_terminal;

// A list of every slice in a large cluster can be big; anything past this is
// not an answer we can use.
constexpr size_t kMaxResponseBytes = 64u << 20;
constexpr size_t kMaxTokenBytes = 64u << 10;
constexpr size_t kMaxIdleHandles = 4;
constexpr const char* kUserAgent = "fracgpu-kubelet-plugin";

void global_init_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  return s.substr(start);
}

const char* reason_phrase(long status) {
  switch (status) {
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 413: return "Request Entity Too Large";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "";
  }
}

// "HTTP 403 Forbidden: <message>": the API answers errors with a Status object
// whose message says what was refused and why; other bodies (a proxy's page)
// are quoted, cut short. Server text is escaped before it reaches a log.
std::string describe_http_error(long status, const std::string& body) {
  std::string head = fmt::format("HTTP {}", status);
  if (const char* phrase = reason_phrase(status); *phrase) head += std::string(" ") + phrase;
  auto parsed = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object() && parsed.value("kind", "") == "Status") {
    std::string message = parsed.contains("message") && parsed["message"].is_string() ? parsed["message"].get<std::string>() : "";
    std::string reason = parsed.contains("reason") && parsed["reason"].is_string() ? parsed["reason"].get<std::string>() : "";
    if (message.size() > 1024) message.resize(1024);
    if (!reason.empty() && reason != reason_phrase(status)) head += " (" + escape_terminal(reason) + ")";
    return message.empty() ? head : head + ": " + escape_terminal(message);
  }
  if (body.empty()) return head;
  return head + ": " + escape_terminal(body.substr(0, 200)) + (body.size() > 200 ? "..." : "");
}

// Transport failures that another attempt cannot mend: the server's certificate
// is not trusted, ours is unusable, the URL is wrong, the answer too large.
bool transport_error_is_final(CURLcode code) {
  switch (code) {
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT:
    case CURLE_NOT_BUILT_IN:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_CRL_BADFILE:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
    case CURLE_WRITE_ERROR:
    case CURLE_FILESIZE_EXCEEDED:
    case CURLE_OUT_OF_MEMORY:
    case CURLE_BAD_FUNCTION_ARGUMENT:
    case CURLE_UNKNOWN_OPTION:
      return true;
    default:
      return false;
  }
}

bool http_status_is_retried(long status) {
  return status == 429 || (status >= 500 && status != 501 && status != 505);
}

// Retry-After: delta-seconds or an HTTP date; nullopt when absent or unreadable.
std::optional<milliseconds> parse_retry_after(const std::string& value) {
  std::string v = trim(value);
  if (v.empty()) return std::nullopt;
  if (std::all_of(v.begin(), v.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    if (v.size() > 6) return milliseconds(999'999'000);
    return milliseconds(std::stol(v) * 1000);
  }
  time_t when = curl_getdate(v.c_str(), nullptr);
  if (when < 0) return std::nullopt;
  auto delta = std::chrono::system_clock::from_time_t(when) - std::chrono::system_clock::now();
  return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(delta));
}

struct Attempt {
  CURLcode code = CURLE_OK;
  long status = 0;
  std::string body;
  std::string transport_error;
  std::optional<milliseconds> retry_after;
  bool too_large = false;
};

size_t on_body(char* data, size_t size, size_t count, void* user) {
  auto* attempt = static_cast<Attempt*>(user);
  size_t n = size * count;
  if (attempt->body.size() + n > kMaxResponseBytes) {
    attempt->too_large = true;
    return 0;  // aborts the transfer (CURLE_WRITE_ERROR)
  }
  attempt->body.append(data, n);
  return n;
}

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* attempt = static_cast<Attempt*>(user);
  size_t n = size * count;
  std::string_view line(data, n);
  constexpr std::string_view kName = "retry-after:";
  if (line.size() > kName.size()) {
    bool match = true;
    for (size_t i = 0; i < kName.size() && match; ++i)
      match = std::tolower(static_cast<unsigned char>(line[i])) == kName[i];
    if (match) attempt->retry_after = parse_retry_after(std::string(line.substr(kName.size())));
  }
  return n;
}

curl_blob blob_of(const std::string& pem) {
  curl_blob blob{};
  blob.data = const_cast<char*>(pem.data());
  blob.len = pem.size();
  blob.flags = CURL_BLOB_COPY;
  return blob;
}

}  // namespace

struct ApiClient::Impl {
  Credentials creds;
  std::mutex mutex;  // everything below
  std::shared_ptr<spdlog::logger> log = spdlog::default_logger();
  RetryPolicy policy;
  std::vector<CURL*> idle;
  // The token file's identity when last read: a projected token is replaced
  // (a new inode behind a symlink), a hand-written one rewritten in place.
  std::string token;
  bool token_read = false;
  struct stat token_stat {};

  ~Impl() {
    for (CURL* handle : idle) curl_easy_cleanup(handle);
  }

  CURL* take_handle() {
    {
      std::lock_guard lock(mutex);
      if (!idle.empty()) {
        CURL* handle = idle.back();
        idle.pop_back();
        return handle;
      }
    }
    return curl_easy_init();
  }

  void give_back(CURL* handle) {
    // reset() clears the options and keeps the connection and TLS session
    // caches, so the next call reuses the connection.
    curl_easy_reset(handle);
    std::lock_guard lock(mutex);
    if (idle.size() < kMaxIdleHandles) {
      idle.push_back(handle);
      return;
    }
    curl_easy_cleanup(handle);
  }

  // The bearer token now: re-read when the file's identity changed (or when
  // `force`, after a 401). A file that cannot be read keeps the last token.
  std::optional<std::string> current_token(bool force, std::string* error) {
    if (creds.token_file.empty()) return creds.token;
    std::lock_guard lock(mutex);
    struct stat st {};
    bool stat_ok = ::stat(creds.token_file.c_str(), &st) == 0;
    bool changed = !token_read || !stat_ok || st.st_ino != token_stat.st_ino || st.st_dev != token_stat.st_dev ||
                   st.st_size != token_stat.st_size || st.st_mtim.tv_sec != token_stat.st_mtim.tv_sec ||
                   st.st_mtim.tv_nsec != token_stat.st_mtim.tv_nsec;
    if (!changed && !force) return token;
    std::string why;
    auto text = read_small_file(creds.token_file, kMaxTokenBytes, &why);
    if (!text) {
      if (token_read) {
        log->warn("token file {}: keeping the token read before", why);
        return token;
      }
      *error = "token file " + why;
      return std::nullopt;
    }
    token = trim(*text);
    token_read = true;
    if (stat_ok) token_stat = st;
    return token;
  }

  Attempt perform(CURL* handle, const char* method, const std::string& url, const std::string* body,
                  const char* content_type, const std::string& bearer, milliseconds timeout,
                  milliseconds connect_timeout) {
    Attempt attempt;
    char error_buffer[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(handle, CURLOPT_URL, url.c_str());
    curl_easy_setopt(handle, CURLOPT_PROTOCOLS_STR, "https,http");
    curl_easy_setopt(handle, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(handle, CURLOPT_ERRORBUFFER, error_buffer);
    curl_easy_setopt(handle, CURLOPT_USERAGENT, kUserAgent);
    curl_easy_setopt(handle, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<int64_t>(1, timeout.count())));
    curl_easy_setopt(handle, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::max<int64_t>(1, std::min(timeout, connect_timeout).count())));
    curl_easy_setopt(handle, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(handle, CURLOPT_WRITEDATA, &attempt);
    curl_easy_setopt(handle, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(handle, CURLOPT_HEADERDATA, &attempt);
    curl_easy_setopt(handle, CURLOPT_TCP_KEEPALIVE, 1L);

    if (std::string_view(method) == "GET") {
      curl_easy_setopt(handle, CURLOPT_HTTPGET, 1L);
    } else {
      curl_easy_setopt(handle, CURLOPT_CUSTOMREQUEST, method);
    }
    if (body) {
      curl_easy_setopt(handle, CURLOPT_POSTFIELDS, body->data());
      curl_easy_setopt(handle, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body->size()));
    }

    // TLS: only the CA we were given (not the system's roots too, as
    // client-go), or the system's when none was.
    if (creds.insecure_skip_tls_verify) {
      curl_easy_setopt(handle, CURLOPT_SSL_VERIFYPEER, 0L);
      curl_easy_setopt(handle, CURLOPT_SSL_VERIFYHOST, 0L);
    } else if (!creds.ca_pem.empty()) {
      curl_blob blob = blob_of(creds.ca_pem);
      curl_easy_setopt(handle, CURLOPT_CAINFO_BLOB, &blob);
      curl_easy_setopt(handle, CURLOPT_CAPATH, nullptr);
    } else if (!creds.ca_file.empty()) {
      curl_easy_setopt(handle, CURLOPT_CAINFO, creds.ca_file.c_str());
      curl_easy_setopt(handle, CURLOPT_CAPATH, nullptr);
    }
    if (!creds.client_cert_pem.empty()) {
      curl_blob blob = blob_of(creds.client_cert_pem);
      curl_easy_setopt(handle, CURLOPT_SSLCERT_BLOB, &blob);
    } else if (!creds.client_cert_file.empty()) {
      curl_easy_setopt(handle, CURLOPT_SSLCERT, creds.client_cert_file.c_str());
    }
    if (!creds.client_key_pem.empty()) {
      curl_blob blob = blob_of(creds.client_key_pem);
      curl_easy_setopt(handle, CURLOPT_SSLKEY_BLOB, &blob);
    } else if (!creds.client_key_file.empty()) {
      curl_easy_setopt(handle, CURLOPT_SSLKEY, creds.client_key_file.c_str());
    }

    curl_slist* headers = nullptr;
    headers = curl_slist_append(headers, "Accept: application/json");
    headers = curl_slist_append(headers, "Expect:");
    const std::string content_type_header = std::string("Content-Type: ") + content_type;
    if (body) headers = curl_slist_append(headers, content_type_header.c_str());
    std::string authorization;
    if (!bearer.empty()) {
      authorization = "Authorization: Bearer " + bearer;
      headers = curl_slist_append(headers, authorization.c_str());
    }
    curl_easy_setopt(handle, CURLOPT_HTTPHEADER, headers);

    attempt.code = curl_easy_perform(handle);
    curl_slist_free_all(headers);
    if (attempt.code == CURLE_OK) {
      curl_easy_getinfo(handle, CURLINFO_RESPONSE_CODE, &attempt.status);
    } else {
      attempt.status = 0;
      attempt.transport_error =
          attempt.too_large ? fmt::format("the answer is larger than {} bytes", kMaxResponseBytes)
                            : fmt::format("{} ({})", error_buffer[0] ? error_buffer : curl_easy_strerror(attempt.code),
                                          curl_easy_strerror(attempt.code));
    }
    return attempt;
  }
};

ApiClient::ApiClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ApiClient::~ApiClient() = default;

std::unique_ptr<ApiClient> ApiClient::with_credentials(std::optional<Credentials> creds) {
  if (!creds) return nullptr;
  global_init_once();
  auto impl = std::make_unique<Impl>();
  impl->creds = std::move(*creds);
  return std::unique_ptr<ApiClient>(new ApiClient(std::move(impl)));
}

std::unique_ptr<ApiClient> ApiClient::in_cluster(std::string* error, const std::string& secrets_dir) {
  return with_credentials(in_cluster_credentials(secrets_dir, error));
}

std::unique_ptr<ApiClient> ApiClient::from_kubeconfig(const std::string& path, std::string* error) {
  return with_credentials(kubeconfig_credentials(path, error));
}

std::string ApiClient::transport_warning() const {
  const Credentials& c = impl_->creds;
  if (c.server.starts_with("http://"))
    return fmt::format("{}: the API server {} is reached over plain HTTP: its credentials and the node's claims "
                       "travel unencrypted, to whoever answers",
                       c.origin, c.server);
  if (c.insecure_skip_tls_verify)
    return fmt::format("{}: insecure-skip-tls-verify: the API server {} is not verified; its credentials go to "
                       "whoever answers",
                       c.origin, c.server);
  return {};
}

void ApiClient::set_logger(std::shared_ptr<spdlog::logger> log) {
  std::lock_guard lock(impl_->mutex);
  if (log) impl_->log = std::move(log);
}

void ApiClient::set_retry_policy(const RetryPolicy& policy) {
  std::lock_guard lock(impl_->mutex);
  impl_->policy = policy;
}

const std::string& ApiClient::server() const { return impl_->creds.server; }

HttpResult ApiClient::get(const std::string& path) { return call("GET", path, nullptr); }
HttpResult ApiClient::post(const std::string& path, const nlohmann::json& body) { return call("POST", path, &body); }
HttpResult ApiClient::put(const std::string& path, const nlohmann::json& body) { return call("PUT", path, &body); }
HttpResult ApiClient::del(const std::string& path) { return call("DELETE", path, nullptr); }
HttpResult ApiClient::apply(const std::string& path, const nlohmann::json& body) {
  return call("PATCH", path, &body, "application/apply-patch+yaml");
}

HttpResult ApiClient::call(const char* method, const std::string& path, const nlohmann::json* body,
                           const char* content_type) {
  RetryPolicy policy;
  std::shared_ptr<spdlog::logger> log;
  {
    std::lock_guard lock(impl_->mutex);
    policy = impl_->policy;
    log = impl_->log;
  }
  const std::string what = fmt::format("{} {}", method, escape_terminal(path));
  HttpResult result;
  try {
    if (path.empty() || path.front() != '/') {
      result.error = "the path must begin with /";
      log->error("kubernetes API {}: {}", what, result.error);
      return result;
    }
    const std::string url = impl_->creds.server + path;
    std::string payload;
    // Invalid UTF-8 in a string becomes U+FFFD rather than an exception.
    if (body) payload = body->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);

    thread_local std::mt19937_64 random(std::random_device{}());
    const auto deadline = Clock::now() + policy.total_timeout;
    milliseconds backoff = policy.initial_backoff;
    bool token_refreshed = false;
    for (int attempt_number = 1;; ++attempt_number) {
      std::string token_error;
      auto token = impl_->current_token(false, &token_error);
      if (!token) {
        result = HttpResult{0, "", token_error};
        log->error("kubernetes API {}: {}", what, result.error);
        return result;
      }
      auto remaining = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      CURL* handle = impl_->take_handle();
      if (!handle) {
        result = HttpResult{0, "", "cannot create a curl handle"};
        log->error("kubernetes API {}: {}", what, result.error);
        return result;
      }
      Attempt attempt = impl_->perform(handle, method, url, body ? &payload : nullptr, content_type, *token,
                                       std::min(policy.attempt_timeout, remaining), policy.connect_timeout);
      impl_->give_back(handle);

      result.status = attempt.status;
      result.body = std::move(attempt.body);
      result.error.clear();
      bool retry = false;
      if (attempt.status == 0) {
        result.body.clear();
        result.error = attempt.transport_error;
        retry = !transport_error_is_final(attempt.code);
      } else if (!result.ok()) {
        result.error = describe_http_error(attempt.status, result.body);
        retry = http_status_is_retried(attempt.status);
        // A rotated token: the file changed after we read it. Once per call.
        if (attempt.status == 401 && !impl_->creds.token_file.empty() && !token_refreshed) {
          token_refreshed = true;
          std::string ignored;
          auto fresh = impl_->current_token(true, &ignored);
          retry = fresh && *fresh != *token;
        }
      }
      if (result.ok()) {
        if (attempt_number > 1) log->info("kubernetes API {}: succeeded at attempt {}", what, attempt_number);
        return result;
      }
      if (!retry) break;

      // Equal jitter: half the backoff fixed, half random, so that many
      // plugins failing together do not retry together.
      milliseconds wait = backoff / 2 + milliseconds(std::uniform_int_distribution<int64_t>(
                                            0, std::max<int64_t>(0, backoff.count() / 2))(random));
      if (attempt.retry_after) wait = std::max(wait, *attempt.retry_after);
      backoff = std::min(backoff * 2, policy.max_backoff);
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      // An attempt needs time to connect and be answered: one begun at the
      // deadline's edge would end as a timeout and hide the answer we have.
      milliseconds reserve = policy.connect_timeout / 4;
      if (attempt_number >= policy.max_attempts || wait + reserve >= left) {
        result.error += fmt::format(" (gave up after {} attempts{})", attempt_number,
                                    attempt.retry_after && *attempt.retry_after + reserve >= left
                                        ? fmt::format(": the server asked to wait {} ms", attempt.retry_after->count())
                                        : "");
        break;
      }
      log->warn("kubernetes API {}: {}; attempt {} failed, retrying in {} ms", what, result.error, attempt_number,
                wait.count());
      std::this_thread::sleep_for(wait);
    }
  } catch (const std::exception& e) {
    result = HttpResult{0, "", fmt::format("internal error: {}", e.what())};
  }
  // 404 and 409 are answers callers expect and act on (absent, raced): not errors of ours.
  auto level = (result.status == 404 || result.status == 409) ? spdlog::level::info : spdlog::level::err;
  log->log(level, "kubernetes API {}: {}", what, result.error);
  return result;
}

std::string escape_query_value(std::string_view value) {
  std::string out;
  for (unsigned char c : value) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

}  // namespace fracgpu::kube

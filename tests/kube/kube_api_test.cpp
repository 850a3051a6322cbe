// The API-server client against the stand-in API server over HTTPS:
// in-cluster and kubeconfig credentials, retries and backoff, failures
// reported with the HTTP status and the API's message.
#include <stdlib.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "kube/kube_test_util.h"

namespace fracgpu::kube::testing {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

const char* kSlices = "/apis/resource.k8s.io/v1/resourceslices";

// A pod's service-account mount, for the in-cluster constructor.
struct SecretsDir {
  TempDir dir;
  SecretsDir(const std::string& token, const std::string& ca_file) {
    write_file(dir / "token", token + "\n");
    write_file(dir / "ca.crt", read_file(ca_file));
    write_file(dir / "namespace", "fracgpu");
  }
  // As the kubelet rotates a projected token: a new file renamed over the old.
  void rotate(const std::string& token) {
    write_file(dir / "token.new", token + "\n");
    std::filesystem::rename(dir / "token.new", dir / "token");
  }
};

struct ServiceEnv {
  ServiceEnv(const std::string& host, int port) {
    ::setenv("KUBERNETES_SERVICE_HOST", host.c_str(), 1);
    ::setenv("KUBERNETES_SERVICE_PORT", std::to_string(port).c_str(), 1);
  }
  ~ServiceEnv() {
    ::unsetenv("KUBERNETES_SERVICE_HOST");
    ::unsetenv("KUBERNETES_SERVICE_PORT");
  }
};

std::unique_ptr<ApiClient> in_cluster_client(const SecretsDir& secrets) {
  std::string error;
  auto client = ApiClient::in_cluster(&error, secrets.dir.path());
  EXPECT_TRUE(client) << error;
  if (client) client->set_retry_policy(fast_retries());
  return client;
}

std::unique_ptr<ApiClient> kubeconfig_client(const TempDir& dir, const std::string& yaml, std::string* error,
                                             const std::string& name = "config") {
  std::string path = dir / name;
  write_file(path, yaml);
  auto client = ApiClient::from_kubeconfig(path, error);
  if (client) client->set_retry_policy(fast_retries());
  return client;
}

// ---- In-cluster ----

TEST(KubeApiClient, InClusterTalksHttpsWithTokenAndCa) {
  FakeApiServer server({.tokens = {"sa-token-1"}});
  SecretsDir secrets("sa-token-1", server.ca_file());
  ServiceEnv env("127.0.0.1", server.port());
  auto client = in_cluster_client(secrets);
  ASSERT_TRUE(client);
  EXPECT_EQ(client->server(), "https://127.0.0.1:" + std::to_string(server.port()));
  HttpResult result = client->get(kSlices);
  ASSERT_TRUE(result.ok()) << result.error;
  EXPECT_EQ(json::parse(result.body)["kind"], "ResourceSliceList");

  // The token is what made it through: a wrong one is refused.
  SecretsDir wrong("not-the-token", server.ca_file());
  auto refused = in_cluster_client(wrong);
  HttpResult denied = refused->get(kSlices);
  EXPECT_EQ(denied.status, 401);
  EXPECT_NE(denied.error.find("HTTP 401 Unauthorized"), std::string::npos) << denied.error;
}

TEST(KubeApiClient, InClusterBracketsAnIpv6Host) {
  FakeApiServer server({.host = "::1", .tokens = {"t"}});
  SecretsDir secrets("t", server.ca_file());
  ServiceEnv env("::1", server.port());
  auto client = in_cluster_client(secrets);
  ASSERT_TRUE(client);
  EXPECT_EQ(client->server(), "https://[::1]:" + std::to_string(server.port()));
  HttpResult result = client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
}

// A server that takes only the token in a file of the test's, and a client
// in a pod whose service-account token starts out the same.
struct TokenFileServer {
  TempDir scratch;
  std::string accepted = scratch / "accepted-token";
  std::unique_ptr<FakeApiServer> server;
  std::unique_ptr<SecretsDir> secrets;
  std::unique_ptr<ServiceEnv> env;
  std::unique_ptr<ApiClient> client;

  explicit TokenFileServer(const std::string& token) {
    write_file(accepted, token);
    server = std::make_unique<FakeApiServer>(FakeApiServerOptions{.token_file = accepted});
    secrets = std::make_unique<SecretsDir>(token, server->ca_file());
    env = std::make_unique<ServiceEnv>("127.0.0.1", server->port());
    client = in_cluster_client(*secrets);
  }
  json requests() { return api_requests(*control_client(*server, scratch)); }
};

TEST(KubeApiClient, InClusterRereadsARotatedToken) {
  TokenFileServer t("first");
  ASSERT_TRUE(t.client);
  ASSERT_TRUE(t.client->get(kSlices).ok());

  // The server now takes only the new token: the client must have read it,
  // before sending (the file changed), not after a refusal.
  write_file(t.accepted, "second");
  t.secrets->rotate("second");
  HttpResult result = t.client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
  json requests = t.requests();
  ASSERT_EQ(requests.size(), 2u);
  EXPECT_EQ(requests[1]["status"], 200);
}

TEST(KubeApiClient, ARefusedTokenIsReadAgainOnce) {
  TokenFileServer t("aaaa");
  ASSERT_TRUE(t.client);
  ASSERT_TRUE(t.client->get(kSlices).ok());

  // Rewritten in place, same size, same time stamps: nothing tells the
  // client it changed until the server refuses the old token.
  std::string token_path = t.secrets->dir / "token";
  struct stat before {};
  ASSERT_EQ(::stat(token_path.c_str(), &before), 0);
  write_file(t.accepted, "bbbb");
  write_file(token_path, "bbbb\n");
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, token_path.c_str(), times, 0), 0);
  HttpResult result = t.client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
  json requests = t.requests();
  ASSERT_EQ(requests.size(), 3u);
  EXPECT_EQ(requests[1]["status"], 401);
  EXPECT_EQ(requests[2]["status"], 200);

  // A token that is simply wrong is refused once, not retried.
  write_file(t.accepted, "cccc");
  EXPECT_EQ(t.client->get(kSlices).status, 401);
  EXPECT_EQ(t.requests().size(), 4u);
}

TEST(KubeApiClient, InClusterRefusesWhatIsMissing) {
  std::string error;
  ::unsetenv("KUBERNETES_SERVICE_HOST");
  ::unsetenv("KUBERNETES_SERVICE_PORT");
  EXPECT_FALSE(ApiClient::in_cluster(&error, "/nonexistent"));
  EXPECT_NE(error.find("KUBERNETES_SERVICE_HOST"), std::string::npos) << error;

  ServiceEnv env("10.0.0.1", 443);
  TempDir empty;
  EXPECT_FALSE(ApiClient::in_cluster(&error, empty.path()));
  EXPECT_NE(error.find(empty / "token"), std::string::npos) << error;

  ServiceEnv bad_port("10.0.0.1", 0);
  ::setenv("KUBERNETES_SERVICE_PORT", "https", 1);
  EXPECT_FALSE(ApiClient::in_cluster(&error, empty.path()));
  EXPECT_NE(error.find("KUBERNETES_SERVICE_PORT"), std::string::npos) << error;
}

TEST(KubeApiClient, AnUntrustedServerIsRefusedAtOnce) {
  FakeApiServer server({.tokens = {"t"}});
  FakeApiServer other;  // another CA
  SecretsDir secrets("t", other.ca_file());
  ServiceEnv env("127.0.0.1", server.port());
  auto client = in_cluster_client(secrets);
  ASSERT_TRUE(client);
  auto start = Clock::now();
  HttpResult result = client->get(kSlices);
  EXPECT_EQ(result.status, 0);
  EXPECT_NE(result.error.find("certificate"), std::string::npos) << result.error;
  // Not retried: a certificate does not become trusted by waiting.
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
  TempDir scratch;
  EXPECT_EQ(api_requests(*control_client(server, scratch)).size(), 0u);
}

// ---- Kubeconfig ----

TEST(KubeApiClient, KubeconfigTokenAndRelativeCaFile) {
  FakeApiServer server({.tokens = {"kc-token"}});
  TempDir dir;
  write_file(dir / "certs/ca.pem", read_file(server.ca_file()));
  std::string error;
  // A relative path is relative to the kubeconfig's folder, not the working directory.
  auto client = kubeconfig_client(
      dir,
      kubeconfig_yaml("      server: " + server.url() + "/\n      certificate-authority: certs/ca.pem\n",
                      "      token: kc-token\n"),
      &error);
  ASSERT_TRUE(client) << error;
  EXPECT_EQ(client->server(), server.url());  // trailing slash dropped
  HttpResult result = client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
}

TEST(KubeApiClient, KubeconfigCaDataAndTokenFile) {
  FakeApiServer server({.tokens = {"from-file"}});
  TempDir dir;
  write_file(dir / "token", "from-file\n");
  std::string error;
  auto client = kubeconfig_client(dir,
                                  kubeconfig_yaml("      server: " + server.url() +
                                                      "\n      certificate-authority-data: " +
                                                      base64(read_file(server.ca_file())) + "\n",
                                                  "      tokenFile: token\n"),
                                  &error);
  ASSERT_TRUE(client) << error;
  HttpResult result = client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
}

TEST(KubeApiClient, KubeconfigClientCertificateDataAndFiles) {
  // No token accepted: only the client certificate can get us in.
  FakeApiServer server({.client_ca = true});
  TempDir dir;
  std::string error;
  auto with_data = kubeconfig_client(
      dir,
      kubeconfig_yaml("      server: " + server.url() + "\n      certificate-authority: " + server.ca_file() + "\n",
                      "      client-certificate-data: " + base64(read_file(server.client_cert_file())) +
                          "\n      client-key-data: " + base64(read_file(server.client_key_file())) + "\n"),
      &error, "with-data");
  ASSERT_TRUE(with_data) << error;
  HttpResult result = with_data->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;

  auto with_files = kubeconfig_client(
      dir,
      kubeconfig_yaml("      server: " + server.url() + "\n      certificate-authority: " + server.ca_file() + "\n",
                      "      client-certificate: " + server.client_cert_file() +
                          "\n      client-key: " + server.client_key_file() + "\n"),
      &error, "with-files");
  ASSERT_TRUE(with_files) << error;
  result = with_files->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;

  auto without = kubeconfig_client(
      dir, kubeconfig_yaml("      server: " + server.url() + "\n      certificate-authority: " + server.ca_file() + "\n",
                           "      {}\n"),
      &error, "without");
  ASSERT_TRUE(without) << error;
  EXPECT_EQ(without->get(kSlices).status, 401);
}

TEST(KubeApiClient, KubeconfigInsecureSkipTlsVerify) {
  FakeApiServer server({.tokens = {"t"}});
  TempDir dir;
  std::string error;
  auto client = kubeconfig_client(
      dir, kubeconfig_yaml("      server: " + server.url() + "\n      insecure-skip-tls-verify: true\n",
                           "      token: t\n"),
      &error);
  ASSERT_TRUE(client) << error;
  EXPECT_TRUE(client->get(kSlices).ok());
  // Said, for the plugin's log: the token goes to whoever answers.
  EXPECT_NE(client->transport_warning().find("insecure-skip-tls-verify: the API server " + server.url() +
                                             " is not verified"),
            std::string::npos)
      << client->transport_warning();
  auto plain = kubeconfig_client(dir, kubeconfig_yaml("      server: http://127.0.0.1:1\n", "      token: t\n"), &error,
                                 "plain");
  ASSERT_TRUE(plain) << error;
  EXPECT_NE(plain->transport_warning().find("is reached over plain HTTP"), std::string::npos);
  auto verified = kubeconfig_client(
      dir, kubeconfig_yaml("      server: " + server.url() + "\n      certificate-authority: " + server.ca_file() + "\n",
                           "      token: t\n"),
      &error, "verified");
  ASSERT_TRUE(verified) << error;
  EXPECT_EQ(verified->transport_warning(), "");
}

TEST(KubeApiClient, KubeconfigErrorsNameTheFileAndField) {
  TempDir dir;
  std::string error;
  auto refused = [&](const std::string& yaml, const std::string& expect) {
    error.clear();
    std::string path = dir / "bad";
    EXPECT_FALSE(kubeconfig_client(dir, yaml, &error, "bad")) << yaml;
    EXPECT_NE(error.find(path), std::string::npos) << error;
    EXPECT_NE(error.find(expect), std::string::npos) << "expected \"" << expect << "\" in: " << error;
  };
  const std::string cluster = "      server: https://127.0.0.1:6443\n";
  refused(kubeconfig_yaml(cluster, "      exec:\n        command: aws\n"), "users[0].user.exec");
  refused(kubeconfig_yaml(cluster, "      username: admin\n"), "users[0].user.username");
  refused(kubeconfig_yaml(cluster, "      client-certificate-data: \"@@@\"\n      client-key-data: a2V5\n"),
          "users[0].user.client-certificate-data: not base64");
  refused(kubeconfig_yaml(cluster, "      client-certificate: c.pem\n"), "client-certificate without client-key");
  refused(kubeconfig_yaml(cluster, "      tokenFile: missing-token\n"), "users[0].user.tokenFile");
  refused(kubeconfig_yaml("      server: 127.0.0.1:6443\n", "      token: t\n"), "clusters[0].cluster.server");
  refused(kubeconfig_yaml(cluster + "      insecure-skip-tls-verify: maybe\n", "      token: t\n"),
          "insecure-skip-tls-verify: expected true or false");
  refused(kubeconfig_yaml(cluster + "      insecure-skip-tls-verify: true\n      certificate-authority: ca\n",
                          "      token: t\n"),
          "both set");
  refused("apiVersion: v1\nclusters: []\n", "current-context: is not set");
  refused("current-context: prod\ncontexts:\n  - name: test\n    context: {cluster: a}\n", "contexts: no entry named \"prod\"");
  refused("current-context: test\ncontexts:\n  - name: test\n    context: {cluster: gone, user: u}\n",
          "clusters: no entry named \"gone\"");
  refused("current-context: test\ncontexts: [ {name: test\n", "line ");
  refused("- just\n- a list\n", "expected a YAML mapping");
  EXPECT_FALSE(ApiClient::from_kubeconfig(dir / "absent", &error));
  EXPECT_NE(error.find("No such file"), std::string::npos) << error;
}

TEST(KubeApiClient, Base64Decoding) {
  std::string why;
  EXPECT_EQ(decode_base64("aGVsbG8=", &why), "hello");
  EXPECT_EQ(decode_base64("aGVsbG8", &why), "hello");  // padding optional
  EXPECT_EQ(decode_base64("aGVs\nbG8h", &why), "hello!");
  EXPECT_EQ(decode_base64("", &why), "");
  EXPECT_FALSE(decode_base64("aGV*", &why));
  EXPECT_NE(why.find("offset 3"), std::string::npos) << why;
  EXPECT_FALSE(decode_base64("aGVsbA=x", &why));
  EXPECT_FALSE(decode_base64("a", &why));
  EXPECT_EQ(base64("\x01\xff\x10z"), "Af8Qeg==");
  EXPECT_EQ(decode_base64(base64(std::string("\0\x80\xfe", 3)), &why), std::string("\0\x80\xfe", 3));
}

// ---- Retries, backoff, failures ----

using KubeApiClientCalls = StandInServerTest;

TEST_F(KubeApiClientCalls, ServerErrorsTwiceThenSuccess) {
  start();
  fail_next("GET", "resourceslices", 500, 2);
  HttpResult result = client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
  json requests = api_requests(*control);
  ASSERT_EQ(requests.size(), 3u);
  EXPECT_EQ(requests[0]["status"], 500);
  EXPECT_EQ(requests[1]["status"], 500);
  EXPECT_EQ(requests[2]["status"], 200);
  EXPECT_NE(log.text().find("attempt 2 failed"), std::string::npos) << log.text();
}

TEST_F(KubeApiClientCalls, TooManyRequestsHonoursRetryAfter) {
  start();
  fail_next("GET", "resourceslices", 429, 1, 1);
  auto begin = Clock::now();
  HttpResult result = client->get(kSlices);
  EXPECT_TRUE(result.ok()) << result.error;
  // The backoff alone would be ~20 ms; the server asked for a second.
  EXPECT_GE(Clock::now() - begin, milliseconds(950));
  EXPECT_EQ(api_requests(*control).size(), 2u);
}

TEST_F(KubeApiClientCalls, BackoffGrowsBetweenAttempts) {
  start();
  RetryPolicy policy = fast_retries();
  policy.initial_backoff = milliseconds(100);
  policy.max_backoff = milliseconds(400);
  client->set_retry_policy(policy);
  fail_next("GET", "resourceslices", 503, 3);
  auto begin = Clock::now();
  EXPECT_TRUE(client->get(kSlices).ok());
  // Waits of [50,100] + [100,200] + [200,400] ms: at least 350 in all.
  EXPECT_GE(Clock::now() - begin, milliseconds(350));
  EXPECT_EQ(api_requests(*control).size(), 4u);
}

TEST_F(KubeApiClientCalls, GivesUpAtTheDeadline) {
  start();
  RetryPolicy policy = fast_retries();
  policy.total_timeout = milliseconds(800);
  policy.max_attempts = 1000;
  client->set_retry_policy(policy);
  fail_next("PUT", "resourceslices/x", 503, 100000);
  auto begin = Clock::now();
  HttpResult result = client->put(std::string(kSlices) + "/x", json{{"metadata", {{"name", "x"}}}});
  auto took = Clock::now() - begin;
  EXPECT_EQ(result.status, 503);
  EXPECT_NE(result.error.find("gave up after"), std::string::npos) << result.error;
  EXPECT_LT(took, milliseconds(2500));
  EXPECT_GE(api_requests(*control).size(), 3u);
  // The final failure is logged with the method, path, status and message.
  EXPECT_NE(log.text().find("PUT /apis/resource.k8s.io/v1/resourceslices/x: HTTP 503 Service Unavailable"),
            std::string::npos)
      << log.text();
}

TEST_F(KubeApiClientCalls, ARetryAfterBeyondTheDeadlineEndsAtOnce) {
  start();
  RetryPolicy policy = fast_retries();
  policy.total_timeout = milliseconds(3000);
  client->set_retry_policy(policy);
  fail_next("GET", "resourceslices", 429, 5, 60);
  auto begin = Clock::now();
  HttpResult result = client->get(kSlices);
  EXPECT_EQ(result.status, 429);
  EXPECT_NE(result.error.find("the server asked to wait 60000 ms"), std::string::npos) << result.error;
  EXPECT_LT(Clock::now() - begin, milliseconds(1500));
}

TEST_F(KubeApiClientCalls, ForbiddenSurfacesStatusAndMessageWithoutRetry) {
  start();
  const std::string message =
      "resourceslices.resource.k8s.io is forbidden: User \"system:serviceaccount:fracgpu:plugin\" cannot create "
      "resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope";
  fail_next("POST", "resourceslices", 403, 1, std::nullopt, message);
  HttpResult result = client->post(kSlices, json::object());
  EXPECT_EQ(result.status, 403);
  EXPECT_EQ(result.error, "HTTP 403 Forbidden: " + message);
  EXPECT_EQ(json::parse(result.body)["reason"], "Forbidden");
  EXPECT_EQ(api_requests(*control).size(), 1u);
  std::string logged = log.text();
  EXPECT_NE(logged.find("POST /apis/resource.k8s.io/v1/resourceslices: HTTP 403 Forbidden: " + message),
            std::string::npos)
      << logged;
  EXPECT_NE(logged.find("[error]"), std::string::npos) << logged;
}

TEST_F(KubeApiClientCalls, NotFoundIsAnAnswerNotAnError) {
  start();
  HttpResult result = client->get("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/absent");
  EXPECT_EQ(result.status, 404);
  EXPECT_NE(result.error.find("HTTP 404 Not Found (NotFound): resourceclaims.resource.k8s.io \"absent\" not found"),
            std::string::npos)
      << result.error;
  EXPECT_EQ(api_requests(*control).size(), 1u);
  EXPECT_NE(log.text().find("[info]"), std::string::npos) << log.text();
}

TEST_F(KubeApiClientCalls, ServesClaimsFromFixtures) {
  TempDir fixtures;
  json claim = {{"apiVersion", "resource.k8s.io/v1"},
                {"kind", "ResourceClaim"},
                {"metadata", {{"name", "half-gpu"}, {"namespace", "team-a"}, {"uid", "3f2c"}}}};
  write_file(fixtures / "team-a/half-gpu.json", claim.dump());
  start({.fixtures = fixtures.path()});
  HttpResult result = client->get("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/half-gpu");
  ASSERT_TRUE(result.ok()) << result.error;
  EXPECT_EQ(json::parse(result.body), claim);
}

TEST_F(KubeApiClientCalls, UnreachableServerIsRetriedThenReported) {
  start();
  int port = server->port();
  server->stop();  // nothing listens there now
  RetryPolicy policy = fast_retries();
  policy.total_timeout = milliseconds(1500);
  // The time left decides when it gives up, not the attempt count: ten
  // attempts' jittered waits sum to 370-740 ms, which made the 500 ms below
  // a coin toss.
  policy.max_attempts = 1000;
  client->set_retry_policy(policy);
  auto begin = Clock::now();
  HttpResult result = client->get(kSlices);
  auto took = Clock::now() - begin;
  EXPECT_EQ(result.status, 0);
  EXPECT_NE(result.error.find("gave up after"), std::string::npos) << result.error;
  EXPECT_NE(result.error.find(std::to_string(port)), std::string::npos) << result.error;
  // Retried, with waits between, until too little time was left for another
  // attempt (connect_timeout / 4 = 500 ms), and no longer.
  EXPECT_NE(log.text().find("attempt 3 failed"), std::string::npos) << log.text();
  EXPECT_GE(took, milliseconds(500));
  EXPECT_LT(took, milliseconds(1500));
}

TEST_F(KubeApiClientCalls, ConcurrentCallsFromManyThreads) {
  start();
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) ok += client->get(kSlices).ok() ? 1 : 0;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 80);
}

TEST_F(KubeApiClientCalls, InvalidUtf8InABodyDoesNotThrow) {
  start();
  json body = {{"metadata", {{"name", std::string("bad\xff\xfe")}}}};
  HttpResult result = client->post(kSlices, body);
  EXPECT_EQ(result.status, 422);  // refused by the server's validation, not by an exception here
}

TEST(KubeApiClient, EscapesQueryValues) {
  EXPECT_EQ(escape_query_value("spec.nodeName=node-1,spec.driver=gpu.fracgpu.io"),
            "spec.nodeName%3Dnode-1%2Cspec.driver%3Dgpu.fracgpu.io");
  EXPECT_EQ(escape_query_value("a b&c/~"), "a%20b%26c%2F~");
}

TEST(KubeApiClient, APathMustBeAbsolute) {
  FakeApiServer server({.tokens = {"t"}});
  TempDir dir;
  auto client = control_client(server, dir);
  HttpResult result = client->get("apis/x");
  EXPECT_EQ(result.status, 0);
  EXPECT_NE(result.error.find("must begin with /"), std::string::npos);
}

}  // namespace
}  // namespace fracgpu::kube::testing

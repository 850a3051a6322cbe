// fracgpu-kubelet-plugin end to end, without a cluster: the real plugin
// binary and the real fracgpud on the simulated driver (simcuda, simnvml),
// the stand-in API server (fake_apiserver.py: serves the claims, records the
// slice writes) and a stand-in kubelet here (a gRPC client built from the
// same protos: registration GetInfo + NotifyRegistrationStatus, then
// NodePrepareResources / NodeUnprepareResources on the socket GetInfo named).
// A "container" is a process in a private mount namespace with the CDI
// spec's mounts and environment applied by this test.
#include <dlfcn.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "control/client.h"
#include "controller_test_util.h"
#include "dra_health_v1alpha1.grpc.pb.h"
#include "dra_v1.grpc.pb.h"
#include "kube/kube_test_util.h"
#include "kube_plugin/claim_status.h"
#include "kube_plugin/driver.h"
#include "pluginregistration_v1.grpc.pb.h"

using namespace fracgpu;
using namespace fracgpu::testing;
using namespace std::chrono_literals;
using fracgpu::kube::testing::FakeApiServer;
using fracgpu::kube::testing::FakeApiServerOptions;
using nlohmann::json;
namespace fs = std::filesystem;
namespace dra = k8s::io::kubelet::pkg::apis::dra::v1;
namespace reg = pluginregistration;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr const char* kNode = "node-1";
const std::vector<std::string> kUuids = {"GPU-c0a7801a-0000-4000-8000-00000000000a",
                                         "GPU-c0a7801a-0000-4000-8000-00000000000b",
                                         "GPU-c0a7801a-0000-4000-8000-00000000000c"};
// Three simulated 16 GiB GPUs.
const std::string kDevices = "uuid=" + kUuids[0] + ",name=Sim H,mem=16GiB,ctx=64MiB,cc=9.0;uuid=" + kUuids[1] +
                             ",name=Sim H,mem=16GiB,ctx=64MiB,cc=9.0;uuid=" + kUuids[2] +
                             ",name=Sim H,mem=16GiB,ctx=64MiB,cc=9.0";
// Where the test's containers find the interposer (under /run: the
// container's /run is a tmpfs of its own).
constexpr const char* kContainerLibrary = "/run/fracgpu-lib/libfracgpu.so";

std::string uid_of(int n) { return fmt::format("{:08d}-aaaa-4bbb-8ccc-dddddddddddd", n); }

json result(const std::string& device, json consumed = nullptr, const std::string& request = "gpu") {
  json r = {{"request", request}, {"driver", "gpu.fracgpu.io"}, {"pool", kNode}, {"device", device}};
  if (!consumed.is_null()) r["consumedCapacity"] = std::move(consumed);
  return r;
}

// A YAML node as the API server reads it into JSON: plain scalars that are
// integers or booleans become numbers and booleans, the rest strings.
json yaml_to_json(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& kv : node) out[kv.first.as<std::string>()] = yaml_to_json(kv.second);
      return out;
    }
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& item : node) out.push_back(yaml_to_json(item));
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string text = node.Scalar();
      if (node.Tag() == "?") {
        if (text == "true" || text == "false") return text == "true";
        if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos && text.size() < 18)
          return std::stoll(text);
      }
      return text;
    }
    default:
      return nullptr;
  }
}

// The documents of a manifest under deploy/.
std::vector<json> manifest(const std::string& relative) {
  std::vector<json> out;
  for (const YAML::Node& doc : YAML::LoadAllFromFile(std::string(DEPLOY_DIR) + "/" + relative))
    if (doc.IsMap()) out.push_back(yaml_to_json(doc));
  return out;
}

class KubePluginE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    chmod(tmp_.path().c_str(), 0755);
    write_file(faults_path_, "");
    write_file(config_path_, "[daemon]\nrun_dir = \"" + run_dir_ +
                                 "\"\nreap_interval_ms = 50\nlog_level = \"debug\"\nmetrics_address = \"off\"\n"
                                 "health_interval = \"50ms\"\n"
                                 "[[gpu]]\nindex = 0\ncontext_memory = \"64MiB\"\n"
                                 "[[gpu]]\nindex = 1\ncontext_memory = \"64MiB\"\n"
                                 "[[gpu]]\nindex = 2\ncontext_memory = \"64MiB\"\n");
    start_daemon();
    fs::create_directories(claims_dir_);
    FakeApiServerOptions options;
    options.tokens = {"t"};
    options.fixtures = claims_dir_;
    api_ = std::make_unique<FakeApiServer>(options);
    write_file(kubeconfig_,
               kube::testing::kubeconfig_yaml(
                   "      server: " + api_->url() + "\n      certificate-authority: " + api_->ca_file() + "\n",
                   "      token: t\n"));
    api_control_ = kube::testing::control_client(*api_, tmp_);
  }

  void TearDown() override {
    for (pid_t pid : children_) kill_and_reap(pid);
    kill_and_reap(plugin_);
    kill_and_reap(daemon_);
    if (HasFailure() || getenv("FRACGPU_TEST_SHOW_LOGS")) {
      std::cerr << "---- plugin log\n" << read_file(plugin_log_) << "---- fracgpud log (tail)\n";
      const std::string daemon_log = read_file(daemon_log_);
      std::cerr << daemon_log.substr(daemon_log.size() > 4000 ? daemon_log.size() - 4000 : 0);
    }
  }

  pid_t spawn(const std::vector<std::string>& args, const std::string& log, const std::vector<std::string>& env = {}) {
    std::vector<std::string> all = {std::string("LD_LIBRARY_PATH=") + SIMNVML_DIR + ":" + SIMCUDA_DIR,
                                    "SIMCUDA_DEVICES=" + devices_, "SIMCUDA_STATE", "SIMNVML_FAULTS=" + faults_path_,
                                    std::string(kube_plugin::kCrashEnv)};
    all.insert(all.end(), env.begin(), env.end());
    return spawn_logged(args, log, all);
  }

  void start_daemon() {
    const size_t before = read_file(daemon_log_).size();
    daemon_ = spawn({FRACGPUD_PATH, "--config", config_path_}, daemon_log_);
    ASSERT_TRUE(eventually(
        [&] { return read_file(daemon_log_).find("control API: listening on", before) != std::string::npos; }, 10s))
        << read_file(daemon_log_);
  }

  void stop_daemon() {
    kill(daemon_, SIGTERM);
    EXPECT_EQ(wait_exit(daemon_, 10s), 0);
    daemon_ = -1;
  }

  std::vector<std::string> plugin_args() const {
    return {PLUGIN_PATH,
            std::string("--node-name=") + kNode,
            "--run-dir=" + run_dir_,
            "--plugin-dir=" + plugin_dir_,
            "--registry-dir=" + registry_dir_,
            "--cdi-dir=" + cdi_dir_,
            std::string("--library-host-path=") + FRACGPU_LIB,
            "--library-container-path=" + library_container_path_,
            "--device-nodes=nvidia-cdi",
            "--slice-interval=" + slice_interval_,
            "--kubeconfig=" + kubeconfig_};
  }

  // Starts the plugin (with the crash hook at `crash`, if any) and registers
  // it as the kubelet does.
  // The kubelet's health stream on the plugin's DRA socket, open for `for_at_most`.
  std::unique_ptr<grpc::ClientReader<v1alpha1::NodeWatchResourcesResponse>> watch_health(
      grpc::ClientContext* context, std::chrono::seconds for_at_most) {
    health_stub_ = v1alpha1::DRAResourceHealth::NewStub(
        grpc::CreateChannel("unix:" + plugin_dir_ + "/dra.sock", grpc::InsecureChannelCredentials()));
    context->set_deadline(std::chrono::system_clock::now() + for_at_most);
    return health_stub_->NodeWatchResources(context, v1alpha1::NodeWatchResourcesRequest());
  }

  void start_plugin(const std::string& crash = "") {
    const size_t before = read_file(plugin_log_).size();
    std::vector<std::string> env;
    if (!crash.empty()) env.push_back(std::string(kube_plugin::kCrashEnv) + "=" + crash);
    plugin_ = spawn(plugin_args(), plugin_log_, env);
    ASSERT_TRUE(eventually(
        [&] { return read_file(plugin_log_).find("serving v1.DRAPlugin", before) != std::string::npos; }, 10s))
        << read_file(plugin_log_);
    register_plugin();
  }

  void stop_plugin() {
    kill(plugin_, SIGTERM);
    EXPECT_EQ(wait_exit(plugin_, 10s), 0);
    plugin_ = -1;
  }

  // Starts the plugin with the crash hook at `point` and asks it to prepare
  // `claim`: it dies in the call.
  void prepare_until_crash(const kube_plugin::ClaimRef& claim, const std::string& point) {
    start_plugin(point);
    grpc::Status status;
    prepare({claim}, &status);
    EXPECT_FALSE(status.ok());
    EXPECT_EQ(wait_exit(plugin_, 10s), kube_plugin::kCrashExitStatus) << read_file(plugin_log_);
    plugin_ = -1;
  }

  // ---- The stand-in kubelet
  reg::PluginInfo register_plugin() {
    auto channel =
        grpc::CreateChannel("unix:" + registry_dir_ + "/gpu.fracgpu.io-reg.sock", grpc::InsecureChannelCredentials());
    auto stub = reg::Registration::NewStub(channel);
    reg::PluginInfo info;
    {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + 10s);
      const grpc::Status status = stub->GetInfo(&context, reg::InfoRequest(), &info);
      EXPECT_TRUE(status.ok()) << status.error_message();
    }
    reg::RegistrationStatus registered;
    registered.set_plugin_registered(true);
    reg::RegistrationStatusResponse ignored;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    EXPECT_TRUE(stub->NotifyRegistrationStatus(&context, registered, &ignored).ok());
    dra_ = dra::DRAPlugin::NewStub(grpc::CreateChannel("unix:" + info.endpoint(), grpc::InsecureChannelCredentials()));
    return info;
  }

  // A prepare or unprepare request's claims.
  template <class Request>
  static Request request_for(const std::vector<kube_plugin::ClaimRef>& claims) {
    Request request;
    for (const auto& c : claims) {
      dra::Claim* claim = request.add_claims();
      claim->set_namespace_(c.ns);
      claim->set_name(c.name);
      claim->set_uid(c.uid);
    }
    return request;
  }

  // NodePrepareResources for `claims` ({namespace, name, uid}); *status the call's.
  dra::NodePrepareResourcesResponse prepare(const std::vector<kube_plugin::ClaimRef>& claims,
                                            grpc::Status* status = nullptr) {
    const auto request = request_for<dra::NodePrepareResourcesRequest>(claims);
    dra::NodePrepareResourcesResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 30s);
    const grpc::Status s = dra_->NodePrepareResources(&context, request, &response);
    if (status)
      *status = s;
    else
      EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }

  std::string unprepare(const kube_plugin::ClaimRef& c) {
    const auto request = request_for<dra::NodeUnprepareResourcesRequest>({c});
    dra::NodeUnprepareResourcesResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 30s);
    const grpc::Status s = dra_->NodeUnprepareResources(&context, request, &response);
    if (!s.ok()) return "gRPC: " + s.error_message();
    return response.claims().at(c.uid).error();
  }

  // A ResourceClaim the API server serves from now on.
  kube_plugin::ClaimRef write_claim(int n, json results, json configs = json::array()) {
    kube_plugin::ClaimRef ref{"team-a", fmt::format("claim-{}", n), uid_of(n)};
    const json claim = {
        {"apiVersion", "resource.k8s.io/v1"},
        {"kind", "ResourceClaim"},
        {"metadata", {{"name", ref.name}, {"namespace", ref.ns}, {"uid", ref.uid}}},
        {"status", {{"allocation", {{"devices", {{"results", std::move(results)}, {"config", std::move(configs)}}}}}}}};
    fs::create_directories(claims_dir_ + "/" + ref.ns);
    write_file(claims_dir_ + "/" + ref.ns + "/" + ref.name + ".json", claim.dump());
    return ref;
  }

  control::Reply call(const json& request) const { return control::call(run_dir_ + "/control.sock", request, 10s); }
  // The API tenants of the daemon, by name.
  std::vector<std::string> api_tenants() const {
    std::vector<std::string> out;
    const control::Reply list = call({{"op", "list"}});
    for (const json& t : list.body["tenants"])
      if (t["source"] == "api") out.push_back(t["name"]);
    return out;
  }
  std::string cdi_spec_path(const std::string& uid) const {
    return cdi_dir_ + "/gpu.fracgpu.io-claim_" + uid + ".json";
  }
  std::string record_path(const std::string& uid) const { return run_dir_ + "/kube/claims/" + uid + ".json"; }

  // The stand-in scheduler binds `pod` to this node (POST /fake/schedule):
  // its claims, made from `templates` and for its extended resources with
  // the DeviceClasses of deploy/, allocated and served from then on.
  kube::HttpResult schedule(const json& pod, const std::vector<json>& templates = {}) {
    return api_control_->post("/fake/schedule", {{"pod", pod},
                                                 {"node", kNode},
                                                 {"deviceClasses", manifest("deviceclass.yaml")},
                                                 {"claimTemplates", templates}});
  }
  static kube_plugin::ClaimRef ref_of(const json& claim) {
    return {claim["metadata"]["namespace"], claim["metadata"]["name"], claim["metadata"]["uid"]};
  }
  void forget_claim(const json& claim) {
    // Through the server: a status write of the plugin's may be on its way.
    const kube::HttpResult r = api_control_->post(
        "/fake/forget-claim", {{"namespace", claim["metadata"]["namespace"]}, {"name", claim["metadata"]["name"]}});
    EXPECT_TRUE(r.ok()) << r.status << " " << r.body;
  }

  // The devices of the node's slice in the stand-in API server (null if none).
  json slice_devices() const {
    kube::HttpResult r = api_control_->get("/fake/slices");
    if (!r.ok()) return nullptr;
    for (const json& s : json::parse(r.body))
      if (s["spec"]["nodeName"] == kNode) return s["spec"]["devices"];
    return nullptr;
  }
  bool slice_eventually(const std::function<bool(const json&)>& holds, std::chrono::milliseconds timeout = 10s) {
    return eventually(
        [&] {
          std::this_thread::sleep_for(50ms);
          const json devices = slice_devices();
          return !devices.is_null() && holds(devices);
        },
        timeout);
  }
  // The node's slice in the stand-in API server (null if none), and the uid
  // its owner reference names ("" if none).
  json node_slice() const {
    kube::HttpResult r = api_control_->get("/fake/slices");
    if (!r.ok()) return nullptr;
    for (const json& s : json::parse(r.body))
      if (s["spec"]["nodeName"] == kNode) return s;
    return nullptr;
  }
  static std::string owner_uid(const json& slice) {
    const json owners = slice.is_object() ? slice["metadata"].value("ownerReferences", json::array()) : json();
    return owners.is_array() && owners.size() == 1 ? owners[0].value("uid", std::string()) : std::string();
  }
  // A client of the stand-in API server with the plugin's credentials.
  std::unique_ptr<kube::ApiClient> api_client() const {
    std::string error;
    auto client = kube::ApiClient::from_kubeconfig(kubeconfig_, &error);
    EXPECT_TRUE(client) << error;
    if (client) client->set_retry_policy(kube::testing::fast_retries());
    return client;
  }
  // The Node's uid now, as the plugin reads it ("" if it does not exist).
  std::string node_uid() const {
    const kube::HttpResult r = api_client()->get(std::string("/api/v1/nodes/") + kNode);
    return r.ok() ? json::parse(r.body)["metadata"].value("uid", std::string()) : std::string();
  }
  // How many times the plugin has asked for its Node so far.
  size_t node_reads() const {
    size_t n = 0;
    for (const json& r : json::parse(api_control_->get("/fake/requests").body))
      n += r["method"] == "GET" && r["path"] == std::string("/api/v1/nodes/") + kNode;
    return n;
  }
  // The slice writes of the stand-in's garbage collector so far.
  std::vector<json> collector_writes() const {
    std::vector<json> out;
    for (const json& w : api_->writes())
      if (w.value("by", "") == "garbage-collector") out.push_back(w);
    return out;
  }
  static size_t count(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }

  static const json* find_device(const json& devices, const std::string& name) {
    for (const json& d : devices)
      if (d["name"] == name) return &d;
    return nullptr;
  }

  // The container edits of the claims' CDI devices, applied one claim after
  // the other as the container runtime applies them (the CDI library's
  // container-edits.go): a mount replaces any earlier one at the same
  // containerPath, a variable replaces any earlier one of the same name, and
  // the mounts end ordered by the depth of their containerPath (parents
  // first, stable).
  json container_edits(const std::vector<std::string>& uids) const {
    json mounts = json::array(), env = json::array();
    for (const std::string& uid : uids) {
      const json spec = json::parse(read_file(cdi_spec_path(uid)));
      const json& edits = spec["devices"][0]["containerEdits"];
      for (const json& m : edits["mounts"]) {
        json kept = json::array();
        for (const json& old : mounts)
          if (old["containerPath"] != m["containerPath"]) kept.push_back(old);
        kept.push_back(m);
        mounts = std::move(kept);
      }
      for (const json& e : edits["env"]) {
        const std::string text = e, name = text.substr(0, text.find('='));
        bool replaced = false;
        for (json& old : env)
          if (old.get<std::string>().substr(0, old.get<std::string>().find('=')) == name) {
            old = e;
            replaced = true;
          }
        if (!replaced) env.push_back(e);
      }
    }
    std::vector<json> ordered(mounts.begin(), mounts.end());
    const auto depth = [](const json& m) {
      const std::string path = m["containerPath"];
      return std::count(path.begin(), path.end(), '/');
    };
    std::stable_sort(ordered.begin(), ordered.end(), [&](const json& a, const json& b) { return depth(a) < depth(b); });
    return {{"mounts", ordered}, {"env", env}};
  }

  // Runs the probe (tests/probe) as a container of the claim would run.
  std::string run_in_container(const std::string& uid, const std::vector<std::string>& probe_commands) {
    return run_in_container(container_edits({uid}), probe_commands);
  }

  // Runs the probe as a container with these container edits would run: a
  // private mount namespace whose /run is a tmpfs, the edits' mounts bound
  // in (read-only ones remounted so) and their environment set. Returns the
  // probe's output.
  // Where mount namespaces are not permitted, the claims' directories are
  // shown to the interposer through links in a directory of the test's
  // (FRACGPU_CLAIMS_DIR), LD_PRELOAD at the interposer, and the test says so.
  std::string run_in_container(const json& edits, const std::vector<std::string>& probe_commands) {
    if (!can_make_containers()) {
      std::cerr << "note: unshare -m is not permitted here; the probe runs with the spec's host paths\n";
      const std::string view = tmp_ / "claims-view";
      fs::remove_all(view);
      fs::create_directories(view);
      for (const json& m : edits["mounts"]) {
        const std::string path = m["containerPath"];
        if (path.starts_with(std::string(kube_plugin::kContainerClaimsDir) + "/") && fs::is_directory(m["hostPath"]))
          fs::create_directory_symlink(m["hostPath"].get<std::string>(), view + path.substr(path.rfind('/')));
      }
      std::vector<std::string> env{"SIMCUDA_STATE=" + (tmp_ / "sim-state"), "FRACGPU_UNMANAGED=deny",
                                   std::string("LD_PRELOAD=") + FRACGPU_LIB, "FRACGPU_CLAIMS_DIR=" + view};
      std::vector<std::string> args{PROBE_PATH};
      args.insert(args.end(), probe_commands.begin(), probe_commands.end());
      const std::string log = tmp_ / "container.log";
      fs::remove(log);
      const pid_t pid = spawn(args, log, env);
      children_.push_back(pid);
      EXPECT_EQ(wait_exit(pid, 20s), 0) << read_file(log);
      return read_file(log);
    }
    std::string script = "set -e\nmount -t tmpfs -o mode=0755 tmpfs /run\n";
    for (const json& m : edits["mounts"]) {
      const std::string host = m["hostPath"], path = m["containerPath"];
      bool ro = false;
      for (const json& o : m["options"]) ro = ro || o == "ro";
      if (fs::is_directory(host))
        script += "mkdir -p '" + path + "'\n";
      else
        script += "mkdir -p \"$(dirname '" + path + "')\"; [ -e '" + path + "' ] || touch '" + path + "'\n";
      script += "mount --bind '" + host + "' '" + path + "'\n";
      if (ro) script += "mount -o remount,bind,ro,nosuid,nodev '" + path + "'\n";
    }
    script += "exec env";
    for (const json& e : edits["env"]) script += " '" + e.get<std::string>() + "'";
    script += std::string(" '") + PROBE_PATH + "'";
    for (const auto& c : probe_commands) script += " '" + c + "'";
    script += "\n";
    const std::string log = tmp_ / "container.log";
    fs::remove(log);
    const pid_t pid = spawn({"/usr/bin/unshare", "-m", "--propagation", "private", "/bin/sh", "-c", script}, log,
                            {"SIMCUDA_STATE=" + (tmp_ / "sim-state")});
    children_.push_back(pid);
    EXPECT_EQ(wait_exit(pid, 20s), 0) << read_file(log);
    return read_file(log);
  }
  static bool can_make_containers() { return system("unshare -m --propagation private true 2>/dev/null") == 0; }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  std::string config_path_ = tmp_ / "fracgpud.toml";
  std::string daemon_log_ = tmp_ / "fracgpud.log";
  std::string plugin_log_ = tmp_ / "plugin.log";
  std::string faults_path_ = tmp_ / "nvml-faults";
  std::string claims_dir_ = tmp_ / "claims";
  std::string kubeconfig_ = tmp_ / "kubeconfig";
  std::string plugin_dir_ = tmp_ / "plugins/gpu.fracgpu.io";
  std::unique_ptr<v1alpha1::DRAResourceHealth::Stub> health_stub_;  // watch_health's
  std::string slice_interval_ = "0.2";  // seconds between the plugin's periodic publishes
  std::string registry_dir_ = tmp_ / "plugins_registry";
  std::string cdi_dir_ = tmp_ / "cdi";
  std::string library_container_path_ = kContainerLibrary;
  std::string devices_ = kDevices;  // the simulated GPUs (a subclass's constructor may change them)
  std::unique_ptr<FakeApiServer> api_;
  std::unique_ptr<kube::ApiClient> api_control_;
  std::unique_ptr<dra::DRAPlugin::Stub> dra_;
  std::vector<pid_t> children_;
  pid_t daemon_ = -1;
  pid_t plugin_ = -1;
};

TEST_F(KubePluginE2E, RegistersAndPublishesTheNodesSlice) {
  start_plugin();
  const reg::PluginInfo info = register_plugin();
  EXPECT_EQ(info.type(), "DRAPlugin");
  EXPECT_EQ(info.name(), "gpu.fracgpu.io");
  EXPECT_EQ(info.endpoint(), plugin_dir_ + "/dra.sock");
  ASSERT_EQ(info.supported_versions_size(), 2);
  EXPECT_EQ(info.supported_versions(0), "v1.DRAPlugin");
  // Newer kubelets watch device health only when the plugin names the service.
  EXPECT_EQ(info.supported_versions(1), "v1alpha1.DRAResourceHealth");
  struct stat st {};
  ASSERT_EQ(stat((plugin_dir_ + "/dra.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat((registry_dir_ + "/gpu.fracgpu.io-reg.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_NE(read_file(plugin_log_).find("registration: the kubelet registered the plugin"), std::string::npos);

  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  const json devices = slice_devices();
  for (int i = 0; i < 3; ++i) {
    const json* d = find_device(devices, "gpu-" + std::to_string(i));
    ASSERT_TRUE(d) << devices.dump();
    EXPECT_EQ((*d)["attributes"]["uuid"]["string"], kUuids[i]);
    EXPECT_EQ((*d)["capacity"]["memory"]["value"], std::to_string(16 * kGiB));
    EXPECT_EQ((*d)["capacity"]["share"]["value"], "1");
    EXPECT_EQ((*d)["allowMultipleAllocations"], true);
  }
  // A prepared claim does not change what is published: the scheduler books
  // claims against the capacity itself (subtracting them here would count
  // them twice). The plugin looks again (a change), and writes nothing.
  const size_t writes = api_->writes().size();
  const auto claim = write_claim(1, {result("gpu-2", {{"memory", "4Gi"}, {"share", "250m"}})});
  ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  std::this_thread::sleep_for(1500ms);
  const json after = slice_devices();
  EXPECT_EQ(after, devices);
  EXPECT_EQ(api_->writes().size(), writes);  // unchanged devices: no write

  // Stopped: its sockets go (the kubelet deregisters it).
  stop_plugin();
  EXPECT_FALSE(fs::exists(registry_dir_ + "/gpu.fracgpu.io-reg.sock"));
  EXPECT_FALSE(fs::exists(plugin_dir_ + "/dra.sock"));
}

TEST_F(KubePluginE2E, PrepareMakesTheTenantItsContainerSeesTheQuotaUnprepareRemovesIt) {
  start_plugin();
  const auto claim = write_claim(2, {result("gpu-1", {{"memory", "4Gi"}, {"share", "500m"}})});
  const auto response = prepare({claim});
  ASSERT_EQ(response.claims().size(), 1u);
  const auto& prepared = response.claims().at(claim.uid);
  ASSERT_EQ(prepared.error(), "");
  ASSERT_EQ(prepared.devices_size(), 1);
  EXPECT_EQ(prepared.devices(0).pool_name(), kNode);
  EXPECT_EQ(prepared.devices(0).device_name(), "gpu-1");
  ASSERT_EQ(prepared.devices(0).request_names_size(), 1);
  EXPECT_EQ(prepared.devices(0).request_names(0), "gpu");
  ASSERT_EQ(prepared.devices(0).cdi_device_ids_size(), 2);
  EXPECT_EQ(prepared.devices(0).cdi_device_ids(0), "gpu.fracgpu.io/claim=" + claim.uid);
  EXPECT_EQ(prepared.devices(0).cdi_device_ids(1), "nvidia.com/gpu=" + kUuids[1]);

  // The tenant: exactly the consumed capacity, annotated with the claim.
  const control::Reply got = call({{"op", "get"}, {"name", "dra-" + claim.uid}});
  ASSERT_TRUE(got.ok) << got.error;
  const json tenant = got.body["tenant"];
  ASSERT_EQ(tenant["gpus"].size(), 1u);
  EXPECT_EQ(tenant["gpus"][0]["uuid"], kUuids[1]);
  EXPECT_EQ(tenant["gpus"][0]["memory"], 4 * kGiB);
  EXPECT_EQ(tenant["gpus"][0]["share"], 0.5);
  EXPECT_EQ(tenant["gpus"][0]["limit"], 0.5);
  EXPECT_EQ(tenant["annotations"]["claim-namespace"], "team-a");
  EXPECT_EQ(tenant["annotations"]["claim-name"], claim.name);
  EXPECT_EQ(tenant["annotations"]["claim-uid"], claim.uid);
  EXPECT_TRUE(fs::exists(record_path(claim.uid)));
  ASSERT_TRUE(fs::exists(cdi_spec_path(claim.uid)));

  // A process started with the spec's mounts and environment sees the quota
  // through the interposer, on its one GPU (the node's GPU 1), its device 0.
  const std::string out = run_in_container(
      claim.uid, {"init", "devices", "primary", "0", "info", "alloc", "5GiB", "alloc", "1GiB"});
  EXPECT_NE(out.find("devices=1\ndevice_0_uuid=" + kUuids[1] + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("init=0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("total=" + std::to_string(4 * kGiB) + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("alloc=2\nalloc=0\n"), std::string::npos) << out;  // 5 GiB: out of memory; 1 GiB fits

  EXPECT_EQ(unprepare(claim), "");
  EXPECT_FALSE(call({{"op", "get"}, {"name", "dra-" + claim.uid}}).ok);
  EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
  EXPECT_TRUE(api_tenants().empty());
}

// A pod with two fracgpu claims, both in one container: one claim of 2 GiB
// of GPU 0, one of 4 GiB of GPU 1. The runtime applies both claims' CDI
// edits to the container (a later mount at the same path replaces an earlier
// one, a later variable of the same name too): each claim's tenant directory
// keeps a path of its own, no variable differs between the claims, and a
// process of the container reaches both tenants, each GPU held to its own
// claim's quota. (Before: both claims mounted their tenant at
// /run/fracgpu/tenant and set FRACGPU_TENANT_DIR to it, so the second claim's
// replaced the first's, and the first claim's GPU was refused.)
TEST_F(KubePluginE2E, TwoClaimsInOneContainerReachBothTenants) {
  start_plugin();
  const auto first = write_claim(10, {result("gpu-0", {{"memory", "2Gi"}, {"share", "500m"}})});
  const auto second = write_claim(11, {result("gpu-1", {{"memory", "4Gi"}, {"share", "500m"}})});
  const auto response = prepare({first, second});
  ASSERT_EQ(response.claims().at(first.uid).error(), "");
  ASSERT_EQ(response.claims().at(second.uid).error(), "");

  const json edits = container_edits({first.uid, second.uid});
  for (const auto* claim : {&first, &second}) {
    const json spec = json::parse(read_file(cdi_spec_path(claim->uid)));
    for (const json& m : spec["devices"][0]["containerEdits"]["mounts"])
      EXPECT_NE(std::find(edits["mounts"].begin(), edits["mounts"].end(), m), edits["mounts"].end())
          << claim->uid << "'s mount " << m.dump() << " was replaced: " << edits["mounts"].dump();
    for (const json& e : spec["devices"][0]["containerEdits"]["env"])
      EXPECT_NE(std::find(edits["env"].begin(), edits["env"].end(), e), edits["env"].end())
          << claim->uid << "'s " << e << " was replaced: " << edits["env"].dump();
  }

  // A process of the container sees each GPU's quota and is held to it.
  const std::string out = run_in_container(
      edits, {"init", "primary", "0", "info", "alloc", "3GiB", "primary", "1", "info", "alloc", "3GiB"});
  const size_t gpu0 = out.find("init=0\nprimary=0\ninfo=0\n");
  EXPECT_NE(gpu0, std::string::npos) << out;
  EXPECT_NE(out.find("\ntotal=" + std::to_string(2 * kGiB) + "\nalloc=2\n", gpu0), std::string::npos) << out;
  const size_t gpu1 = out.find("alloc=2\nprimary=0\ninfo=0\n");
  EXPECT_NE(gpu1, std::string::npos) << out;
  EXPECT_NE(out.find("\ntotal=" + std::to_string(4 * kGiB) + "\nalloc=0\n", gpu1), std::string::npos) << out;

  EXPECT_EQ(unprepare(first), "");
  EXPECT_EQ(unprepare(second), "");
  EXPECT_TRUE(api_tenants().empty());
}

// Unprepared while a process of the pod still runs: the tenant drains (the
// process keeps its quota, its capacity stays booked), the spec and the
// record go, and the daemon removes the tenant once the process is gone.
// A claim with a prioritized list (firstAvailable): the allocator records
// the result's request as "<request>/<subrequest>". The kubelet hands a
// device to a container whose claim names the request ("gpu"): the plugin
// gives that name back, the subrequest taken off, and a GpuConfig naming
// either applies.
TEST_F(KubePluginE2E, AFirstAvailableSubrequestIsReportedAsItsRequest) {
  start_plugin();
  json config = {{"source", "FromClaim"},
                 {"requests", json::array({"gpu/quarter"})},
                 {"opaque",
                  {{"driver", "gpu.fracgpu.io"},
                   {"parameters",
                    {{"apiVersion", "gpu.fracgpu.io/v1alpha1"},
                     {"kind", "GpuConfig"},
                     {"limit", "0.5"},
                     {"priority", "latency"}}}}}};
  const auto claim =
      write_claim(12, {result("gpu-0", {{"memory", "4Gi"}, {"share", "250m"}}, "gpu/quarter")}, json::array({config}));
  const auto response = prepare({claim});
  const auto& prepared = response.claims().at(claim.uid);
  ASSERT_EQ(prepared.error(), "");
  ASSERT_EQ(prepared.devices_size(), 1);
  ASSERT_EQ(prepared.devices(0).request_names_size(), 1);
  EXPECT_EQ(prepared.devices(0).request_names(0), "gpu");
  const control::Reply got = call({{"op", "get"}, {"name", "dra-" + claim.uid}});
  ASSERT_TRUE(got.ok) << got.error;
  EXPECT_EQ(got.body["tenant"]["gpus"][0]["share"], 0.25);
  EXPECT_EQ(got.body["tenant"]["gpus"][0]["limit"], 0.5) << "the config naming the subrequest applies";
  EXPECT_EQ(got.body["tenant"]["priority"], "latency") << "and its priority reaches the tenant";
}

TEST_F(KubePluginE2E, UnprepareWithALiveProcessDrainsTheTenant) {
  start_plugin();
  const auto claim = write_claim(16, {result("gpu-0", {{"memory", "2Gi"}, {"share", "500m"}})});
  ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  const std::string dir = run_dir_ + "/tenants/dra-" + claim.uid;
  const pid_t process = spawn_tenant_process(dir, 0, 64ull << 20);
  ASSERT_GT(process, 0);
  children_.push_back(process);
  EXPECT_EQ(unprepare(claim), "");
  EXPECT_NE(read_file(plugin_log_).find("tenant dra-" + claim.uid + " draining"), std::string::npos);
  const control::Reply draining = call({{"op", "get"}, {"name", "dra-" + claim.uid}});
  ASSERT_TRUE(draining.ok) << draining.error;
  EXPECT_EQ(draining.body["tenant"]["state"], "draining");
  EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
  EXPECT_EQ(unprepare(claim), "");  // a retry meanwhile: nothing of ours left
  kill_and_reap(process);
  EXPECT_TRUE(eventually([&] { return !fs::exists(dir); }, 10s));
  EXPECT_TRUE(api_tenants().empty());
}

TEST_F(KubePluginE2E, KubeletRetriesAreIdempotent) {
  start_plugin();
  const auto claim = write_claim(3, {result("gpu-0", {{"memory", "2Gi"}, {"share", "250m"}})});
  const auto first = prepare({claim});
  ASSERT_EQ(first.claims().at(claim.uid).error(), "");
  const std::string spec = read_file(cdi_spec_path(claim.uid));
  // The claim changes at the API server meanwhile: a retry answers from the
  // record, the same as the first time.
  write_claim(3, {result("gpu-2", {{"memory", "8Gi"}, {"share", "750m"}})});
  for (int i = 0; i < 3; ++i) {
    const auto again = prepare({claim});
    EXPECT_EQ(again.claims().at(claim.uid).SerializeAsString(), first.claims().at(claim.uid).SerializeAsString());
  }
  EXPECT_EQ(read_file(cdi_spec_path(claim.uid)), spec);
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + claim.uid});
  EXPECT_EQ(unprepare(claim), "");
  EXPECT_EQ(unprepare(claim), "");  // again: nothing left, success
  // Never prepared here: success, and a tenant of that name that is not the
  // plugin's (no record) is left alone.
  const kube_plugin::ClaimRef stranger{"team-b", "x", uid_of(9)};
  ASSERT_TRUE(call({{"op", "create"},
                    {"tenant", {{"name", "dra-" + stranger.uid}, {"gpus", {{{"uuid", kUuids[0]}, {"share", 0.1}}}}}}})
                  .ok);
  EXPECT_EQ(unprepare(stranger), "");
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + stranger.uid});
}

// Killed after each step of prepare, restarted, asked again: one tenant, and
// unprepare leaves nothing.
TEST_F(KubePluginE2E, APluginKilledMidPrepareNeitherLeaksNorDuplicates) {
  int n = 10;
  for (const char* point : kube_plugin::kCrashPoints) {
    SCOPED_TRACE(point);
    const auto claim = write_claim(n++, {result("gpu-1", {{"memory", "3Gi"}, {"share", "300m"}})});
    prepare_until_crash(claim, point);
    EXPECT_TRUE(fs::exists(record_path(claim.uid)));
    start_plugin();
    const auto response = prepare({claim});
    ASSERT_EQ(response.claims().at(claim.uid).error(), "");
    EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + claim.uid});
    EXPECT_EQ(call({{"op", "get"}, {"name", "dra-" + claim.uid}}).body["tenant"]["gpus"][0]["memory"], 3 * kGiB);
    EXPECT_TRUE(fs::exists(cdi_spec_path(claim.uid)));
    EXPECT_EQ(unprepare(claim), "");
    EXPECT_TRUE(api_tenants().empty());
    EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
    EXPECT_FALSE(fs::exists(record_path(claim.uid)));
    stop_plugin();
  }
  // Killed after the tenant, then unprepared (the pod went away meanwhile):
  // nothing left either.
  const auto claim = write_claim(n, {result("gpu-0", {{"memory", "1Gi"}, {"share", "100m"}})});
  prepare_until_crash(claim, "after-tenant");
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + claim.uid});
  start_plugin();
  EXPECT_EQ(unprepare(claim), "");
  EXPECT_TRUE(api_tenants().empty());
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
}

// Killed after the tenant was made; then the tenant is changed behind the
// plugin's back (a resize), or its GPU fenced, before the kubelet retries.
// Whether the retry succeeds or not, the tenant stays known (its record) and
// unprepare removes it.
TEST_F(KubePluginE2E, AChangeBetweenACrashAndTheRetryLeaksNothing) {
  const auto crash_after_tenant = [&](int n) {
    const auto claim = write_claim(n, {result("gpu-1", {{"memory", "1Gi"}, {"share", "200m"}})});
    prepare_until_crash(claim, "after-tenant");
    return claim;
  };
  const auto unprepare_leaves_nothing = [&](const kube_plugin::ClaimRef& claim) {
    EXPECT_EQ(unprepare(claim), "");
    EXPECT_TRUE(api_tenants().empty());
    EXPECT_FALSE(fs::exists(record_path(claim.uid)));
    EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
    stop_plugin();
  };

  // Resized: the retry's create is refused ("exists", another spec); the
  // record stays, since a tenant of that name is there.
  auto claim = crash_after_tenant(14);
  ASSERT_TRUE(call({{"op", "resize"},
                    {"tenant", {{"name", "dra-" + claim.uid}, {"gpus", {{{"uuid", kUuids[1]}, {"share", 0.3}}}}}}})
                  .ok);
  start_plugin();
  const std::string error = prepare({claim}).claims().at(claim.uid).error();
  EXPECT_EQ(error.rfind("claim team-a/claim-14: ", 0), 0u) << error;
  EXPECT_TRUE(fs::exists(record_path(claim.uid)));
  unprepare_leaves_nothing(claim);

  // Fenced: the daemon answers a create of the same spec before it looks at
  // fences, so the retry succeeds.
  claim = crash_after_tenant(15);
  write_file(faults_path_, "1 lost\n");
  ASSERT_TRUE(eventually([&] { return call({{"op", "node"}}).body["node"]["gpus"][1]["fenced"] == true; }, 10s));
  start_plugin();
  EXPECT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + claim.uid});
  unprepare_leaves_nothing(claim);
}

TEST_F(KubePluginE2E, ADaemonRestartBetweenPrepareAndUnprepare) {
  start_plugin();
  const auto claim = write_claim(4, {result("gpu-0", {{"memory", "2Gi"}, {"share", "500m"}})});
  ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  stop_daemon();
  start_daemon();
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + claim.uid});  // kept by the daemon
  EXPECT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");          // a kubelet retry meanwhile
  EXPECT_EQ(unprepare(claim), "");
  EXPECT_TRUE(api_tenants().empty());
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
}

TEST_F(KubePluginE2E, AClaimWhoseCapacityIsNoLongerFreeIsRefusedClearly) {
  start_plugin();
  // Someone took most of GPU 0 after the scheduler booked the claim there.
  ASSERT_TRUE(
      call({{"op", "create"}, {"tenant", {{"name", "other"}, {"gpus", {{{"uuid", kUuids[0]}, {"share", 0.75}}}}}}}).ok);
  const auto claim = write_claim(5, {result("gpu-0", {{"memory", "2Gi"}, {"share", "500m"}})});
  const std::string error = prepare({claim}).claims().at(claim.uid).error();
  EXPECT_EQ(error.rfind("claim team-a/claim-5: " + kUuids[0] + ": share 0.5 asked, 0.25 free", 0), 0u) << error;
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"other"});
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
  EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
  // Claims the plugin cannot read are per-claim errors too; the good one in
  // the same call is prepared.
  const kube_plugin::ClaimRef missing{"team-a", "gone", uid_of(6)};
  const auto good = write_claim(7, {result("gpu-1", {{"memory", "1Gi"}, {"share", "100m"}})});
  const auto both = prepare({missing, good});
  EXPECT_NE(
      both.claims()
          .at(missing.uid)
          .error()
          .find("claim team-a/gone: GET /apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/gone: HTTP 404"),
      std::string::npos)
      << both.claims().at(missing.uid).error();
  EXPECT_EQ(both.claims().at(good.uid).error(), "");
}

// Where the API server drops device taints (its gate DRADeviceTaints off, as
// by default before Kubernetes 1.36), the plugin sees its taint gone from the
// server's answer and leaves the fenced GPU out of the slice instead.
TEST_F(KubePluginE2E, AFencedGpuLeavesTheSliceAndReturns) {
  ASSERT_TRUE(api_control_->post("/fake/feature-gates", {{"DRADeviceTaints", false}}).ok());
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }));
  write_file(faults_path_, "1 lost\n");
  EXPECT_TRUE(slice_eventually([](const json& d) { return d.size() == 2 && !find_device(d, "gpu-1"); }))
      << slice_devices().dump();
  // It did try the taint: a write whose body tainted gpu-1 and whose stored
  // object has no taint.
  bool tried = false;
  for (const json& w : api_->writes()) {
    if (w["status"] != 200 || !w["body"].is_object()) continue;
    const json* sent = find_device(w["body"]["spec"]["devices"], "gpu-1");
    const json* kept = find_device(w["object"]["spec"]["devices"], "gpu-1");
    if (sent && sent->contains("taints") && kept && !kept->contains("taints")) tried = true;
  }
  EXPECT_TRUE(tried);
  const std::string log = read_file(plugin_log_);
  const size_t said = log.find("the API server dropped the device taints");
  EXPECT_NE(said, std::string::npos) << log;
  EXPECT_EQ(log.find("the API server dropped the device taints", said + 1), std::string::npos) << "said once";
  write_file(faults_path_, "");
  EXPECT_TRUE(slice_eventually([](const json& d) { return d.size() == 3 && find_device(d, "gpu-1"); }))
      << slice_devices().dump();
  // Fenced again: left out at once, no second try of the taint.
  const size_t writes_before = api_->writes().size();
  write_file(faults_path_, "1 lost\n");
  EXPECT_TRUE(slice_eventually([](const json& d) { return d.size() == 2 && !find_device(d, "gpu-1"); }))
      << slice_devices().dump();
  const std::vector<json> writes = api_->writes();
  for (size_t i = writes_before; i < writes.size(); ++i) {
    if (!writes[i]["body"].is_object()) continue;
    for (const json& d : writes[i]["body"]["spec"]["devices"]) {
      EXPECT_FALSE(d.contains("taints")) << d.dump();
    }
  }
}

// Requirement: slices follow the config's tenants. A config tenant added by a
// reload takes its part of GPU 1 out of the slice; removed again, it comes back.
TEST_F(KubePluginE2E, AConfigTenantAddedByAReloadShrinksTheSlice) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }));
  const std::string config = read_file(config_path_);
  const auto gpu1 = [](const json& d, const char* capacity) -> std::string {
    const json* device = find_device(d, "gpu-1");
    return device ? (*device)["capacity"][capacity]["value"].get<std::string>() : "";
  };
  write_file(config_path_, config + "[[tenant]]\nname = \"cfg\"\ngpus = 0.25\ndevices = [1]\n");
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(slice_eventually([&](const json& d) {
    return gpu1(d, "share") == "750m" && std::stoull(gpu1(d, "memory")) < 16 * kGiB;
  })) << slice_devices().dump();
  EXPECT_EQ(gpu1(slice_devices(), "memory"), std::to_string(12 * kGiB)) << "a quarter of 16 GiB is the config's";
  write_file(config_path_, config);
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(slice_eventually([&](const json& d) {
    return gpu1(d, "share") == "1" && gpu1(d, "memory") == std::to_string(16 * kGiB);
  })) << slice_devices().dump();
}

TEST_F(KubePluginE2E, TwoAndAHalfGpusAreOneTenant) {
  start_plugin();
  const auto claim = write_claim(
      8,
      {result("gpu-0", nullptr, "whole"), result("gpu-2", nullptr, "whole"),
       result("gpu-1", {{"memory", "8Gi"}, {"share", "500m"}}, "half")},
      {{{"source", "FromClaim"},
        {"requests", {"half"}},
        {"opaque",
         {{"driver", "gpu.fracgpu.io"},
          {"parameters", {{"apiVersion", "gpu.fracgpu.io/v1alpha1"}, {"kind", "GpuConfig"}, {"limit", "1.0"}}}}}}});
  const auto response = prepare({claim});
  ASSERT_EQ(response.claims().at(claim.uid).error(), "");
  EXPECT_EQ(response.claims().at(claim.uid).devices_size(), 3);
  const json tenant = call({{"op", "get"}, {"name", "dra-" + claim.uid}}).body["tenant"];
  ASSERT_EQ(tenant["gpus"].size(), 3u) << tenant.dump();
  for (const json& g : tenant["gpus"]) {
    if (g["uuid"] == kUuids[1]) {
      EXPECT_EQ(g["share"], 0.5);
      EXPECT_EQ(g["memory"], 8 * kGiB);
      EXPECT_EQ(g["limit"], 1.0);
    } else {
      EXPECT_EQ(g["share"], 1.0);
      EXPECT_EQ(g["memory"], 16 * kGiB);
    }
  }
  EXPECT_EQ(unprepare(claim), "");
  EXPECT_TRUE(api_tenants().empty());
}

// Both claims' devices in one podman container (the plugin's own specs).
TEST_F(KubePluginE2E, TheCdiSpecIsValidAndRunsInPodman) {
  library_container_path_ = "/usr/lib/fracgpu/libfracgpu.so";  // where podman_cdi_test.sh looks for it
  start_plugin();
  const auto claim = write_claim(9, {result("gpu-1", {{"memory", "1Gi"}, {"share", "250m"}})});
  const auto other = write_claim(12, {result("gpu-2", {{"memory", "1Gi"}, {"share", "250m"}})});
  ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  ASSERT_EQ(prepare({other}).claims().at(other.uid).error(), "");
  const std::string log = tmp_ / "validate.log";
  EXPECT_EQ(wait_exit(spawn({PYTHON3, VALIDATE_CDI, cdi_spec_path(claim.uid)}, log), 30s), 0) << read_file(log);
  // A spec broken on purpose is caught (the check can fail).
  json broken = json::parse(read_file(cdi_spec_path(claim.uid)));
  broken["devices"][0]["containerEdits"]["mounts"][0].erase("containerPath");
  write_file(tmp_ / "broken.json", broken.dump());
  EXPECT_EQ(wait_exit(spawn({PYTHON3, VALIDATE_CDI, tmp_ / "broken.json"}, log), 30s), 1) << read_file(log);

  const std::string podman_log = tmp_ / "podman.log";
  const int rc = wait_exit(
      spawn({"/bin/bash", PODMAN_CDI_TEST, "--spec-dir", cdi_dir_, "--id", "gpu.fracgpu.io/claim=" + claim.uid, "--id",
             "gpu.fracgpu.io/claim=" + other.uid},
            podman_log),
      120s);
  if (rc == 77) GTEST_SKIP() << read_file(podman_log);
  EXPECT_EQ(rc, 0) << read_file(podman_log);
}

// A kubelet that starts deletes every ResourceSlice of its node, then
// registers the plugins again: the plugin publishes its slice again at the
// registration, not at its next periodic publish (30 s by default; a minute
// here).
TEST_F(KubePluginE2E, ASliceDeletedByARestartingKubeletIsBackWhenItRegistersThePlugin) {
  slice_interval_ = "60";
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }));
  std::this_thread::sleep_for(2500ms);  // the daemon's first seconds move its node generation
  const json slice = node_slice();
  ASSERT_FALSE(slice.is_null());
  const std::string name = slice["metadata"]["name"];
  const kube::HttpResult deleted = api_client()->del("/apis/resource.k8s.io/v1/resourceslices/" + name);
  ASSERT_TRUE(deleted.ok()) << deleted.status << " " << deleted.body;
  ASSERT_TRUE(slice_devices().is_null()) << "the slice is gone";
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(slice_devices().is_null()) << "published again without a reason (the test needs the long interval)";
  register_plugin();
  EXPECT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }, 5s)) << read_file(plugin_log_);
}

// A prepare the kubelet gave up on (its deadline passed while the plugin
// waited for a slow API server) makes nothing: the kubelet may have
// unprepared the claim meanwhile, and a tenant made after that would never
// be deleted. A later prepare of the claim works as usual.
TEST_F(KubePluginE2E, APrepareTheKubeletGaveUpOnMakesNothing) {
  start_plugin();
  const auto claim = write_claim(7, {result("gpu-0", {{"memory", "4Gi"}, {"share", "250m"}})});
  ASSERT_TRUE(api_control_
                  ->post("/fake/fail", {{"method", "GET"}, {"path", "resourceclaims/" + claim.name}, {"delay", 3},
                                        {"count", 1}})
                  .ok());
  dra::NodePrepareResourcesResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 1s);
  const grpc::Status status =
      dra_->NodePrepareResources(&context, request_for<dra::NodePrepareResourcesRequest>({claim}), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  ASSERT_TRUE(eventually(
      [&] { return read_file(plugin_log_).find("the kubelet gave up on this prepare") != std::string::npos; }, 10s))
      << read_file(plugin_log_);
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
  EXPECT_TRUE(api_tenants().empty());
  EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
  EXPECT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  EXPECT_TRUE(fs::exists(record_path(claim.uid)));
  EXPECT_EQ(unprepare(claim), "");
}

// A claim's record that cannot be read (another version's format, after a
// downgrade) does not keep its pod terminating: unprepare removes the tenant
// and the CDI spec by the names the uid gives, and the record.
TEST_F(KubePluginE2E, AnUnreadableRecordIsStillUnprepared) {
  start_plugin();
  const auto claim = write_claim(8, {result("gpu-1", {{"memory", "4Gi"}, {"share", "250m"}})});
  ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  ASSERT_EQ(api_tenants().size(), 1u);
  write_file(record_path(claim.uid), R"({"version": 2, "plan": "of another format"})");
  EXPECT_EQ(unprepare(claim), "");
  EXPECT_TRUE(eventually([&] { return api_tenants().empty(); }, 10s));
  EXPECT_FALSE(fs::exists(cdi_spec_path(claim.uid)));
  EXPECT_FALSE(fs::exists(record_path(claim.uid)));
}

TEST_F(KubePluginE2E, UninstallDeletesTheNodesSlices) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }));
  stop_plugin();
  const std::string log = tmp_ / "uninstall.log";
  std::vector<std::string> args = plugin_args();
  args.push_back("--uninstall");
  EXPECT_EQ(wait_exit(spawn(args, log), 30s), 0) << read_file(log);
  EXPECT_TRUE(slice_devices().is_null());
}

// Every claim is a new tenant: a GPU's GPU-time table that churn could
// exhaust would leave every later claim there unlimited (it did after 64).
// 100 claims prepared and unprepared on GPU 0, then one of 0.1: capped at
// 0.1 alone (its limit is its share), by the simulated driver's own count.
TEST_F(KubePluginE2E, AHundredClaimsComeAndGoAndTheNextIsStillCapped) {
  start_plugin();
  for (int n = 0; n < 100; ++n) {
    const auto claim = write_claim(100 + n, {result("gpu-0", {{"memory", "1Gi"}, {"share", "10m"}})});
    ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "") << "claim " << n;
    ASSERT_EQ(unprepare(claim), "") << "claim " << n;
  }
  ASSERT_TRUE(eventually([&] { return api_tenants().empty(); }, 10s));
  const auto capped = write_claim(300, {result("gpu-0", {{"memory", "1Gi"}, {"share", "100m"}})});
  ASSERT_EQ(prepare({capped}).claims().at(capped.uid).error(), "");

  const std::string state = tmp_ / "sim-state";
  setenv("SIMCUDA_STATE", state.c_str(), 1);
  setenv("SIMCUDA_DEVICES", kDevices.c_str(), 1);
  void* sim = dlopen((std::string(SIMCUDA_DIR) + "/libcuda.so.1").c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(sim, nullptr) << dlerror();
  auto busy_ns = reinterpret_cast<uint64_t (*)(int, int)>(dlsym(sim, "simcuda_busy_ns"));
  ASSERT_NE(busy_ns, nullptr);
  const std::string log = tmp_ / "load.log";
  const pid_t load = spawn({LOAD_PATH, "devices=0", "kernels_us=1000", "seconds=4"}, log,
                           {"SIMCUDA_STATE=" + state, std::string("LD_PRELOAD=") + FRACGPU_LIB,
                            "FRACGPU_TENANT_DIR=" + run_dir_ + "/tenants/dra-" + capped.uid});
  children_.push_back(load);
  std::this_thread::sleep_for(1500ms);
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t b0 = busy_ns(0, load);
  std::this_thread::sleep_for(2s);
  const uint64_t b1 = busy_ns(0, load);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double share = static_cast<double>(b1 - b0) / 1e9 / wall;
  printf("the 101st claim's tenant, capped at 0.1, alone: %.3f of GPU 0\n", share);
  EXPECT_EQ(wait_exit(load, 20s), 0) << read_file(log);
  EXPECT_GE(share, 0.05) << read_file(log);
  EXPECT_LE(share, 0.15) << read_file(log) << read_file(daemon_log_);
  dlclose(sim);
}

// A tenant that truncates its own usage file (its container may write it)
// before its pod ends must not keep its capacity booked: the claim's
// unprepare drains it, and once its process is gone, by the kernel's count
// of record locks, the tenant goes and the next claim gets the capacity.
TEST_F(KubePluginE2E, ATenantThatTruncatesItsUsageStillGoesWhenItsLastProcessDoes) {
  start_plugin();
  const auto claim = write_claim(20, {result("gpu-0", {{"memory", "8Gi"}, {"share", "750m"}})});
  ASSERT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  const std::string dir = run_dir_ + "/tenants/dra-" + claim.uid;
  const pid_t process = spawn_tenant_process(dir, 0, 64ull << 20);
  ASSERT_GT(process, 0);
  children_.push_back(process);
  ASSERT_EQ(truncate((dir + "/usage").c_str(), 0), 0) << strerror(errno);
  EXPECT_EQ(unprepare(claim), "");
  kill_and_reap(process);
  EXPECT_TRUE(eventually([&] { return api_tenants().empty(); }, 10s)) << read_file(daemon_log_);
  const auto next = write_claim(21, {result("gpu-0", {{"memory", "8Gi"}, {"share", "750m"}})});
  EXPECT_EQ(prepare({next}).claims().at(next.uid).error(), "");
}

// The slice names its node as its controlling owner (the upstream helper
// library does the same), with the node's uid read from the API server, so
// deleting the node deletes the slice: it no longer lingers for a node that
// is gone. The stand-in API server validates owner references as the real
// one does and plays the garbage collector (a slice whose owner's uid no
// longer exists is deleted, shortly after). While the Node is absent the
// plugin writes no slice (it would be collected at once), says so once, and
// asks for the Node with backoff, never more than once a period.
TEST_F(KubePluginE2E, TheSliceIsOwnedByItsNodeAndGoesWithIt) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  const json slice = node_slice();
  ASSERT_TRUE(slice.is_object());
  const json& owners = slice["metadata"]["ownerReferences"];
  ASSERT_TRUE(owners.is_array() && owners.size() == 1) << slice.dump();
  EXPECT_EQ(owners[0]["apiVersion"], "v1");
  EXPECT_EQ(owners[0]["kind"], "Node");
  EXPECT_EQ(owners[0]["name"], kNode);
  EXPECT_EQ(owners[0]["controller"], true);
  EXPECT_EQ(owners[0].value("uid", std::string()), node_uid()) << slice.dump();

  const kube::HttpResult deleted = api_control_->post("/fake/delete-node", {{"name", kNode}});
  ASSERT_TRUE(deleted.ok()) << deleted.error;
  EXPECT_EQ(json::parse(deleted.body)["dependents"], json::array({slice["metadata"]["name"]})) << deleted.body;
  EXPECT_TRUE(eventually(
      [&] {
        std::this_thread::sleep_for(50ms);
        return node_slice().is_null();
      },
      5s));
  // Ten of the plugin's periods (0.2 s): nothing written, the Node asked for
  // at most once a period.
  const size_t writes = api_->writes().size(), reads = node_reads();
  std::this_thread::sleep_for(2s);
  EXPECT_TRUE(node_slice().is_null()) << node_slice().dump();
  EXPECT_EQ(api_->writes().size(), writes) << api_->writes().back().dump();
  EXPECT_GE(node_reads() - reads, 1u);
  EXPECT_LE(node_reads() - reads, 11u);
  EXPECT_EQ(count(read_file(plugin_log_), "the Node does not exist"), 1u) << read_file(plugin_log_);
}

// `kubectl delete node` and the kubelet registering the node again: a Node
// of the same name with a new uid. The garbage collector deletes the slice
// naming the old uid; the plugin, asking for the Node while it is absent,
// publishes under the new uid within a few of its periods (0.2 s), and the
// collector leaves that slice alone.
TEST_F(KubePluginE2E, ANodeCreatedAgainOwnsTheSliceAgain) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  const std::string old_uid = node_uid();
  ASSERT_EQ(owner_uid(node_slice()), old_uid);
  ASSERT_TRUE(api_control_->post("/fake/delete-node", {{"name", kNode}}).ok());
  ASSERT_TRUE(eventually(
      [&] {
        std::this_thread::sleep_for(50ms);
        return node_slice().is_null();
      },
      5s));
  std::this_thread::sleep_for(600ms);  // three periods without the Node
  const kube::HttpResult created = api_control_->post("/fake/create-node", {{"name", kNode}});
  ASSERT_TRUE(created.ok()) << created.error;
  const std::string new_uid = json::parse(created.body)["uid"];
  ASSERT_NE(new_uid, old_uid);

  EXPECT_TRUE(eventually(
      [&] {
        std::this_thread::sleep_for(50ms);
        return owner_uid(node_slice()) == new_uid;
      },
      5s))
      << node_slice().dump();
  // It stays: ten periods, and the collector (0.1 s) has looked at it long since.
  const size_t collected = collector_writes().size();
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(100ms);
    const json slice = node_slice();
    ASSERT_EQ(owner_uid(slice), new_uid) << slice.dump();
    ASSERT_EQ(slice["spec"]["devices"].size(), 3u);
  }
  EXPECT_EQ(collector_writes().size(), collected);
  EXPECT_NE(read_file(plugin_log_).find("the Node exists again"), std::string::npos) << read_file(plugin_log_);
}

// The Node deleted and created again at once, the plugin never seeing it
// absent, the collector slower than the plugin's period (3 s against 0.2 s):
// the periodic publish reads the Node, finds the new uid, and rewrites the
// slice's owner before the collector looks; the collector then keeps it.
TEST_F(KubePluginE2E, ANodeCreatedAgainAtOnceIsFoundAtThePeriodicPublish) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  const std::string slice_uid = node_slice()["metadata"]["uid"];
  std::this_thread::sleep_for(300ms);  // the collector (0.1 s) has looked at the new slice
  ASSERT_TRUE(api_control_->post("/fake/gc", {{"delay", 3.0}}).ok());
  ASSERT_TRUE(api_control_->post("/fake/delete-node", {{"name", kNode}}).ok());
  const kube::HttpResult created = api_control_->post("/fake/create-node", {{"name", kNode}});
  ASSERT_TRUE(created.ok()) << created.error;
  const std::string new_uid = json::parse(created.body)["uid"];
  const auto t0 = std::chrono::steady_clock::now();
  const bool owned = eventually(
      [&] {
        std::this_thread::sleep_for(50ms);
        return owner_uid(node_slice()) == new_uid;
      },
      2s);
  EXPECT_TRUE(owned) << node_slice().dump();
  if (owned)
    printf("owned by the new uid after %.2f s\n",
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::this_thread::sleep_for(4s);  // the collector has looked (after the deletion, after the rewrite)
  const json slice = node_slice();
  EXPECT_EQ(owner_uid(slice), new_uid) << slice.dump();
  EXPECT_EQ(slice["metadata"].value("uid", std::string()), slice_uid) << "rewritten, not deleted and created";
  EXPECT_TRUE(collector_writes().empty()) << collector_writes().front().dump();
  EXPECT_NE(read_file(plugin_log_).find("the Node was created again"), std::string::npos) << read_file(plugin_log_);
}

// Someone deletes the slice while the Node stays (an admin, the kubelet on
// unregistering the driver): the plugin creates it again, owned by the same
// Node, within a few of its periods.
TEST_F(KubePluginE2E, ASliceDeletedWhileItsNodeStaysComesBack) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  const json before = node_slice();
  const std::string uid = node_uid();
  ASSERT_EQ(owner_uid(before), uid);
  const std::string name = before["metadata"]["name"];
  ASSERT_TRUE(api_client()->del("/apis/resource.k8s.io/v1/resourceslices/" + name).ok());
  EXPECT_TRUE(eventually(
      [&] {
        std::this_thread::sleep_for(50ms);
        const json slice = node_slice();
        return slice.is_object() && slice["metadata"]["uid"] != before["metadata"]["uid"];
      },
      5s));
  std::this_thread::sleep_for(1s);
  const json after = node_slice();
  EXPECT_EQ(owner_uid(after), uid) << after.dump();
  EXPECT_EQ(after["spec"]["devices"].size(), 3u);
  EXPECT_GT(after["spec"]["pool"]["generation"].get<int64_t>(), before["spec"]["pool"]["generation"].get<int64_t>());
  EXPECT_TRUE(collector_writes().empty()) << collector_writes().front().dump();
}

// The shapes a real allocator writes besides the plain one: two results of
// one request (count: 2) with consumable-capacity shareIDs, a result of
// another driver in the same claim, and admin access. The kubelet gets back
// fracgpu's devices only, each with its shareID; admin access is refused.
TEST_F(KubePluginE2E, EveryResultShapeOfTheAllocatorIsPreparedOrRefusedClearly) {
  start_plugin();
  json a = result("gpu-0", {{"memory", "2Gi"}, {"share", "250m"}});
  a["shareID"] = "00000000-aaaa-4bbb-8ccc-000000000001";
  json b = result("gpu-1", {{"memory", "2Gi"}, {"share", "250m"}});
  b["shareID"] = "00000000-aaaa-4bbb-8ccc-000000000002";
  json other = {{"request", "nic"}, {"driver", "nic.example.com"}, {"pool", kNode}, {"device", "eth1"}};
  const auto claim = write_claim(30, {a, other, b});
  const auto response = prepare({claim});
  const auto& prepared = response.claims().at(claim.uid);
  ASSERT_EQ(prepared.error(), "");
  ASSERT_EQ(prepared.devices_size(), 2);
  EXPECT_EQ(prepared.devices(0).share_id(), "00000000-aaaa-4bbb-8ccc-000000000001");
  EXPECT_EQ(prepared.devices(1).share_id(), "00000000-aaaa-4bbb-8ccc-000000000002");
  const control::Reply got = call({{"op", "get"}, {"name", "dra-" + claim.uid}});
  ASSERT_TRUE(got.ok) << got.error;
  EXPECT_EQ(got.body["tenant"]["gpus"].size(), 2u) << got.body.dump();

  json admin = result("gpu-2");
  admin["adminAccess"] = true;
  const auto monitor = write_claim(31, {admin});
  const std::string error = prepare({monitor}).claims().at(monitor.uid).error();
  EXPECT_NE(error.find("admin access"), std::string::npos) << error;
  EXPECT_EQ(api_tenants(), std::vector<std::string>{"dra-" + claim.uid});
}

// Requirement (issue 23, 8): a fenced GPU stays in the slice with the taint
// gpu.fracgpu.io/unhealthy=<reason>:NoSchedule (the scheduler gives it to no
// new claim), its capacities as before; cleared, the taint goes. The taint's
// timeAdded (set by the API server) is kept while the fence lasts.
TEST_F(KubePluginE2E, AFencedGpuIsTaintedNoScheduleAndCleanAgainWhenCleared) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  write_file(faults_path_, "1 lost\n");
  ASSERT_TRUE(slice_eventually([](const json& d) {
    const json* gpu1 = find_device(d, "gpu-1");
    return d.size() == 3 && gpu1 && gpu1->contains("taints");
  })) << slice_devices().dump();
  json devices = slice_devices();
  const json taints = (*find_device(devices, "gpu-1"))["taints"];
  ASSERT_EQ(taints.size(), 1u) << taints.dump();
  EXPECT_EQ(taints[0]["key"], "gpu.fracgpu.io/unhealthy");
  EXPECT_EQ(taints[0]["value"], "gpu-lost");
  EXPECT_EQ(taints[0]["effect"], "NoSchedule");
  EXPECT_FALSE(taints[0].value("timeAdded", std::string()).empty()) << taints.dump();
  const json& gpu1 = *find_device(devices, "gpu-1");
  EXPECT_EQ(gpu1["capacity"]["memory"]["value"], std::to_string(16 * kGiB));
  EXPECT_EQ(gpu1["capacity"]["share"]["value"], "1");
  EXPECT_EQ(gpu1["attributes"]["uuid"]["string"], kUuids[1]);
  EXPECT_FALSE(find_device(devices, "gpu-0")->contains("taints"));
  EXPECT_FALSE(find_device(devices, "gpu-2")->contains("taints"));
  // While fenced, republishing (every 0.2 s here) writes nothing new.
  const size_t writes = api_->writes().size();
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ(api_->writes().size(), writes);
  EXPECT_EQ((*find_device(slice_devices(), "gpu-1"))["taints"], taints);
  EXPECT_NE(read_file(plugin_log_).find("tainted gpu-1 (gpu.fracgpu.io/unhealthy=gpu-lost):NoSchedule"),
            std::string::npos)
      << read_file(plugin_log_);

  write_file(faults_path_, "");
  EXPECT_TRUE(slice_eventually([](const json& d) {
    return d.size() == 3 && std::none_of(d.begin(), d.end(), [](const json& x) { return x.contains("taints"); });
  })) << slice_devices().dump();
}

// The kubelet takes a device it has heard nothing of for 30 s as Unknown
// (DefaultHealthTimeout in its health cache, counted from each message's
// arrival): with nothing changing, the whole list comes again within 10 s.
TEST_F(KubePluginE2E, TheHealthStreamRepeatsTheListBeforeTheKubeletsTimeout) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }));
  grpc::ClientContext context;
  auto stream = watch_health(&context, 30s);
  v1alpha1::NodeWatchResourcesResponse first, second;
  ASSERT_TRUE(stream->Read(&first)) << stream->Finish().error_message();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(stream->Read(&second)) << "nothing after the first list";
  const auto gap = std::chrono::steady_clock::now() - t0;
  EXPECT_LE(gap, 12s) << "the kubelet would have marked the devices Unknown at 30 s";
  EXPECT_GE(gap, 5s) << "repeated without a change far sooner than needed";
  EXPECT_EQ(second.devices_size(), 3);
  for (const auto& d : second.devices()) EXPECT_EQ(d.health(), v1alpha1::HEALTHY) << d.device().device_name();
  context.TryCancel();
}

// Requirement (issue 23, 8): the kubelet's DRA health stream
// (v1alpha1.DRAResourceHealth/NodeWatchResources, on the DRA socket): every
// device of the pool at once, then again at each change: Unhealthy while
// fenced, Healthy when cleared, Unknown while fracgpud does not answer. The
// open stream does not hold up prepare calls, and ends cleanly when the plugin stops.
TEST_F(KubePluginE2E, TheKubeletsHealthStreamFollowsTheFence) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; }));
  grpc::ClientContext context;
  auto stream = watch_health(&context, 60s);
  using Health = std::map<std::string, std::pair<v1alpha1::HealthStatus, int64_t>>;
  // The next message, as device -> (health, last_updated_time).
  auto next = [&](Health* out) {
    v1alpha1::NodeWatchResourcesResponse response;
    if (!stream->Read(&response)) return false;
    out->clear();
    for (const auto& d : response.devices()) {
      EXPECT_EQ(d.device().pool_name(), kNode);
      (*out)[d.device().device_name()] = {d.health(), d.last_updated_time()};
    }
    return true;
  };
  // Reads until `holds` (each message is the whole pool).
  auto read_until = [&](const std::function<bool(const Health&)>& holds, Health* out) {
    while (next(out))
      if (holds(*out)) return true;
    return false;
  };
  const int64_t started = static_cast<int64_t>(time(nullptr));
  Health now;
  ASSERT_TRUE(next(&now)) << "no first message: " << stream->Finish().error_message();
  ASSERT_EQ(now.size(), 3u);
  for (const char* d : {"gpu-0", "gpu-1", "gpu-2"}) {
    ASSERT_TRUE(now.count(d)) << d;
    EXPECT_EQ(now[d].first, v1alpha1::HEALTHY) << d;
    EXPECT_GT(now[d].second, started - 60) << d;
    EXPECT_LE(now[d].second, started + 1) << d;
  }

  write_file(faults_path_, "1 lost\n");
  ASSERT_TRUE(read_until([](const Health& h) { return h.at("gpu-1").first == v1alpha1::UNHEALTHY; }, &now));
  EXPECT_EQ(now["gpu-0"].first, v1alpha1::HEALTHY);
  EXPECT_EQ(now["gpu-2"].first, v1alpha1::HEALTHY);
  const int64_t fenced_at = now["gpu-1"].second;
  EXPECT_GE(fenced_at, started);

  // A prepare is answered while the stream is open.
  const auto claim = write_claim(1, {result("gpu-0", {{"memory", "4Gi"}, {"share", "250m"}})});
  EXPECT_EQ(prepare({claim}).claims().at(claim.uid).error(), "");
  EXPECT_EQ(unprepare(claim), "");

  write_file(faults_path_, "");
  ASSERT_TRUE(read_until([](const Health& h) { return h.at("gpu-1").first == v1alpha1::HEALTHY; }, &now));
  EXPECT_GE(now["gpu-1"].second, fenced_at);
  EXPECT_EQ(now["gpu-0"].first, v1alpha1::HEALTHY);

  // Without the daemon nobody can vouch for the GPUs.
  stop_daemon();
  ASSERT_TRUE(read_until(
      [](const Health& h) {
        return std::all_of(h.begin(), h.end(), [](const auto& d) { return d.second.first == v1alpha1::UNKNOWN; });
      },
      &now));
  start_daemon();
  ASSERT_TRUE(read_until(
      [](const Health& h) {
        return h.size() == 3 &&
               std::all_of(h.begin(), h.end(), [](const auto& d) { return d.second.first == v1alpha1::HEALTHY; });
      },
      &now));

  // Stopping the plugin ends the stream cleanly, without waiting out the deadline.
  const auto stopping = std::chrono::steady_clock::now();
  stop_plugin();
  while (next(&now)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - stopping, 10s);
}

// Requirement (issue 33, 2): a pod that asks in the old style,
// resources.limits {gpu.fracgpu.io/gpu: 1} (deploy/examples/
// extended-resource-pod.yaml), gets the claim the kube-scheduler makes for
// it with the DeviceClass of deploy/ (the stand-in models it field by field:
// tests/kube/fake_scheduler.py), and the plugin prepares that claim as any
// other: one whole GPU, one no other claim holds any of.
TEST_F(KubePluginE2E, AnOldStylePodGetsTheSchedulersClaimAndAWholeGpu) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  // Part of GPU 0 is held: the whole GPU must be another.
  const auto other = write_claim(40, {result("gpu-0", {{"memory", "4Gi"}, {"share", "250m"}})});
  ASSERT_EQ(prepare({other}).claims().at(other.uid).error(), "");

  json pod = manifest("examples/extended-resource-pod.yaml").at(0);
  pod["metadata"]["namespace"] = "team-a";
  pod["metadata"]["uid"] = uid_of(41);
  const kube::HttpResult r = schedule(pod);
  ASSERT_TRUE(r.ok()) << r.status << " " << r.body;
  const json answer = json::parse(r.body);
  ASSERT_EQ(answer["claims"].size(), 1u) << r.body;
  const json claim = answer["claims"][0];

  // The claim as the scheduler writes it.
  const json& meta = claim["metadata"];
  const std::string prefix = "extended-resource-pod-extended-resources-";
  EXPECT_EQ(meta["generateName"], prefix);
  EXPECT_EQ(meta["name"].get<std::string>().substr(0, prefix.size()), prefix);
  EXPECT_EQ(meta["name"].get<std::string>().size(), prefix.size() + 5);
  EXPECT_EQ(meta["namespace"], "team-a");
  EXPECT_EQ(meta["annotations"], json({{"resource.kubernetes.io/extended-resource-claim", "true"}}));
  EXPECT_EQ(meta["ownerReferences"], json::parse(R"([{"apiVersion": "v1", "kind": "Pod",
      "name": "extended-resource-pod", "uid": ")" + uid_of(41) + R"(", "controller": true}])"));
  EXPECT_EQ(meta["finalizers"], json({"resource.kubernetes.io/delete-protection"}));
  EXPECT_EQ(claim["spec"], json::parse(R"({"devices": {"requests": [{"name": "container-0-request-0",
      "exactly": {"deviceClassName": "gpu.fracgpu.io", "allocationMode": "ExactCount", "count": 1}}]}})"));
  const json& results = claim["status"]["allocation"]["devices"]["results"];
  ASSERT_EQ(results.size(), 1u) << claim.dump();
  EXPECT_EQ(results[0]["request"], "container-0-request-0");
  EXPECT_NE(results[0]["device"], "gpu-0");
  EXPECT_EQ(results[0]["consumedCapacity"]["share"], "1");
  const json config = claim["status"]["allocation"]["devices"]["config"];
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["source"], "FromClass");
  EXPECT_EQ(config[0]["requests"], json({"container-0-request-0"}));
  EXPECT_EQ(claim["status"]["reservedFor"],
            json::parse(R"([{"resource": "pods", "name": "extended-resource-pod", "uid": ")" + uid_of(41) + "\"}]"));
  EXPECT_EQ(answer["pod"]["status"]["extendedResourceClaimStatus"],
            json::parse(R"({"requestMappings": [{"containerName": "train", "resourceName": "gpu.fracgpu.io/gpu",
                "requestName": "container-0-request-0"}], "resourceClaimName": ")" +
                        meta["name"].get<std::string>() + "\"}"));

  // Prepared by name and uid as the kubelet asks, from the claim the API serves.
  const auto ref = ref_of(claim);
  const auto response = prepare({ref});
  const auto& prepared = response.claims().at(ref.uid);
  ASSERT_EQ(prepared.error(), "");
  ASSERT_EQ(prepared.devices_size(), 1);
  ASSERT_EQ(prepared.devices(0).request_names_size(), 1);
  EXPECT_EQ(prepared.devices(0).request_names(0), "container-0-request-0");  // what requestMappings names
  EXPECT_EQ(prepared.devices(0).cdi_device_ids(0), "gpu.fracgpu.io/claim=" + ref.uid);
  const control::Reply got = call({{"op", "get"}, {"name", "dra-" + ref.uid}});
  ASSERT_TRUE(got.ok) << got.error;
  const json& gpus = got.body["tenant"]["gpus"];
  ASSERT_EQ(gpus.size(), 1u);
  EXPECT_NE(gpus[0]["uuid"], kUuids[0]);
  EXPECT_EQ(gpus[0]["share"], 1.0);
  EXPECT_EQ(gpus[0]["memory"], 16 * kGiB);
  const std::string out = run_in_container(ref.uid, {"init", "devices", "primary", "0", "info"});
  EXPECT_NE(out.find("devices=1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("total=" + std::to_string(16 * kGiB) + "\n"), std::string::npos) << out;

  // Two more whole GPUs: only one is free of claims. Nothing is written.
  json greedy = pod;
  greedy["metadata"]["name"] = "greedy";
  greedy["metadata"]["uid"] = uid_of(42);
  greedy["spec"]["containers"][0]["resources"]["limits"]["gpu.fracgpu.io/gpu"] = 2;
  const kube::HttpResult refused = schedule(greedy);
  EXPECT_EQ(refused.status, 409) << refused.body;
  EXPECT_NE(refused.body.find("1 of 2 device(s)"), std::string::npos) << refused.body;
  // Half a GPU cannot be asked this way: the API server refuses the pod.
  json half = pod;
  half["metadata"]["name"] = "half";
  half["spec"]["containers"][0]["resources"]["limits"]["gpu.fracgpu.io/gpu"] = "500m";
  const kube::HttpResult invalid = schedule(half);
  EXPECT_EQ(invalid.status, 422) << invalid.body;
  EXPECT_NE(invalid.body.find("must be an integer"), std::string::npos) << invalid.body;

  EXPECT_EQ(unprepare(ref), "");
  EXPECT_EQ(unprepare(other), "");
  EXPECT_TRUE(api_tenants().empty());
}

// The plugin's permissions as deploy/rbac.yaml's ClusterRole grants them,
// without the rules `drop` names (a resource), its token bound to `node`.
json plugin_rules(const std::string& drop = "") {
  for (const json& d : manifest("rbac.yaml"))
    if (d["kind"] == "ClusterRole") {
      json rules = json::array();
      for (const json& r : d["rules"])
        if (drop.empty() || std::find(r["resources"].begin(), r["resources"].end(), drop) == r["resources"].end())
          rules.push_back(r);
      return rules;
    }
  return nullptr;
}

// A pod with one claim: 4 GiB and half of a GPU, latency first, up to 0.75.
json status_pod(int uid) {
  return {{"apiVersion", "v1"},
          {"kind", "Pod"},
          {"metadata", {{"name", "status-pod"}, {"namespace", "team-a"}, {"uid", uid_of(uid)}}},
          {"spec",
           {{"resourceClaims", {{{"name", "gpu"}, {"resourceClaimTemplateName", "status-half"}}}},
            {"containers", {{{"name", "c"}, {"image", "x"}, {"resources", {{"claims", {{{"name", "gpu"}}}}}}}}}}}};
}
json status_template() {
  return json::parse(R"({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
    "metadata": {"name": "status-half"},
    "spec": {"spec": {"devices": {
      "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fracgpu.io",
                    "capacity": {"requests": {"memory": "4Gi", "share": "500m"}}}}],
      "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.fracgpu.io", "parameters": {
                    "apiVersion": "gpu.fracgpu.io/v1alpha1", "kind": "GpuConfig",
                    "limit": "0.75", "priority": "latency"}}}]}}}})");
}

class KubePluginStatusE2E : public KubePluginE2E {
 protected:
  // The plugin started with `rules` (its token bound to this node), the
  // status pod bound with its claim, the claim prepared: *claim.
  void prepare_status_claim(const json& rules, int uid, json* claim) {
    ASSERT_TRUE(api_control_->post("/fake/rbac", {{"rules", rules}, {"node", kNode}}).ok());
    start_plugin();
    ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
    const kube::HttpResult r = schedule(status_pod(uid), {status_template()});
    ASSERT_TRUE(r.ok()) << r.status << " " << r.body;
    *claim = json::parse(r.body)["claims"].at(0);
    const auto ref = ref_of(*claim);
    ASSERT_EQ(prepare({ref}).claims().at(ref.uid).error(), "");
  }
};

// A plugin killed after writing a claim's record and before making its
// tenant, then started again: the claim is not reported Ready (nothing of it
// exists); the kubelet's retry makes it, and then it is.
TEST_F(KubePluginStatusE2E, AClaimWhosePrepareNeverFinishedIsNotReportedReadyAfterARestart) {
  ASSERT_TRUE(api_control_->post("/fake/rbac", {{"rules", plugin_rules()}, {"node", kNode}}).ok());
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  const kube::HttpResult r = schedule(status_pod(62), {status_template()});
  ASSERT_TRUE(r.ok()) << r.status << " " << r.body;
  const auto ref = ref_of(json::parse(r.body)["claims"].at(0));
  stop_plugin();
  prepare_until_crash(ref, "after-record");
  ASSERT_TRUE(fs::exists(record_path(ref.uid)));
  start_plugin();
  const std::string path = claims_dir_ + "/team-a/" + ref.name + ".json";
  const auto reported = [&] {
    const json stored = json::parse(read_file(path), nullptr, false);
    return stored.is_object() && stored["status"].contains("devices") && !stored["status"]["devices"].empty();
  };
  std::this_thread::sleep_for(3s);
  EXPECT_FALSE(reported()) << read_file(path);
  EXPECT_NE(read_file(plugin_log_).find("not reported prepared until it is"), std::string::npos);
  ASSERT_EQ(prepare({ref}).claims().at(ref.uid).error(), "");
  EXPECT_TRUE(eventually(reported, 10s)) << read_file(plugin_log_);
  EXPECT_EQ(unprepare(ref), "");
}

// Requirement (issue 33, 3): what a claim got, on the claim. The plugin,
// with exactly deploy/rbac.yaml's permissions (the stand-in authorizes as
// RBAC and the 1.36 granular check do), writes status.devices by
// server-side apply: the allocated device's key, Ready and GPUHealthy, and
// the tenant's memory, share, limit, priority and the GPU's health; the
// entry follows the GPU when fracgpud fences it and when the fence clears.
TEST_F(KubePluginStatusE2E, TheClaimShowsWhatItGotAndFollowsTheGpusHealth) {
  json claim;
  ASSERT_NO_FATAL_FAILURE(prepare_status_claim(plugin_rules(), 60, &claim));
  const auto ref = ref_of(claim);
  const json allocated = claim["status"]["allocation"]["devices"]["results"].at(0);
  const std::string path = claims_dir_ + "/team-a/" + ref.name + ".json";
  const auto entry = [&]() -> json {
    const json stored = json::parse(read_file(path), nullptr, false);
    const json devices = stored.is_object() && stored["status"].contains("devices") ? stored["status"]["devices"]
                                                                                     : json::array();
    return devices.size() == 1 ? devices[0] : json();
  };
  ASSERT_TRUE(eventually([&] { return !entry().is_null(); }, 10s)) << read_file(plugin_log_);
  json d = entry();
  EXPECT_EQ(d["driver"], "gpu.fracgpu.io");
  EXPECT_EQ(d["pool"], kNode);
  EXPECT_EQ(d["device"], allocated["device"]);
  EXPECT_EQ(d["shareID"], allocated["shareID"]);
  ASSERT_EQ(d["conditions"].size(), 2u) << d.dump();
  EXPECT_EQ(d["conditions"][0]["type"], "Ready");
  EXPECT_EQ(d["conditions"][0]["status"], "True");
  EXPECT_EQ(d["conditions"][1]["type"], "GPUHealthy");
  EXPECT_EQ(d["conditions"][1]["status"], "True");
  const int index = std::stoi(allocated["device"].get<std::string>().substr(4));
  EXPECT_EQ(d["data"]["tenant"], "dra-" + ref.uid);
  EXPECT_EQ(d["data"]["gpu"], kUuids[index]);
  EXPECT_EQ(d["data"]["memory"], std::to_string(4 * kGiB));
  EXPECT_EQ(d["data"]["share"], 0.5);
  EXPECT_EQ(d["data"]["limit"], 0.75);
  EXPECT_EQ(d["data"]["priority"], "latency");
  EXPECT_EQ(d["data"]["health"], "Healthy");
  // The allocation is the scheduler's and stays as it was.
  EXPECT_EQ(json::parse(read_file(path))["status"]["allocation"], claim["status"]["allocation"]);

  write_file(faults_path_, std::to_string(index) + " lost\n");
  ASSERT_TRUE(eventually([&] { return entry()["conditions"][1]["status"] == "False"; }, 15s)) << entry().dump();
  d = entry();
  EXPECT_EQ(d["conditions"][1]["reason"], "GpuLost");
  EXPECT_EQ(d["conditions"][0]["status"], "True") << "the tenant is still there";
  EXPECT_EQ(d["data"]["health"], "Unhealthy");
  EXPECT_EQ(d["data"]["fenceReason"], "gpu-lost");
  write_file(faults_path_, "");
  ASSERT_TRUE(eventually([&] { return entry()["conditions"][1]["status"] == "True"; }, 15s)) << entry().dump();
  EXPECT_EQ(entry()["data"]["health"], "Healthy");
  EXPECT_FALSE(entry()["data"].contains("fenceReason"));

  // Every write was a server-side apply of the status subresource, allowed.
  size_t applies = 0;
  for (const json& q : json::parse(api_control_->get("/fake/requests").body))
    if (q["method"] == "PATCH") {
      ++applies;
      EXPECT_NE(q["path"].get<std::string>().find("/resourceclaims/" + ref.name + "/status?fieldManager="),
                std::string::npos);
      EXPECT_EQ(q["status"], 200) << q.dump();
    }
  EXPECT_GE(applies, 3u);
  EXPECT_EQ(unprepare(ref), "");
}

// The stand-in checks a claim's status as the 1.36 API server does, and so
// would refuse what the plugin must never write; without the driver's
// granular permission (an rbac.yaml from before 1.36) the plugin's writes are
// refused, said in its log, and the pod's claim is prepared all the same.
TEST_F(KubePluginStatusE2E, TheClaimStatusIsCheckedAndAuthorizedAsTheApiServerDoes) {
  json claim;
  ASSERT_NO_FATAL_FAILURE(prepare_status_claim(plugin_rules("resourceclaims/driver"), 61, &claim));
  const auto ref = ref_of(claim);
  ASSERT_TRUE(eventually(
      [&] { return read_file(plugin_log_).find("associated-node:patch") != std::string::npos; }, 10s))
      << read_file(plugin_log_);
  const std::string path = claims_dir_ + "/team-a/" + ref.name + ".json";
  EXPECT_FALSE(json::parse(read_file(path))["status"].contains("devices"));

  // As the plugin would write it, by hand, with the plugin's credentials.
  const json allocated = claim["status"]["allocation"]["devices"]["results"].at(0);
  const auto body = [&](json entry) {
    return json{{"apiVersion", "resource.k8s.io/v1"},
                {"kind", "ResourceClaim"},
                {"metadata", {{"name", ref.name}, {"namespace", ref.ns}, {"uid", ref.uid}}},
                {"status", {{"devices", json::array({std::move(entry)})}}}};
  };
  json good = {{"driver", "gpu.fracgpu.io"},
               {"pool", kNode},
               {"device", allocated["device"]},
               {"shareID", allocated["shareID"]},
               {"conditions",
                {{{"type", "Ready"}, {"status", "True"}, {"reason", "TenantReady"},
                  {"lastTransitionTime", "2026-01-01T00:00:00Z"}, {"message", ""}}}},
               {"data", {{"tenant", "dra-" + ref.uid}}}};
  const std::string status_path = kube_plugin::claim_status_path(ref);
  auto client = api_client();
  kube::HttpResult w = client->apply(status_path, body(good));
  EXPECT_EQ(w.status, 403) << w.body;
  EXPECT_NE(w.body.find("resourceclaims/driver"), std::string::npos) << w.body;
  // With the permission, but for claims of another node only.
  ASSERT_TRUE(api_control_->post("/fake/rbac", {{"rules", plugin_rules()}, {"node", "node-2"}}).ok());
  w = client->apply(status_path, body(good));
  EXPECT_EQ(w.status, 403) << w.body;
  EXPECT_NE(w.body.find("arbitrary-node:patch"), std::string::npos) << w.body;
  ASSERT_TRUE(api_control_->post("/fake/rbac", {{"rules", plugin_rules()}, {"node", kNode}}).ok());

  json other_device = good;
  other_device["device"] = "gpu-9";
  w = client->apply(status_path, body(other_device));
  EXPECT_EQ(w.status, 422);
  EXPECT_NE(w.body.find("must be an allocated device in the claim"), std::string::npos) << w.body;
  json listed_data = good;
  listed_data["data"] = json::array({1, 2});
  w = client->apply(status_path, body(listed_data));
  EXPECT_EQ(w.status, 422);
  EXPECT_NE(w.body.find("must be a valid JSON object"), std::string::npos) << w.body;
  json bad_condition = good;
  bad_condition["conditions"][0]["reason"] = "not a reason";
  w = client->apply(status_path, body(bad_condition));
  EXPECT_EQ(w.status, 422);
  EXPECT_NE(w.body.find("reason"), std::string::npos) << w.body;
  json unknown_field = good;
  unknown_field["health"] = "ok";
  w = client->apply(status_path, body(unknown_field));
  EXPECT_EQ(w.status, 422) << w.body;  // the 1.36 schema has no such field
  json another_claim = body(good);
  another_claim["metadata"]["uid"] = uid_of(99);
  w = client->apply(status_path, another_claim);
  EXPECT_EQ(w.status, 409) << w.body;
  w = client->apply(status_path, body(good));
  EXPECT_EQ(w.status, 200) << w.body;
  EXPECT_EQ(json::parse(read_file(path))["status"]["devices"][0]["data"]["tenant"], "dra-" + ref.uid);

  // Permitted now: the plugin's next write (a pause after the refusal) replaces the hand-written entry.
  ASSERT_TRUE(eventually(
      [&] {
        const json stored = json::parse(read_file(path));
        return stored["status"]["devices"].size() == 1 &&
               stored["status"]["devices"][0]["data"].value("priority", "") == "latency";
      },
      30s))
      << read_file(path);
  EXPECT_EQ(unprepare(ref), "");
}

// The node of the examples: three simulated 80 GB H100s (79.6 GiB each).
class KubePluginExamplesE2E : public KubePluginE2E {
 protected:
  KubePluginExamplesE2E() {
    devices_.clear();
    for (const auto& uuid : kUuids)
      devices_ += (devices_.empty() ? "" : ";") + ("uuid=" + uuid + ",name=Sim H100,mem=81559MiB,ctx=64MiB,cc=9.0");
  }

  // Every copy of the pod each document of `relative` runs (a Pod once, a
  // Deployment `replicas` times, a Job once), bound to the node with its
  // claims, and every claim prepared. Returns the claims.
  std::vector<json> schedule_and_prepare(const std::string& relative, int first_uid) {
    const std::vector<json> docs = manifest(relative);
    std::vector<json> templates, claims;
    for (const json& d : docs)
      if (d["kind"] == "ResourceClaimTemplate") templates.push_back(d);
    int n = first_uid;
    for (const json& d : docs) {
      const std::string kind = d["kind"];
      if (kind != "Pod" && kind != "Deployment" && kind != "Job") continue;
      const json spec = kind == "Pod" ? d["spec"] : d["spec"]["template"]["spec"];
      const int copies = kind == "Deployment" ? d["spec"].value("replicas", 1) : 1;
      for (int i = 0; i < copies; ++i) {
        const std::string name = d["metadata"]["name"].get<std::string>() + (kind == "Pod" ? "" : "-" + std::to_string(i));
        const json pod = {{"apiVersion", "v1"},
                          {"kind", "Pod"},
                          {"metadata", {{"name", name}, {"namespace", "team-a"}, {"uid", uid_of(n++)}}},
                          {"spec", spec}};
        const kube::HttpResult r = schedule(pod, templates);
        EXPECT_TRUE(r.ok()) << relative << ": " << name << ": " << r.status << " " << r.body;
        if (!r.ok()) continue;
        const json answer = json::parse(r.body);
        for (const json& c : answer["claims"]) {
          const auto ref = ref_of(c);
          const std::string error = prepare({ref}).claims().at(ref.uid).error();
          EXPECT_EQ(error, "") << relative << ": " << name << ": claim " << c.dump();
          claims.push_back(c);
        }
      }
    }
    return claims;
  }

  void unprepare_all(const std::vector<json>& claims) {
    for (const json& c : claims) {
      EXPECT_EQ(unprepare(ref_of(c)), "");
      forget_claim(c);
    }
    EXPECT_TRUE(api_tenants().empty());
  }

  json tenant_of(const json& claim) {
    const control::Reply got = call({{"op", "get"}, {"name", "dra-" + claim["metadata"]["uid"].get<std::string>()}});
    EXPECT_TRUE(got.ok) << got.error;
    return got.body["tenant"];
  }
};

// Requirement (issue 33, 5): every example in deploy/examples/, as a user
// would apply it, is bound to a node with its claims (made from its
// templates by the stand-in, or for its extended resources) and prepared;
// the examples new with this requirement are checked for what they promise.
TEST_F(KubePluginExamplesE2E, EveryExampleIsScheduledAndPrepared) {
  start_plugin();
  ASSERT_TRUE(slice_eventually([](const json& d) { return d.size() == 3; })) << slice_devices().dump();
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(std::string(DEPLOY_DIR) + "/examples"))
    if (entry.path().extension() == ".yaml") files.push_back("examples/" + entry.path().filename().string());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 3u);
  int uid = 500;
  for (const std::string& file : files) {
    SCOPED_TRACE(file);
    const std::vector<json> claims = schedule_and_prepare(file, uid);
    uid += 20;
    EXPECT_FALSE(claims.empty());
    if (file == "examples/vllm-inference-deployment.yaml") {
      // Four replicas, four tenants, each a quarter with 18 GiB, latency
      // first. Which GPUs they land on is the scheduler's choice (the
      // example promises one GPU only where no other has room): whatever
      // it chose, no GPU is given more time or memory than it has.
      ASSERT_EQ(claims.size(), 4u);
      std::map<std::string, std::pair<double, uint64_t>> per_gpu;
      for (const json& c : claims) {
        const json t = tenant_of(c);
        ASSERT_EQ(t["gpus"].size(), 1u) << t.dump();
        auto& [share, memory] = per_gpu[t["gpus"][0]["uuid"].get<std::string>()];
        share += t["gpus"][0]["share"].get<double>();
        memory += t["gpus"][0]["memory"].get<uint64_t>();
        EXPECT_EQ(t["gpus"][0]["share"], 0.25);
        EXPECT_EQ(t["gpus"][0]["memory"], 18 * kGiB);
        EXPECT_EQ(t["gpus"][0]["limit"], 1.0);
        EXPECT_EQ(t["priority"], "latency");
      }
      for (const auto& [uuid, used] : per_gpu) {
        EXPECT_LE(used.first, 1.0) << uuid;
        EXPECT_LE(used.second, 81559ull << 20) << uuid;
      }
    } else if (file == "examples/training-job-two-and-a-half-gpus.yaml") {
      ASSERT_EQ(claims.size(), 1u);
      const json t = tenant_of(claims[0]);
      ASSERT_EQ(t["gpus"].size(), 3u) << t.dump();
      double shares = 0;
      for (const json& g : t["gpus"]) {
        shares += g["share"].get<double>();
        if (g["share"] == 0.5) {
          EXPECT_EQ(g["memory"], 40 * kGiB);
        }
      }
      EXPECT_EQ(shares, 2.5);
      EXPECT_EQ(t["priority"], "batch");
    } else if (file == "examples/extended-resource-pod.yaml") {
      ASSERT_EQ(claims.size(), 1u);
      EXPECT_EQ(claims[0]["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"], "true");
      const json t = tenant_of(claims[0]);
      ASSERT_EQ(t["gpus"].size(), 1u) << t.dump();
      EXPECT_EQ(t["gpus"][0]["share"], 1.0);
    }
    unprepare_all(claims);
  }
}

}  // namespace

// The node's ResourceSlice: quantities, the JSON built from the control API's
// NODE object, its conformance with resource.k8s.io/v1's validation, and the
// publisher's create / update / no-op / delete against the stand-in API server.
#include <algorithm>
#include <functional>
#include <limits>
#include <regex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "kube/kube_test_util.h"
#include "kube/quantity.h"
#include "kube/resource_slice.h"

namespace fracgpu::kube::testing {
namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
const std::string kNode = "node-a";

// ---- Quantities ----

TEST(KubeQuantity, ParsesTheApiGrammar) {
  auto q = [](std::string_view text) {
    std::string why;
    auto parsed = Quantity::parse(text, &why);
    EXPECT_TRUE(parsed) << text << ": " << why;
    return parsed.value_or(Quantity());
  };
  EXPECT_EQ(q("20Gi").value(), int64_t(20 * kGiB));
  EXPECT_EQ(q("256Mi").value(), int64_t(256 * kMiB));
  EXPECT_EQ(q("85899345920").value(), 85899345920);
  EXPECT_EQ(q("80G").value(), 80'000'000'000);
  EXPECT_EQ(q("1.5Gi").value(), int64_t(3 * kGiB / 2));
  EXPECT_EQ(q("500m").milli_value(), 500);
  EXPECT_EQ(q("0.5").milli_value(), 500);
  EXPECT_EQ(q(".25").milli_value(), 250);
  EXPECT_EQ(q("1").milli_value(), 1000);
  EXPECT_EQ(q("+2").value(), 2);
  EXPECT_EQ(q("-3k").value(), -3000);
  EXPECT_EQ(q("1e3").value(), 1000);
  EXPECT_EQ(q("25E-2").milli_value(), 250);
  EXPECT_EQ(q("2E").value(), 2'000'000'000'000'000'000);  // E alone is exa
  EXPECT_EQ(q("1u").micro_value(), 1);
  EXPECT_EQ(q("1500n").micro_value(), 2);  // rounded up, as Value() and MilliValue() do
  EXPECT_EQ(q("1500n").micro_value_floor(), 1);
  EXPECT_EQ(q("2000n").micro_value_floor(), 2);
  EXPECT_EQ(q("-1500n").micro_value_floor(), -2);
  // Beyond 64 bits of millionths: clamped, never a negated INT64_MIN (undefined).
  EXPECT_EQ(q("9e18").micro_value_floor(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(q("-9e18").micro_value_floor(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(q("500m").value(), 1);
  EXPECT_EQ(q("0.0000000001").micro_value(), 1);  // finer than 1n: rounded up to 1n
  // Written differently, the same value.
  EXPECT_EQ(q("1"), q("1000m"));
  EXPECT_EQ(q("80Gi"), q("85899345920"));
  EXPECT_EQ(q("1k").decimal(), "1000");
  EXPECT_EQ(q("750m").decimal(), "0.75");
  EXPECT_EQ(q("-1500m").decimal(), "-1.5");
  EXPECT_EQ(q("-500m").decimal(), "-0.5");
  EXPECT_LT(q("999m"), q("1"));
}

TEST(KubeQuantity, RefusesWhatIsNotAQuantity) {
  for (const char* bad : {"", "Gi", "1GB", "1 Gi", "1.2.3", "0x10", "1Ki2", "e3", "1e", "1e+", "--1", "1gi",
                          "99999999999999999999Ei", "1e400", "10000000000000000000", "1.0000000000000000000000000000001"}) {
    std::string why;
    EXPECT_FALSE(Quantity::parse(bad, &why)) << bad;
    EXPECT_FALSE(why.empty()) << bad;
  }
  std::string why;
  Quantity::parse("12gb", &why);
  EXPECT_EQ(why, "has an unknown suffix \"gb\"");
}

TEST(KubeQuantity, FormatsBytesAndThousandths) {
  EXPECT_EQ(bytes_quantity(85899345920ull), "85899345920");
  EXPECT_EQ(milli_quantity(1000), "1");
  EXPECT_EQ(milli_quantity(750), "750m");
  EXPECT_EQ(milli_quantity(1), "1m");
  EXPECT_EQ(milli_quantity(0), "0");
  EXPECT_EQ(Quantity::parse(milli_quantity(333))->milli_value(), 333);
}

// ---- The slice's JSON ----

const json& device(const json& slice, const std::string& name) {
  for (const json& d : slice["spec"]["devices"])
    if (d["name"] == name) return d;
  static const json none;
  ADD_FAILURE() << "no device " << name << " in " << slice.dump(2);
  return none;
}

TEST(KubeResourceSlice, ShapeAndPool) {
  json slice = build_resource_slice(kNode, node_object(2), 7);
  EXPECT_EQ(slice["apiVersion"], "resource.k8s.io/v1");
  EXPECT_EQ(slice["kind"], "ResourceSlice");
  EXPECT_EQ(slice["metadata"]["name"], "node-a-gpu.fracgpu.io");
  EXPECT_EQ(slice["spec"]["driver"], "gpu.fracgpu.io");
  EXPECT_EQ(slice["spec"]["nodeName"], kNode);
  EXPECT_EQ(slice["spec"]["pool"], (json{{"name", kNode}, {"generation", 7}, {"resourceSliceCount", 1}}));
  ASSERT_EQ(slice["spec"]["devices"].size(), 2u);
  EXPECT_EQ(slice["spec"]["devices"][0]["name"], "gpu-0");
  EXPECT_EQ(slice["spec"]["devices"][1]["name"], "gpu-1");
  EXPECT_EQ(slice["spec"]["devices"][0]["allowMultipleAllocations"], true);
}

TEST(KubeResourceSlice, CapacitiesAreWhatConfigTenantsLeave) {
  json node = node_object(2);
  node["gpus"][1]["config_memory"] = 20 * kGiB;
  node["gpus"][1]["config_share"] = 0.25;
  json slice = build_resource_slice(kNode, node, 1);

  const json& whole = device(slice, "gpu-0")["capacity"];
  EXPECT_EQ(whole["memory"]["value"], "85899345920");
  EXPECT_EQ(whole["memory"]["requestPolicy"],
            (json{{"default", "85899345920"}, {"validRange", {{"min", "256Mi"}, {"step", "256Mi"}}}}));
  EXPECT_EQ(whole["share"], (json{{"value", "1"}}));

  const json& partial = device(slice, "gpu-1")["capacity"];
  EXPECT_EQ(partial["memory"]["value"], std::to_string(60 * kGiB));
  EXPECT_EQ(partial["memory"]["requestPolicy"]["default"], std::to_string(60 * kGiB));
  EXPECT_EQ(partial["share"]["value"], "750m");
}

TEST(KubeResourceSlice, MemoryDefaultIsTheLargestStepBelowTheValue) {
  json node = node_object(1);
  node["gpus"][0]["memory"] = 16 * kGiB;
  node["gpus"][0]["config_memory"] = 100 * kMiB;  // 16 GiB - 100 MiB: not on a 256 MiB step
  json slice = build_resource_slice(kNode, node, 1);
  const json& memory = device(slice, "gpu-0")["capacity"]["memory"];
  EXPECT_EQ(memory["value"], std::to_string(16 * kGiB - 100 * kMiB));
  EXPECT_EQ(memory["requestPolicy"]["default"], std::to_string(16 * kGiB - 256 * kMiB));
}

TEST(KubeResourceSlice, ShareRoundsDownToThousandths) {
  json node = node_object(1);
  node["gpus"][0]["config_share"] = 1.0 / 3;  // 0.666666... left
  json slice = build_resource_slice(kNode, node, 1);
  EXPECT_EQ(device(slice, "gpu-0")["capacity"]["share"]["value"], "666m");
}

TEST(KubeResourceSlice, ShareValidRangeWhenAsked) {
  json node = node_object(1);
  node["gpus"][0]["config_share"] = 0.5;
  json slice = build_resource_slice(kNode, node, 1, SliceOptions{.share_valid_range = true});
  EXPECT_EQ(device(slice, "gpu-0")["capacity"]["share"],
            (json{{"value", "500m"},
                  {"requestPolicy",
                   {{"default", "500m"}, {"validRange", {{"min", "1m"}, {"max", "500m"}, {"step", "1m"}}}}}}));
}

TEST(KubeResourceSlice, Attributes) {
  json slice = build_resource_slice(kNode, node_object(2), 1);
  const json& attributes = device(slice, "gpu-1")["attributes"];
  EXPECT_EQ(attributes, (json{{"uuid", {{"string", "GPU-00000001-1111-2222-3333-444444444444"}}},
                              {"productName", {{"string", "NVIDIA H100 80GB HBM3"}}},
                              {"index", {{"int", 1}}},
                              {"memory", {{"int", 85899345920}}},
                              {"computeCapability", {{"version", "9.0.0"}}},
                              {"driverVersion", {{"string", "550.54.15"}}},
                              {"cudaDriverVersion", {{"version", "12.4.0"}}}}));
}

TEST(KubeResourceSlice, UnknownVersionsAreLeftOutNotGuessed) {
  json node = node_object(1);
  node["driver_version"] = "";
  node["cuda_driver_version"] = 0;
  node["gpus"][0]["compute_capability"] = "unknown";
  node["gpus"][0]["name"] = std::string("H100\x1b[31m") + std::string(100, 'x');
  json slice = build_resource_slice(kNode, node, 1);
  const json& attributes = device(slice, "gpu-0")["attributes"];
  EXPECT_FALSE(attributes.contains("driverVersion"));
  EXPECT_FALSE(attributes.contains("cudaDriverVersion"));
  EXPECT_FALSE(attributes.contains("computeCapability"));
  std::string name = attributes["productName"]["string"];
  EXPECT_EQ(name.size(), kMaxAttributeStringBytes);
  EXPECT_EQ(name.rfind("H100?[31m", 0), 0u) << name;
}

TEST(KubeResourceSlice, FencedGpuIsAbsentAndComesBack) {
  json node = node_object(2);
  node["gpus"][0]["fenced"] = true;
  node["gpus"][0]["fence_reason"] = "Xid 79";
  std::vector<std::string> left_out;
  json fenced = build_resource_slice(kNode, node, 1, {}, &left_out);
  ASSERT_EQ(fenced["spec"]["devices"].size(), 1u);
  EXPECT_EQ(fenced["spec"]["devices"][0]["name"], "gpu-1");
  ASSERT_EQ(left_out.size(), 1u);
  EXPECT_EQ(left_out[0], "GPU-00000000-1111-2222-3333-444444444444: fenced by the health probe: Xid 79");

  node["gpus"][0]["fenced"] = false;
  json cleared = build_resource_slice(kNode, node, 2);
  EXPECT_EQ(cleared["spec"]["devices"].size(), 2u);
}

TEST(KubeResourceSlice, GpusWithNothingToOfferAreLeftOut) {
  json node = node_object(3);
  node["gpus"][0]["config_memory"] = node["gpus"][0]["memory"].get<uint64_t>() - 300 * kMiB;  // < min + step
  node["gpus"][1]["config_share"] = 1.0;
  std::vector<std::string> left_out;
  json slice = build_resource_slice(kNode, node, 1, {}, &left_out);
  ASSERT_EQ(slice["spec"]["devices"].size(), 1u);
  EXPECT_EQ(slice["spec"]["devices"][0]["name"], "gpu-2");
  ASSERT_EQ(left_out.size(), 2u);
  EXPECT_NE(left_out[0].find("below 536870912 B"), std::string::npos) << left_out[0];
  EXPECT_NE(left_out[1].find("no share left"), std::string::npos) << left_out[1];
}

TEST(KubeResourceSlice, OvercommitOffersTheWholeMemory) {
  json node = node_object(1);
  node["allow_overcommit"] = true;
  node["gpus"][0]["config_memory"] = 70 * kGiB;
  json slice = build_resource_slice(kNode, node, 1);
  EXPECT_EQ(device(slice, "gpu-0")["capacity"]["memory"]["value"], "85899345920");
}

TEST(KubeResourceSlice, MalformedNodeEntriesAreLeftOutWithoutThrowing) {
  json node = node_object(2);
  node["gpus"].push_back("not an object");
  node["gpus"].push_back({{"uuid", 7}, {"index", 2}});
  node["gpus"].push_back({{"uuid", "GPU-x"}, {"index", -1}, {"memory", 1}});
  node["gpus"].push_back({{"uuid", "GPU-y"}, {"index", 3}, {"memory", "lots"}});
  node["gpus"].push_back({{"uuid", "GPU-z"}, {"index", 4}, {"memory", 1e30}});
  node["gpus"].push_back(node["gpus"][0]);  // the same GPU twice
  node["gpus"].push_back({{"uuid", "GPU-w"}, {"index", 5}, {"memory", 16 * kGiB}, {"config_share", 1.5}});
  std::vector<std::string> left_out;
  json slice = build_resource_slice(kNode, node, 1, {}, &left_out);
  EXPECT_EQ(slice["spec"]["devices"].size(), 2u);
  EXPECT_EQ(left_out.size(), 7u);
  for (json weird : {json(nullptr), json(42), json::array(), json{{"gpus", "x"}}}) {
    left_out.clear();
    json empty = build_resource_slice(kNode, weird, 1, {}, &left_out);
    EXPECT_TRUE(empty["spec"]["devices"].empty());
    EXPECT_EQ(left_out.size(), 1u);
  }
}

TEST(KubeResourceSlice, AtMost128Devices) {
  json node = node_object(130);
  std::vector<std::string> left_out;
  json slice = build_resource_slice(kNode, node, 1, {}, &left_out);
  EXPECT_EQ(slice["spec"]["devices"].size(), kMaxDevicesPerSlice);
  EXPECT_EQ(left_out.size(), 2u);
}

TEST(KubeResourceSlice, SliceNames) {
  EXPECT_EQ(slice_name("node-a"), "node-a-gpu.fracgpu.io");
  EXPECT_EQ(slice_name("ip-10-0-0-1.ec2.internal"), "ip-10-0-0-1.ec2.internal-gpu.fracgpu.io");
  std::regex subdomain("^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$");
  // Too long, or not a DNS name: cut and hashed, always valid, never shared.
  std::string long_a(250, 'a'), long_b = long_a;
  long_b.back() = 'b';
  for (const std::string& node : {long_a, long_b, std::string("Node_A"), std::string("-x-"), std::string("")}) {
    std::string name = slice_name(node);
    EXPECT_LE(name.size(), 253u) << node;
    EXPECT_TRUE(std::regex_match(name, subdomain)) << name;
    EXPECT_TRUE(name.ends_with("-gpu.fracgpu.io")) << name;
  }
  EXPECT_NE(slice_name(long_a), slice_name(long_b));
  EXPECT_NE(slice_name("Node_A"), slice_name("node-a"));
  EXPECT_EQ(device_name(12), "gpu-12");
}

// ---- The v1 validation rules ----

// Runs the stand-in API server's validator (the rules of resource/v1) on
// slices, in one run: its errors for each, "" for a valid one.
std::vector<std::string> validation_errors(const std::vector<json>& slices) {
  TempDir dir;
  std::string command = std::string(PYTHON3) + " " + FAKE_APISERVER + " --check-slice";
  std::vector<std::string> paths;
  for (size_t i = 0; i < slices.size(); ++i) {
    paths.push_back(dir / ("slice-" + std::to_string(i) + ".json"));
    write_file(paths.back(), slices[i].dump());
    command += " " + paths.back();
  }
  command += " > " + (dir / "out") + " 2>&1";
  int rc = std::system(command.c_str());
  std::string out = read_file(dir / "out");
  std::vector<std::string> errors(slices.size());
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    auto at = std::find(paths.begin(), paths.end(), line.substr(0, line.find(": ")));
    if (at == paths.end()) {
      ADD_FAILURE() << "validator: " << line;
      continue;
    }
    errors[at - paths.begin()] += line.substr(line.find(": ") + 2) + "\n";
  }
  EXPECT_EQ(rc != 0, out.size() > 0) << out;
  return errors;
}

std::string validation_errors(const json& slice) { return validation_errors(std::vector<json>{slice})[0]; }

// The rules checked here directly, too: a failure names the rule.
void expect_conforms(const json& slice) {
  std::regex label("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$");
  std::regex c_identifier("^[A-Za-z_][A-Za-z0-9_]{0,31}$");
  std::regex semver("^(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)\\.(0|[1-9][0-9]*)$");
  for (const json& d : slice["spec"]["devices"]) {
    std::string name = d["name"];
    EXPECT_TRUE(name.size() <= 63 && std::regex_match(name, label)) << "device name " << name;
    EXPECT_LE(d["attributes"].size() + d["capacity"].size(), kMaxAttributesAndCapacities);
    for (auto& [key, attribute] : d["attributes"].items()) {
      EXPECT_TRUE(std::regex_match(key, c_identifier)) << key;
      EXPECT_EQ(attribute.size(), 1u) << key;
      if (attribute.contains("string")) {
        EXPECT_LE(attribute["string"].get<std::string>().size(), 64u);
      }
      if (attribute.contains("version")) {
        EXPECT_TRUE(std::regex_match(attribute["version"].get<std::string>(), semver)) << attribute;
      }
    }
    for (auto& [key, capacity] : d["capacity"].items()) {
      EXPECT_TRUE(std::regex_match(key, c_identifier)) << key;
      auto value = Quantity::parse(capacity["value"].get<std::string>());
      ASSERT_TRUE(value) << capacity;
      if (!capacity.contains("requestPolicy")) continue;
      const json& policy = capacity["requestPolicy"];
      ASSERT_TRUE(policy.contains("default")) << key << ": a validRange needs a default";
      auto dflt = Quantity::parse(policy["default"].get<std::string>());
      auto min = Quantity::parse(policy["validRange"]["min"].get<std::string>());
      auto step = Quantity::parse(policy["validRange"]["step"].get<std::string>());
      ASSERT_TRUE(dflt && min && step) << policy;
      EXPECT_LE(*min, *value);
      EXPECT_LE(*min, *dflt);
      EXPECT_LE(*dflt, *value);
      EXPECT_LE(Quantity::from_milli(min->milli_value() + step->milli_value()), *value) << key << ": min + step";
      EXPECT_EQ((dflt->value() - min->value()) % step->value(), 0) << key << ": default off the step";
    }
  }
  EXPECT_EQ(validation_errors(slice), "") << slice.dump(2);
}

TEST(KubeResourceSliceSchema, BuiltSlicesFollowTheV1Rules) {
  expect_conforms(build_resource_slice(kNode, node_object(8), 3));

  json mixed = node_object(4);
  mixed["gpus"][0]["config_memory"] = 12345678901ull;
  mixed["gpus"][0]["config_share"] = 0.123456;
  mixed["gpus"][1]["memory"] = 600 * kMiB;  // just above min + step
  mixed["gpus"][2]["name"] = std::string(200, 'N');
  mixed["gpus"][3]["index"] = 99999;
  mixed["gpus"][3]["compute_capability"] = "10.12";
  mixed["cuda_driver_version"] = 13010;
  expect_conforms(build_resource_slice("ip-10-0-0-1.ec2.internal", mixed, 0));
  expect_conforms(build_resource_slice(kNode, mixed, 1, SliceOptions{.share_valid_range = true}));
  expect_conforms(build_resource_slice(std::string(250, 'n'), node_object(128), 1));
  expect_conforms(build_resource_slice(kNode, node_object(0), 1));
  json fenced = node_object(64);
  fenced["gpus"][3]["fenced"] = true;
  fenced["gpus"][3]["fence_reason"] = "nvmlDeviceGetTemperature: GPU is lost";
  expect_conforms(build_resource_slice(kNode, fenced, 1, SliceOptions{.taint_fenced = true}));
}

TEST(KubeResourceSliceSchema, TheValidatorRefusesBrokenSlices) {
  // Each breaks one rule: without these the test above could pass on a validator that checks nothing.
  json good = build_resource_slice(kNode, node_object(1), 1);
  ASSERT_EQ(validation_errors(good), "");
  std::vector<json> slices;
  std::vector<std::string> expected;
  auto broken = [&](auto change, const std::string& expect) {
    json slice = good;
    change(slice);
    slices.push_back(slice);
    expected.push_back(expect);
  };
  broken([](json& s) { s["spec"]["devices"][0]["name"] = "GPU_0"; }, "name: must be a DNS label");
  broken([](json& s) { s["spec"]["devices"][0]["taints"] = {{{"key", "gpu.fracgpu.io/un healthy"}, {"effect", "NoSchedule"}}}; },
         "taints[0].key: Invalid value");
  broken([](json& s) { s["spec"]["devices"][0]["taints"] = {{{"key", "a"}, {"value", "-x"}, {"effect", "NoSchedule"}}}; },
         "taints[0].value: Invalid value");
  broken([](json& s) { s["spec"]["devices"][0]["taints"] = {{{"key", "a"}, {"effect", "PreferNoSchedule"}}}; },
         "taints[0].effect: Unsupported value");
  broken([](json& s) { s["spec"]["devices"][0]["taints"] = {{{"key", "a"}}}; }, "taints[0].effect: Required value");
  broken([](json& s) {
    for (int i = 0; i < 17; ++i) s["spec"]["devices"][0]["taints"].push_back({{"key", "a"}, {"effect", "NoExecute"}});
  }, "must have at most 16 items");
  broken([](json& s) {
    for (int i = 0; i < 31; ++i) s["spec"]["devices"][0]["attributes"]["extra" + std::to_string(i)] = {{"int", i}};
  }, "must not exceed 32");
  broken([](json& s) { s["spec"]["devices"][0]["capacity"]["memory"]["value"] = "80 GB"; }, "not a quantity");
  broken([](json& s) { s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"].erase("default"); },
         "default: required when validRange is defined");
  broken([](json& s) { s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] = "1000000000"; },
         "default is not a multiple of the step");
  broken([](json& s) { s["spec"]["devices"][0]["capacity"]["memory"]["value"] = "300Mi"; },
         "one step is larger than capacity value");
  broken([](json& s) { s["spec"]["devices"][0].erase("allowMultipleAllocations"); },
         "allowMultipleAllocations must be true");
  broken([](json& s) { s["spec"]["devices"][0]["attributes"]["computeCapability"] = {{"version", "9.0"}}; },
         "semver");
  broken([](json& s) { s["spec"]["devices"][0]["attributes"]["uuid"] = {{"string", std::string(65, 'u')}}; },
         "at most 64 bytes");
  broken([](json& s) { s["spec"]["devices"][0]["attributes"]["a-b"] = {{"int", 1}}; }, "must be a C identifier");
  broken([](json& s) { s["spec"]["devices"][0]["capacity"]["share"]["requestPolicy"] = {{"validRange", {{"min", "1m"}}}}; },
         "default: required");
  broken([](json& s) { s["spec"]["devices"][0]["allowMultipleAlocations"] = true; }, "unknown field");
  broken([](json& s) { s["spec"]["pool"]["resourceSliceCount"] = 0; }, "greater than zero");
  broken([](json& s) { s["spec"].erase("nodeName"); }, "exactly one of nodeName");
  broken([](json& s) { s["metadata"]["name"] = std::string(254, 'a'); }, "metadata.name");
  broken([](json& s) { s["metadata"]["ownerReferences"] = {{{"apiVersion", "v1"}, {"kind", "Node"}, {"name", "n"}}}; },
         "metadata.ownerReferences[0].uid: Required value");
  // The Kubernetes schema itself (kubernetes-validate), where the hand-written rules say nothing.
  if (std::system((std::string(PYTHON3) + " -c 'import kubernetes_validate' 2>/dev/null").c_str()) == 0)
    broken([](json& s) { s["spec"]["devices"][0]["attributes"]["uuid"]["string"] = 42; },
           "spec.devices.0.attributes.uuid.string: 42 is not of type 'string'");
  else
    std::cerr << "note: kubernetes-validate is not importable: the schema case is not checked\n";
  std::vector<std::string> errors = validation_errors(slices);
  for (size_t i = 0; i < slices.size(); ++i)
    EXPECT_NE(errors[i].find(expected[i]), std::string::npos)
        << "expected \"" << expected[i] << "\", got: " << errors[i];
}

// ---- The publisher, against the stand-in API server ----

struct KubeSlicePublisher : StandInServerTest {
  void SetUp() override { start(); }

  // Writes since the last call (successful and refused).
  std::vector<json> new_writes() {
    auto all = server->writes();
    std::vector<json> out(all.begin() + std::min(seen_, all.size()), all.end());
    seen_ = all.size();
    return out;
  }
  json stored_slices() { return json::parse(control->get("/fake/slices").body); }
  // The stored slice `name` (null if none) and the uid its owner names.
  json stored_slice(const std::string& name) {
    for (json& s : stored_slices())
      if (s["metadata"]["name"] == name) return s;
    return nullptr;
  }
  static std::string owner_uid(const json& slice) {
    const json owners = slice.is_object() ? slice["metadata"].value("ownerReferences", json::array()) : json();
    return owners.is_array() && owners.size() == 1 ? owners[0].value("uid", std::string()) : std::string();
  }
  // The Node's uid now ("" if it does not exist).
  std::string node_uid(const std::string& name) {
    HttpResult r = client->get("/api/v1/nodes/" + name);
    return r.ok() ? json::parse(r.body)["metadata"].value("uid", std::string()) : std::string();
  }
  // `kubectl delete node` and the kubelet registering again: the new uid.
  std::string create_node_again(const std::string& name) {
    EXPECT_TRUE(control->post("/fake/delete-node", {{"name", name}}).ok());
    HttpResult created = control->post("/fake/create-node", {{"name", name}});
    EXPECT_TRUE(created.ok()) << created.error;
    return created.ok() ? json::parse(created.body)["uid"].get<std::string>() : std::string();
  }
  void set_gc_delay(double seconds) { ASSERT_TRUE(control->post("/fake/gc", {{"delay", seconds}}).ok()); }
  // Requests so far: GETs of the Node `name`, and requests for slices.
  size_t node_reads(const std::string& name) {
    size_t n = 0;
    for (const json& r : json::parse(control->get("/fake/requests").body))
      n += r["method"] == "GET" && r["path"] == "/api/v1/nodes/" + name;
    return n;
  }
  size_t slice_requests() { return api_requests(*control).size(); }
  static size_t count(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }
  // Polls `holds` every 20 ms for up to `timeout`.
  static bool within(std::chrono::milliseconds timeout, const std::function<bool()>& holds) {
    return fracgpu::testing::eventually(
        [&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return holds();
        },
        timeout);
  }

 private:
  size_t seen_ = 0;
};

TEST_F(KubeSlicePublisher, CreateUpdateNoOpRemove) {
  SlicePublisher publisher(*client, kNode, log.logger);
  json node = node_object(2);

  ASSERT_TRUE(publisher.publish(node)) << log.text();
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["verb"], "create");
  EXPECT_EQ(writes[0]["status"], 201);
  EXPECT_EQ(writes[0]["name"], "node-a-gpu.fracgpu.io");
  EXPECT_EQ(writes[0]["body"]["spec"]["pool"]["generation"], 1);
  EXPECT_EQ(writes[0]["body"]["spec"]["devices"].size(), 2u);
  EXPECT_EQ(publisher.generation(), 1);
  EXPECT_EQ(publisher.device_uuids(),
            (std::map<std::string, std::string>{{"gpu-0", "GPU-00000000-1111-2222-3333-444444444444"},
                                                {"gpu-1", "GPU-00000001-1111-2222-3333-444444444444"}}));

  // Unchanged: read, nothing written.
  ASSERT_TRUE(publisher.publish(node));
  EXPECT_TRUE(new_writes().empty());

  // A config tenant took 20 GiB and a quarter of GPU 1: updated, generation bumped.
  node["gpus"][1]["config_memory"] = 20 * kGiB;
  node["gpus"][1]["config_share"] = 0.25;
  ASSERT_TRUE(publisher.publish(node)) << log.text();
  writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["verb"], "update");
  EXPECT_EQ(writes[0]["status"], 200);
  EXPECT_EQ(writes[0]["body"]["spec"]["pool"]["generation"], 2);
  EXPECT_FALSE(writes[0]["body"]["metadata"]["resourceVersion"].get<std::string>().empty());
  EXPECT_EQ(writes[0]["object"]["spec"]["devices"][1]["capacity"]["share"]["value"], "750m");
  EXPECT_EQ(publisher.generation(), 2);

  ASSERT_TRUE(publisher.publish(node));
  EXPECT_TRUE(new_writes().empty());

  ASSERT_TRUE(publisher.remove());
  writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["verb"], "delete");
  EXPECT_EQ(writes[0]["status"], 200);
  EXPECT_TRUE(stored_slices().empty());
  // Absent is success.
  EXPECT_TRUE(publisher.remove());
}

TEST_F(KubeSlicePublisher, FencedGpuLeavesTheSliceAndComesBack) {
  SlicePublisher publisher(*client, kNode, log.logger);
  json node = node_object(2);
  ASSERT_TRUE(publisher.publish(node));
  node["gpus"][1]["fenced"] = true;
  node["gpus"][1]["fence_reason"] = "ECC errors";
  ASSERT_TRUE(publisher.publish(node));
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 2u);
  ASSERT_EQ(writes[1]["body"]["spec"]["devices"].size(), 1u);
  EXPECT_EQ(writes[1]["body"]["spec"]["devices"][0]["name"], "gpu-0");
  EXPECT_EQ(writes[1]["body"]["spec"]["pool"]["generation"], 2);
  EXPECT_NE(log.text().find("left out GPU-00000001-1111-2222-3333-444444444444: fenced by the health probe: ECC errors"),
            std::string::npos)
      << log.text();

  node["gpus"][1]["fenced"] = false;
  ASSERT_TRUE(publisher.publish(node));
  writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["body"]["spec"]["devices"].size(), 2u);
  EXPECT_EQ(writes[0]["body"]["spec"]["pool"]["generation"], 3);
}

TEST(KubeResourceSlice, AFencedGpuIsTaintedWithAShortReason) {
  json node = node_object(2);
  node["gpus"][1]["fenced"] = true;
  node["gpus"][1]["fence_reason"] = "3 uncorrected ECC error(s) since the driver loaded";
  std::vector<std::string> left_out;
  json slice = build_resource_slice(kNode, node, 1, SliceOptions{.taint_fenced = true}, &left_out);
  EXPECT_TRUE(left_out.empty());
  ASSERT_EQ(slice["spec"]["devices"].size(), 2u);
  EXPECT_FALSE(slice["spec"]["devices"][0].contains("taints"));
  EXPECT_EQ(slice["spec"]["devices"][1]["taints"],
            json::parse(R"([{"key": "gpu.fracgpu.io/unhealthy", "value": "ecc-errors", "effect": "NoSchedule"}])"));
  EXPECT_EQ(fence_taint_value("nvmlDeviceGetPowerUsage: GPU is lost"), "gpu-lost");
  EXPECT_EQ(fence_taint_value("NVML cannot find it: Not Found"), "gpu-lost");
  EXPECT_EQ(fence_taint_value("Xid 79 (fenced since 1700000000; clear with `fracgpu gpu clear GPU-x`)"), "xid");
  EXPECT_EQ(fence_taint_value("temperature cannot be read: Unknown Error"), "sensors-unreadable");
  EXPECT_EQ(fence_taint_value(""), "unhealthy");
}

// The fallback where the API server drops taints is end to end in
// kube_plugin_e2e (AFencedGpuLeavesTheSliceAndReturns); here the taint's time.
TEST_F(KubeSlicePublisher, ATaintKeepsTheTimeTheServerGaveIt) {
  SlicePublisher publisher(*client, kNode, log.logger, SliceOptions{.taint_fenced = true});
  json node = node_object(2);
  node["gpus"][1]["fenced"] = true;
  ASSERT_TRUE(publisher.publish(node)) << log.text();
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_FALSE(writes[0]["body"]["spec"]["devices"][1]["taints"][0].contains("timeAdded"));
  const json added = writes[0]["object"]["spec"]["devices"][1]["taints"][0]["timeAdded"];
  ASSERT_TRUE(added.is_string());
  EXPECT_TRUE(publisher.taints_in_use());
  // Another change to the slice: the taint goes back with the server's time.
  node["gpus"][0]["config_share"] = 0.5;
  ASSERT_TRUE(publisher.publish(node)) << log.text();
  writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["body"]["spec"]["devices"][1]["taints"][0]["timeAdded"], added);
  ASSERT_TRUE(publisher.publish(node));
  EXPECT_TRUE(new_writes().empty());
}

TEST_F(KubeSlicePublisher, ConflictIsReadAgainAndRetried) {
  SlicePublisher publisher(*client, kNode, log.logger);
  json node = node_object(1);
  ASSERT_TRUE(publisher.publish(node));
  new_writes();
  fail_next("PUT", "resourceslices/node-a-gpu", 409, 1);
  node["gpus"][0]["config_share"] = 0.5;
  ASSERT_TRUE(publisher.publish(node)) << log.text();
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[0]["status"], 409);
  EXPECT_EQ(writes[1]["status"], 200);
  EXPECT_EQ(writes[1]["object"]["spec"]["devices"][0]["capacity"]["share"]["value"], "500m");
}

TEST_F(KubeSlicePublisher, SomeoneElseChangedTheSliceItIsWrittenBack) {
  SlicePublisher publisher(*client, kNode, log.logger);
  json node = node_object(1);
  ASSERT_TRUE(publisher.publish(node));
  // Another writer (an admin's kubectl edit) changes it.
  json current = json::parse(client->get("/apis/resource.k8s.io/v1/resourceslices/node-a-gpu.fracgpu.io").body);
  current["spec"]["devices"][0]["capacity"]["share"]["value"] = "2";
  ASSERT_TRUE(client->put("/apis/resource.k8s.io/v1/resourceslices/node-a-gpu.fracgpu.io", current).ok());
  new_writes();
  ASSERT_TRUE(publisher.publish(node));
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["object"]["spec"]["devices"][0]["capacity"]["share"]["value"], "1");
}

TEST_F(KubeSlicePublisher, ARestartedPluginAdoptsAnEqualSlice) {
  // 16 GB (decimal): the server stores it as "16G", not as written.
  json node = node_object(1);
  node["gpus"][0]["memory"] = 16'000'000'000ull;
  {
    SlicePublisher first(*client, kNode, log.logger);
    ASSERT_TRUE(first.publish(node));
  }
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["object"]["spec"]["devices"][0]["capacity"]["memory"]["value"], "16G");
  SlicePublisher second(*client, kNode, log.logger);
  ASSERT_TRUE(second.publish(node));
  EXPECT_TRUE(new_writes().empty());
  EXPECT_EQ(second.generation(), 1);
  EXPECT_EQ(second.device_uuids().size(), 1u);
}

TEST_F(KubeSlicePublisher, StaleSlicesOfThisNodeAreDeletedOthersKept) {
  auto make = [&](const std::string& name, const std::string& node_name, const std::string& pool, int64_t generation) {
    json slice = build_resource_slice(node_name, node_object(1), generation);
    slice["metadata"]["name"] = name;
    slice["spec"]["pool"]["name"] = pool;
    ASSERT_TRUE(client->post("/apis/resource.k8s.io/v1/resourceslices", slice).ok());
  };
  make("node-a-old-layout", kNode, kNode, 5);
  make("node-b-gpu.fracgpu.io", "node-b", "node-b", 1);
  // Our name, but an older pool name: the pool name cannot be changed, so it is replaced.
  make("node-a-gpu.fracgpu.io", kNode, "node-a-legacy", 2);
  new_writes();

  SlicePublisher publisher(*client, kNode, log.logger);
  ASSERT_TRUE(publisher.publish(node_object(2))) << log.text();
  std::set<std::string> names;
  for (const json& s : stored_slices()) names.insert(s["metadata"]["name"]);
  EXPECT_EQ(names, (std::set<std::string>{"node-a-gpu.fracgpu.io", "node-b-gpu.fracgpu.io"}));
  json ours = json::parse(client->get("/apis/resource.k8s.io/v1/resourceslices/node-a-gpu.fracgpu.io").body);
  EXPECT_EQ(ours["spec"]["pool"]["name"], kNode);
  // Above every generation the pool's consumers may have seen.
  EXPECT_EQ(ours["spec"]["pool"]["generation"], 6);

  ASSERT_TRUE(publisher.remove());
  names.clear();
  for (const json& s : stored_slices()) names.insert(s["metadata"]["name"]);
  EXPECT_EQ(names, (std::set<std::string>{"node-b-gpu.fracgpu.io"}));
}

TEST_F(KubeSlicePublisher, ANewerSliceOfThePoolMakesOursNewerStill) {
  SlicePublisher publisher(*client, kNode, log.logger);
  ASSERT_TRUE(publisher.publish(node_object(1)));
  // Left by an older plugin in the same pool, at a higher generation:
  // consumers would take it over ours, unchanged though ours is.
  json other = build_resource_slice(kNode, node_object(1), 9);
  other["metadata"]["name"] = "node-a-leftover";
  ASSERT_TRUE(client->post("/apis/resource.k8s.io/v1/resourceslices", other).ok());
  new_writes();
  ASSERT_TRUE(publisher.publish(node_object(1)));
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[0]["verb"], "update");
  EXPECT_EQ(writes[0]["body"]["spec"]["pool"]["generation"], 10);
  EXPECT_EQ(writes[1]["verb"], "delete");
  EXPECT_EQ(writes[1]["name"], "node-a-leftover");
}

TEST_F(KubeSlicePublisher, DeletedBehindOurBackIsCreatedAgain) {
  SlicePublisher publisher(*client, kNode, log.logger);
  ASSERT_TRUE(publisher.publish(node_object(1)));
  // The kubelet deletes a driver's slices when the plugin unregisters.
  ASSERT_TRUE(client->del("/apis/resource.k8s.io/v1/resourceslices/node-a-gpu.fracgpu.io").ok());
  new_writes();
  ASSERT_TRUE(publisher.publish(node_object(1)));
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["verb"], "create");
  EXPECT_EQ(writes[0]["body"]["spec"]["pool"]["generation"], 2);
}

TEST_F(KubeSlicePublisher, ServerFailuresReturnFalseAndTheNextCallRecovers) {
  RetryPolicy policy = fast_retries();
  policy.total_timeout = std::chrono::milliseconds(300);
  client->set_retry_policy(policy);
  SlicePublisher publisher(*client, kNode, log.logger);
  fail_next("GET", "resourceslices", 503, 1000);
  EXPECT_FALSE(publisher.publish(node_object(1)));
  EXPECT_NE(log.text().find("cannot list them: HTTP 503"), std::string::npos) << log.text();
  ASSERT_TRUE(control->post("/fake/reset", json::object()).ok());
  client->set_retry_policy(fast_retries());

  fail_next("POST", "resourceslices", 403, 1);
  EXPECT_FALSE(publisher.publish(node_object(1)));
  EXPECT_TRUE(stored_slices().empty());
  EXPECT_TRUE(publisher.publish(node_object(1))) << log.text();
  EXPECT_EQ(stored_slices().size(), 1u);
}

TEST_F(KubeSlicePublisher, EveryWrittenSlicePassesTheServersValidation) {
  // The stand-in refuses (422) what the v1 API would; nothing here may be refused.
  SlicePublisher publisher(*client, "ip-10-0-0-1.ec2.internal", log.logger, SliceOptions{.share_valid_range = true});
  json node = node_object(4);
  for (int round = 0; round < 4; ++round) {
    node["gpus"][round]["config_share"] = 0.1 * (round + 1);
    node["gpus"][round]["config_memory"] = (round + 1) * 3 * kGiB + 12345;
    ASSERT_TRUE(publisher.publish(node)) << log.text();
  }
  for (const json& w : new_writes()) EXPECT_NE(w["status"], 422) << w.dump();
}

// ---- The Node that owns the slice, and the stand-in's garbage collector ----

// The stand-in's collector judges owner references as the real one does
// (kube-controller-manager's garbagecollector.go, isDangling): a reference is
// dangling when its owner is absent by name or present with another uid; a
// slice whose references all dangle is deleted, one with a live owner too
// only loses the dangling reference; references to kinds it does not serve
// are left alone.
TEST_F(KubeSlicePublisher, TheStandInsCollectorJudgesOwnersByUid) {
  const std::string live = node_uid(kNode);
  ASSERT_FALSE(live.empty());
  ASSERT_TRUE(control->post("/fake/delete-node", {{"name", "node-z"}}).ok());
  const std::string stranger = "00000000-0000-4000-8000-000000000001";
  auto ref = [](const std::string& kind, const std::string& name, const std::string& uid, bool controller) {
    json r = {{"apiVersion", kind == "Node" ? "v1" : "apps/v1"}, {"kind", kind}, {"name", name}, {"uid", uid}};
    if (controller) r["controller"] = true;
    return r;
  };
  auto post = [&](const std::string& name, const json& owners) {
    json slice = build_resource_slice(kNode, node_object(1), 1);
    slice["metadata"]["name"] = name;
    if (!owners.empty()) slice["metadata"]["ownerReferences"] = owners;
    HttpResult r = client->post("/apis/resource.k8s.io/v1/resourceslices", slice);
    ASSERT_TRUE(r.ok()) << r.error;
  };
  post("live", json::array({ref("Node", kNode, live, true)}));
  post("another-uid", json::array({ref("Node", kNode, stranger, true)}));
  post("absent-node", json::array({ref("Node", "node-z", "00000000-0000-4000-8000-000000000002", true)}));
  post("mixed", json::array({ref("Node", kNode, live, true), ref("Node", "node-b", stranger, false)}));
  post("no-owner", json::array());
  post("unserved-kind", json::array({ref("DaemonSet", "ds", stranger, true)}));
  auto names = [&] {
    std::set<std::string> out;
    for (const json& s : stored_slices()) out.insert(s["metadata"]["name"]);
    return out;
  };
  const std::set<std::string> kept = {"live", "mixed", "no-owner", "unserved-kind"};
  EXPECT_TRUE(within(std::chrono::seconds(5), [&] {
    return names() == kept && stored_slice("mixed")["metadata"]["ownerReferences"].size() == 1;
  }));
  EXPECT_EQ(names(), kept);
  EXPECT_EQ(stored_slice("mixed")["metadata"]["ownerReferences"], json::array({ref("Node", kNode, live, true)}));
  size_t collected = 0;
  for (const json& w : server->writes()) collected += w.value("by", "") == "garbage-collector";
  EXPECT_EQ(collected, 3u);  // two deletes, one update

  // The Node deleted: what it owns goes, shortly after; created again, it
  // has a new uid, and what named the old one does not come back to life.
  HttpResult deleted = control->post("/fake/delete-node", {{"name", kNode}});
  ASSERT_TRUE(deleted.ok()) << deleted.error;
  const json answer = json::parse(deleted.body);
  EXPECT_EQ(answer["uid"], live);
  EXPECT_EQ(answer["dependents"].size(), 2u) << deleted.body;
  EXPECT_TRUE(node_uid(kNode).empty());
  EXPECT_EQ(control->post("/fake/delete-node", {{"name", kNode}}).status, 404);
  HttpResult created = control->post("/fake/create-node", {{"name", kNode}});
  ASSERT_TRUE(created.ok()) << created.error;
  const std::string fresh = json::parse(created.body)["uid"];
  EXPECT_NE(fresh, live);
  EXPECT_EQ(node_uid(kNode), fresh);
  EXPECT_EQ(control->post("/fake/create-node", {{"name", kNode}}).status, 409);
  const std::set<std::string> left = {"no-owner", "unserved-kind"};
  EXPECT_TRUE(within(std::chrono::seconds(5), [&] { return names() == left; })) << stored_slices().dump();
}

// The Node deleted and created again (a new uid), the collector has taken
// the slice naming the old one: the next publish, periodic or not, finds
// its slice gone, reads the Node again and creates the slice under the new
// uid, which the collector keeps.
TEST_F(KubeSlicePublisher, ASliceTheCollectorTookIsCreatedAgainUnderTheNewUid) {
  SlicePublisher publisher(*client, kNode, log.logger);
  const std::string name = slice_name(kNode);
  ASSERT_TRUE(publisher.publish(node_object(1))) << log.text();
  const std::string old_uid = owner_uid(stored_slice(name));
  EXPECT_EQ(old_uid, node_uid(kNode));
  const std::string new_uid = create_node_again(kNode);
  ASSERT_TRUE(within(std::chrono::seconds(5), [&] { return stored_slice(name).is_null(); }));
  new_writes();

  ASSERT_TRUE(publisher.publish(node_object(1))) << log.text();
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0]["verb"], "create");
  EXPECT_EQ(owner_uid(writes[0]["object"]), new_uid);
  EXPECT_NE(log.text().find("gone from the API server; reading node node-a again"), std::string::npos) << log.text();
  EXPECT_NE(log.text().find("the Node was created again"), std::string::npos) << log.text();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the collector (0.1 s) has looked
  EXPECT_EQ(owner_uid(stored_slice(name)), new_uid);
  ASSERT_TRUE(publisher.publish(node_object(1)));
  EXPECT_TRUE(new_writes().empty());
}

// The Node created again while the slice naming the old uid still stands
// (the collector not there yet): a publish for a change of devices does not
// read the Node; the periodic one does, and rewrites the owner, and the
// collector then keeps the slice.
TEST_F(KubeSlicePublisher, ThePeriodicPublishReadsTheNodeAgain) {
  SlicePublisher publisher(*client, kNode, log.logger);
  const std::string name = slice_name(kNode);
  ASSERT_TRUE(publisher.publish(node_object(1), true)) << log.text();
  const size_t reads = node_reads(kNode);
  EXPECT_EQ(reads, 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the collector (0.1 s) has looked at it
  set_gc_delay(1.0);
  const std::string new_uid = create_node_again(kNode);
  new_writes();

  json node = node_object(1);
  node["gpus"][0]["config_share"] = 0.5;
  ASSERT_TRUE(publisher.publish(node)) << log.text();
  EXPECT_EQ(node_reads(kNode), reads);
  ASSERT_TRUE(publisher.publish(node, true)) << log.text();
  EXPECT_EQ(node_reads(kNode), reads + 1);
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(owner_uid(writes[1]["body"]), new_uid);
  const std::string slice_uid = writes[1]["object"]["metadata"]["uid"];
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the collector has looked, twice
  EXPECT_EQ(stored_slice(name)["metadata"]["uid"], slice_uid);
  EXPECT_EQ(owner_uid(stored_slice(name)), new_uid);
  EXPECT_TRUE(new_writes().empty());
}

// Our update answered 404 (the slice deleted between our list and our
// write): the Node is read again and the slice created, under the uid the
// Node has now.
TEST_F(KubeSlicePublisher, AnUpdateAnswered404ReadsTheNodeAndCreates) {
  set_gc_delay(60);  // no collector in this one
  SlicePublisher publisher(*client, kNode, log.logger);
  const std::string name = slice_name(kNode);
  ASSERT_TRUE(publisher.publish(node_object(1))) << log.text();
  const std::string new_uid = create_node_again(kNode);
  new_writes();
  // The 404 is the stand-in's, the slice still there: the create meets it
  // (409), reads it and updates it.
  fail_next("PUT", "resourceslices/" + name, 404, 1);
  json node = node_object(1);
  node["gpus"][0]["config_share"] = 0.5;
  ASSERT_TRUE(publisher.publish(node)) << log.text();
  auto writes = new_writes();
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes[0]["status"], 404);
  EXPECT_EQ(writes[1]["verb"], "create");
  EXPECT_EQ(writes[1]["status"], 409);
  EXPECT_EQ(writes[1]["body"]["metadata"]["ownerReferences"][0]["uid"], new_uid);
  EXPECT_EQ(writes[2]["verb"], "update");
  EXPECT_EQ(writes[2]["status"], 200);
  EXPECT_EQ(owner_uid(stored_slice(name)), new_uid);
  EXPECT_NE(log.text().find("deleted meanwhile; creating it again"), std::string::npos) << log.text();
}

// While the Node does not exist nothing is written (the collector would take
// it; without an owner it would outlive the node), the absence is logged
// once, and the Node is asked for after 1 s, then twice as long each time up
// to node_retry_max; the publishes in between ask the server nothing. When
// it exists again the slice is published under its new uid.
TEST_F(KubeSlicePublisher, AnAbsentNodeIsAskedForWithBackoffAndNothingWritten) {
  SlicePublisher publisher(*client, kNode, log.logger, SliceOptions{.node_retry_max = std::chrono::seconds(2)});
  const std::string name = slice_name(kNode);
  ASSERT_TRUE(publisher.publish(node_object(1))) << log.text();
  ASSERT_TRUE(control->post("/fake/delete-node", {{"name", kNode}}).ok());
  ASSERT_TRUE(within(std::chrono::seconds(5), [&] { return stored_slice(name).is_null(); }));
  new_writes();
  const size_t reads = node_reads(kNode), requests = slice_requests();
  // 3.5 s of the plugin's loop, polling every 20 ms, every publish periodic.
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(3500)) {
    EXPECT_FALSE(publisher.publish(node_object(1), true));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Read at 0, 1 s and 3 s.
  EXPECT_EQ(node_reads(kNode) - reads, 3u);
  EXPECT_EQ(slice_requests(), requests);
  EXPECT_TRUE(new_writes().empty());
  EXPECT_EQ(count(log.text(), "the Node does not exist"), 1u) << log.text();

  HttpResult created = control->post("/fake/create-node", {{"name", kNode}});
  ASSERT_TRUE(created.ok()) << created.error;
  const std::string new_uid = json::parse(created.body)["uid"];
  // The next read is due 2 s after the last.
  EXPECT_TRUE(within(std::chrono::seconds(3), [&] { return publisher.publish(node_object(1), true); })) << log.text();
  EXPECT_EQ(owner_uid(stored_slice(name)), new_uid);
  EXPECT_NE(log.text().find("the Node exists again"), std::string::npos) << log.text();
  // Absent again later: said again, once.
  ASSERT_TRUE(control->post("/fake/delete-node", {{"name", kNode}}).ok());
  EXPECT_FALSE(publisher.publish(node_object(1), true));
  EXPECT_FALSE(publisher.publish(node_object(1), true));
  EXPECT_EQ(count(log.text(), "the Node does not exist"), 2u) << log.text();
}

}  // namespace
}  // namespace fracgpu::kube::testing

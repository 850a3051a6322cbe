// The kubelet plugin's pure parts: a ResourceClaim + NODE -> the plan
// (claim_plan.h), the CDI spec (cdi_spec.h), the claim records (claim_store.h).
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kube/kube_test_util.h"
#include "kube_plugin/cdi_spec.h"
#include "kube_plugin/claim_plan.h"
#include "kube_plugin/claim_status.h"
#include "kube_plugin/claim_store.h"
#include "kube_plugin/device_health.h"

using namespace fracgpu::kube_plugin;
using fracgpu::kube::testing::node_object;
using fracgpu::testing::TempDir;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kGpuMemory = 85899345920ull;  // node_object's GPUs
const std::string kUid = "7d3f2a10-1c2b-4e5f-8a9b-0c1d2e3f4a5b";
const ClaimRef kRef{"team-a", "train-gpu", kUid};
const std::string kNode = "node-1";

json result(const std::string& device, json consumed = nullptr, const std::string& request = "gpu",
            const std::string& pool = kNode, const std::string& driver = "gpu.fracgpu.io") {
  json r = {{"request", request}, {"driver", driver}, {"pool", pool}, {"device", device}};
  if (!consumed.is_null()) r["consumedCapacity"] = std::move(consumed);
  return r;
}

json gpu_config(const std::string& source, const json& limit, json requests = json::array()) {
  json params = {{"apiVersion", "gpu.fracgpu.io/v1alpha1"}, {"kind", "GpuConfig"}};
  if (!limit.is_null()) params["limit"] = limit;
  return {{"source", source},
          {"requests", std::move(requests)},
          {"opaque", {{"driver", "gpu.fracgpu.io"}, {"parameters", std::move(params)}}}};
}

json claim(json results, json configs = json::array(), const std::string& uid = kUid) {
  return {
      {"apiVersion", "resource.k8s.io/v1"},
      {"kind", "ResourceClaim"},
      {"metadata", {{"name", "train-gpu"}, {"namespace", "team-a"}, {"uid", uid}}},
      {"status", {{"allocation", {{"devices", {{"results", std::move(results)}, {"config", std::move(configs)}}}}}}}};
}

ClaimPlan plan_ok(const json& c, int gpus = 3) {
  std::string error;
  auto plan = plan_claim(kRef, c, kNode, node_object(gpus), &error);
  EXPECT_TRUE(plan) << error;
  return plan ? *plan : ClaimPlan{};
}

std::string plan_error(const json& c) {
  std::string error;
  auto plan = plan_claim(kRef, c, kNode, node_object(3), &error);
  EXPECT_FALSE(plan);
  return error;
}

TEST(ClaimPlan, ConsumedCapacityIsTheTenantsQuotaAndShare) {
  const ClaimPlan plan = plan_ok(claim({result("gpu-1", {{"memory", "20Gi"}, {"share", "500m"}})}));
  ASSERT_EQ(plan.gpus.size(), 1u);
  EXPECT_EQ(plan.gpus[0].uuid, node_object(3)["gpus"][1]["uuid"]);
  EXPECT_EQ(plan.gpus[0].memory, 20ull << 30);
  EXPECT_DOUBLE_EQ(plan.gpus[0].share, 0.5);
  EXPECT_FALSE(plan.gpus[0].limit);
  ASSERT_EQ(plan.devices.size(), 1u);
  EXPECT_EQ(plan.devices[0].device, "gpu-1");
  EXPECT_EQ(plan.devices[0].pool, kNode);
  EXPECT_EQ(plan.devices[0].request, "gpu");

  const json spec = tenant_spec(plan);
  EXPECT_EQ(spec["name"], "dra-" + kUid);
  EXPECT_EQ(spec["gpus"][0]["memory"], 20ull << 30);
  EXPECT_EQ(spec["gpus"][0]["share"], 0.5);
  EXPECT_FALSE(spec["gpus"][0].contains("limit"));
  EXPECT_EQ(spec["annotations"]["claim-namespace"], "team-a");
  EXPECT_EQ(spec["annotations"]["claim-name"], "train-gpu");
  EXPECT_EQ(spec["annotations"]["claim-uid"], kUid);
}

// Two whole GPUs (no consumedCapacity) and half of a third: one tenant on three GPUs.
TEST(ClaimPlan, TwoAndAHalfGpusMakeOneTenantOnThree) {
  const ClaimPlan plan = plan_ok(claim({result("gpu-0", nullptr, "whole"), result("gpu-2", nullptr, "whole"),
                                        result("gpu-1", {{"memory", "40Gi"}, {"share", "0.5"}}, "half")}));
  ASSERT_EQ(plan.gpus.size(), 3u);
  EXPECT_EQ(plan.gpus[0].index, 0);
  EXPECT_EQ(plan.gpus[0].memory, kGpuMemory);
  EXPECT_DOUBLE_EQ(plan.gpus[0].share, 1.0);
  EXPECT_EQ(plan.gpus[1].memory, 40ull << 30);
  EXPECT_DOUBLE_EQ(plan.gpus[1].share, 0.5);
  EXPECT_DOUBLE_EQ(plan.gpus[2].share, 1.0);
  ASSERT_EQ(plan.devices.size(), 3u);
  EXPECT_EQ(plan.devices[2].request, "half");
}

TEST(ClaimPlan, AnAbsentCapacityIsTheWholeOfIt) {
  const ClaimPlan plan = plan_ok(claim({result("gpu-0", {{"share", "250m"}})}));
  EXPECT_EQ(plan.gpus[0].memory, kGpuMemory);
  EXPECT_DOUBLE_EQ(plan.gpus[0].share, 0.25);
}

TEST(ClaimPlan, OtherDriversResultsAreIgnored) {
  const ClaimPlan plan =
      plan_ok(claim({result("nic-0", nullptr, "nic", "other-pool", "net.example.com"), result("gpu-0", nullptr)}));
  EXPECT_EQ(plan.devices.size(), 1u);
}

// Shapes the allocator writes that the plugin must read right: several
// results for one request (count: 2) on two GPUs, each with the shareID of a
// consumable-capacity allocation, beside another driver's result.
TEST(ClaimPlan, SeveralResultsOfOneRequestWithShareIdsAreOneTenant) {
  json a = result("gpu-0", {{"memory", "8Gi"}, {"share", "250m"}});
  a["shareID"] = "3f2e1d0c-aaaa-4bbb-8ccc-000000000001";
  json b = result("gpu-2", {{"memory", "8Gi"}, {"share", "250m"}});
  b["shareID"] = "3f2e1d0c-aaaa-4bbb-8ccc-000000000002";
  const ClaimPlan plan = plan_ok(claim({a, result("nic-0", nullptr, "gpu", kNode, "nic.example.com"), b}));
  ASSERT_EQ(plan.gpus.size(), 2u);
  ASSERT_EQ(plan.devices.size(), 2u);
  EXPECT_EQ(plan.devices[0].share_id, "3f2e1d0c-aaaa-4bbb-8ccc-000000000001");
  EXPECT_EQ(plan.devices[1].share_id, "3f2e1d0c-aaaa-4bbb-8ccc-000000000002");
  for (const auto& g : plan.gpus) EXPECT_DOUBLE_EQ(g.share, 0.25);
}

// Admin access books nothing in the scheduler: refused, never made a tenant
// that would take the whole GPU.
TEST(ClaimPlan, AnAdminAccessResultIsRefusedClearly) {
  json admin = result("gpu-1");
  admin["adminAccess"] = true;
  EXPECT_NE(plan_error(claim({admin})).find("asks for admin access to gpu-1, which fracgpu does not support"),
            std::string::npos);
  admin["adminAccess"] = false;
  EXPECT_EQ(plan_ok(claim({admin})).gpus.size(), 1u);
}

TEST(ClaimPlan, TheClaimsConfigWinsOverTheClasss) {
  const json consumed = {{"memory", "16Gi"}, {"share", "250m"}};
  // Class says "share", claim says 1.0: the claim's, whatever the order.
  ClaimPlan plan =
      plan_ok(claim({result("gpu-0", consumed)}, {gpu_config("FromClaim", "1.0"), gpu_config("FromClass", "share")}));
  ASSERT_TRUE(plan.gpus[0].limit);
  EXPECT_DOUBLE_EQ(*plan.gpus[0].limit, 1.0);
  plan = plan_ok(claim({result("gpu-0", consumed)}, {gpu_config("FromClass", "0.75")}));
  EXPECT_DOUBLE_EQ(plan.gpus[0].limit.value_or(-1), 0.75);
  plan =
      plan_ok(claim({result("gpu-0", consumed)}, {gpu_config("FromClass", "0.75"), gpu_config("FromClaim", "share")}));
  EXPECT_FALSE(plan.gpus[0].limit);
  // A config for another request does not apply.
  plan = plan_ok(claim({result("gpu-0", consumed)}, {gpu_config("FromClaim", "1.0", {"other"})}));
  EXPECT_FALSE(plan.gpus[0].limit);
  EXPECT_EQ(
      tenant_spec(plan_ok(claim({result("gpu-0", consumed)}, {gpu_config("FromClaim", "0.5")})))["gpus"][0]["limit"],
      0.5);
}

// A GpuConfig with `priority` (and no limit) for `requests`.
json priority_config(const std::string& source, const json& priority, json requests = json::array()) {
  json config = gpu_config(source, nullptr, std::move(requests));
  config["opaque"]["parameters"]["priority"] = priority;
  return config;
}

TEST(ClaimPlan, PriorityFollowsTheWinningConfig) {
  const json consumed = {{"memory", "16Gi"}, {"share", "250m"}};
  // None: normal, and the spec leaves it to the daemon's default.
  ClaimPlan plan = plan_ok(claim({result("gpu-0", consumed)}));
  EXPECT_EQ(plan.priority, "normal");
  EXPECT_FALSE(tenant_spec(plan).contains("priority"));
  plan = plan_ok(claim({result("gpu-0", consumed)}, {priority_config("FromClass", "latency")}));
  EXPECT_EQ(plan.priority, "latency");
  EXPECT_EQ(tenant_spec(plan)["priority"], "latency");
  // The claim's config wins over the class's, whatever the order; a later one
  // over an earlier one of the same source.
  plan = plan_ok(claim({result("gpu-0", consumed)},
                       {priority_config("FromClaim", "batch"), priority_config("FromClass", "latency")}));
  EXPECT_EQ(plan.priority, "batch");
  plan = plan_ok(claim({result("gpu-0", consumed)},
                       {priority_config("FromClass", "batch"), priority_config("FromClass", "latency")}));
  EXPECT_EQ(plan.priority, "latency");
  plan = plan_ok(claim({result("gpu-0", consumed)},
                       {priority_config("FromClass", "latency"), priority_config("FromClaim", "normal")}));
  EXPECT_EQ(plan.priority, "normal");
  EXPECT_FALSE(tenant_spec(plan).contains("priority"));
  // A config with only a limit does not reset the priority another set.
  plan = plan_ok(claim({result("gpu-0", consumed)},
                       {priority_config("FromClass", "latency"), gpu_config("FromClaim", "0.5")}));
  EXPECT_EQ(plan.priority, "latency");
  EXPECT_DOUBLE_EQ(plan.gpus[0].limit.value_or(-1), 0.5);
  // Both fields in one config.
  json both = gpu_config("FromClaim", "0.5");
  both["opaque"]["parameters"]["priority"] = "batch";
  plan = plan_ok(claim({result("gpu-0", consumed)}, {both}));
  EXPECT_EQ(plan.priority, "batch");
  EXPECT_DOUBLE_EQ(plan.gpus[0].limit.value_or(-1), 0.5);
  // A config for another request does not apply.
  plan = plan_ok(claim({result("gpu-0", consumed)}, {priority_config("FromClaim", "latency", {"other"})}));
  EXPECT_EQ(plan.priority, "normal");
  // One tenant per claim: of its requests' configs, the winning one.
  plan = plan_ok(claim({result("gpu-0", consumed, "a"), result("gpu-1", consumed, "b")},
                       {priority_config("FromClaim", "latency", {"b"}), priority_config("FromClass", "batch", {"a"})}));
  EXPECT_EQ(plan.priority, "latency");
  plan = plan_ok(claim({result("gpu-0", consumed, "a"), result("gpu-1", consumed, "b")},
                       {priority_config("FromClaim", "latency", {"b"}), priority_config("FromClaim", "batch", {"a"})}));
  EXPECT_EQ(plan.priority, "batch");
}

TEST(ClaimPlan, AnUnknownPriorityFailsThePreparation) {
  const json half = {{"memory", "20Gi"}, {"share", "500m"}};
  EXPECT_EQ(plan_error(claim({result("gpu-0", half)}, {priority_config("FromClaim", "urgent")})),
            "claim team-a/train-gpu: status.allocation.devices.config[0].opaque.parameters.priority \"urgent\" must be "
            "\"latency\", \"normal\" or \"batch\"");
  EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {priority_config("FromClaim", 2)})).find(".priority 2 must be"),
            std::string::npos);
  EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {priority_config("FromClaim", "Latency")})).find("must be"),
            std::string::npos);
  // Wherever it applies, even where another config wins.
  EXPECT_NE(plan_error(claim({result("gpu-0", half)},
                             {priority_config("FromClass", "fast"), priority_config("FromClaim", "latency")}))
                .find("config[0].opaque.parameters.priority \"fast\""),
            std::string::npos);
  // The message's value is escaped: a terminal reading the log gets no control byte.
  const std::string escaped = plan_error(claim({result("gpu-0", half)}, {priority_config("FromClaim", "\x1b[2J")}));
  EXPECT_EQ(escaped.find('\x1b'), std::string::npos) << escaped;
}

TEST(ClaimPlan, AWholeGpuHasNoLimit) {
  const ClaimPlan plan = plan_ok(claim({result("gpu-0")}, {gpu_config("FromClaim", "1.0")}));
  EXPECT_FALSE(plan.gpus[0].limit);
}

// The kubelet matches request names against a container's claims: a
// subrequest of a prioritized list is handed back as its request.
TEST(ClaimPlan, TheKubeletGetsTheRequestNotTheSubrequest) {
  EXPECT_EQ(kubelet_request_name("gpu/quarter"), "gpu");
  EXPECT_EQ(kubelet_request_name("gpu"), "gpu");
  const ClaimPlan plan = plan_ok(claim({result("gpu-1", {{"share", "250m"}}, "gpu/quarter")}));
  ASSERT_EQ(plan.devices.size(), 1u);
  EXPECT_EQ(plan.devices[0].request, "gpu/quarter") << "the record keeps the allocator's name";
}

// The scheduler books consumed shares in billionths, fracgpud in
// millionths: rounded down, so that claims the scheduler fitted on a GPU
// always fit in fracgpud too (three thirds rounded up were 1.000002, and the
// third claim was refused).
TEST(ClaimPlan, SharesAreRoundedDownToTheMillionthsFracgpudBooks) {
  double sum = 0;
  for (int i = 0; i < 3; ++i) {
    const ClaimPlan plan = plan_ok(claim({result("gpu-0", {{"share", "333333333n"}})}));
    ASSERT_EQ(plan.gpus.size(), 1u);
    EXPECT_DOUBLE_EQ(plan.gpus[0].share, 0.333333);
    sum += plan.gpus[0].share;
  }
  EXPECT_LE(sum, 1.0);
  EXPECT_DOUBLE_EQ(plan_ok(claim({result("gpu-0", {{"share", "1999n"}})})).gpus[0].share, 0.000001);
  EXPECT_NE(plan_error(claim({result("gpu-0", {{"share", "999n"}})})).find("is not from a millionth"), std::string::npos);
}

TEST(ClaimPlan, BadClaimsAreRefusedNamingWhatIsWrong) {
  const json half = {{"memory", "20Gi"}, {"share", "500m"}};
  EXPECT_EQ(plan_error(claim({result("gpu-0", half)}, {}, "another-uid")),
            "claim team-a/train-gpu: the API server has uid another-uid, the kubelet asked for " + kUid +
                " (the claim was replaced)");
  json unallocated = claim({});
  unallocated["status"] = json::object();
  EXPECT_EQ(plan_error(unallocated),
            "claim team-a/train-gpu: status.allocation is absent (the claim is not allocated)");
  EXPECT_EQ(plan_error(claim({})),
            "claim team-a/train-gpu: no device of driver gpu.fracgpu.io is allocated to it on node node-1");
  EXPECT_EQ(
      plan_error(claim({result("gpu-0", half, "gpu", "node-2")})),
      "claim team-a/train-gpu: status.allocation.devices.results[0] is in pool \"node-2\", not this node's (node-1)");
  EXPECT_EQ(plan_error(claim({result("gpu-7", half)})),
            "claim team-a/train-gpu: status.allocation.devices.results[0].device \"gpu-7\" is not a GPU of this node");
  EXPECT_NE(plan_error(claim({result("gpu-0", {{"memory", "20 GB"}})}))
                .find("consumedCapacity.memory \"20 GB\" is not a quantity"),
            std::string::npos);
  EXPECT_NE(plan_error(claim({result("gpu-0", {{"share", "1500m"}})})).find(": share 1.5 is not from a millionth (the finest share fracgpud books) to 1"),
            std::string::npos);
  EXPECT_NE(
      plan_error(claim({result("gpu-0", {{"memory", "100Gi"}})})).find("is not within the GPU's 85899345920 bytes"),
      std::string::npos);
  EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {gpu_config("FromClaim", "0.25")}))
                .find(": limit \"0.25\" must be \"share\" or a fraction from the share (0.5) to 1"),
            std::string::npos);
  for (const char* odd : {"0x1p-1", "6e-1", " 0.6", "+0.6", "inf", "0.6.1", "."})
    EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {gpu_config("FromClaim", odd)}))
                  .find(std::string(": limit \"") + odd + "\" must be \"share\" or a fraction"),
              std::string::npos)
        << odd;
  EXPECT_DOUBLE_EQ(plan_ok(claim({result("gpu-0", half)}, {gpu_config("FromClaim", "0.75")})).gpus.at(0).limit.value_or(0), 0.75);
  EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {gpu_config("FromClaim", 1.0)})).find(".limit must be a string"),
            std::string::npos);
  json wrong_kind = gpu_config("FromClaim", "share");
  wrong_kind["opaque"]["parameters"]["kind"] = "GpuSettings";
  EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {wrong_kind})).find("kind \"GpuSettings\""), std::string::npos);
  json extra = gpu_config("FromClaim", "share");
  extra["opaque"]["parameters"]["sharing"] = "time";
  EXPECT_NE(plan_error(claim({result("gpu-0", half)}, {extra}))
                .find("parameters.sharing is not a GpuConfig field (fields: limit, priority)"),
            std::string::npos);
}

// Members of unexpected types are this claim's error, not an exception.
TEST(ClaimPlan, MalformedObjectsAreErrorsNotExceptions) {
  json c = claim({result("gpu-0")});
  c["status"] = "allocated";
  EXPECT_NE(plan_error(c).find("claim team-a/train-gpu: malformed ResourceClaim"), std::string::npos);
  c = claim({result("gpu-0", {{"memory", 5}})});
  EXPECT_NE(plan_error(c).find("consumedCapacity.memory 5 is not a quantity"), std::string::npos);
  c = claim({result("gpu-0")}, {gpu_config("FromClaim", "1.0", "gpu")});  // requests: a string, not a list
  EXPECT_NE(plan_error(c).find("malformed ResourceClaim"), std::string::npos);
  // What is not a result or config of this driver is not looked at.
  c = claim({42, result("gpu-0")}, json::array({"not a config"}));
  std::string error;
  EXPECT_TRUE(plan_claim(kRef, c, kNode, node_object(3), &error)) << error;
}

TEST(ClaimPlan, UidsThatCannotNameFilesAreRefused) {
  EXPECT_TRUE(valid_claim_uid(kUid));
  for (const char* bad :
       {"", "../x", "a/b", "-a", "A", "a.b", "0123456789012345678901234567890123456789012345678901234567890"})
    EXPECT_FALSE(valid_claim_uid(bad)) << bad;
}

TEST(CdiSpec, TheContainerGetsTheRecipeAndNothingElse) {
  const ClaimPlan plan = plan_ok(claim({result("gpu-1", {{"memory", "20Gi"}, {"share", "500m"}})}));
  CdiOptions options;
  options.library_host_path = "/host/lib/libfracgpu.so";
  options.library_container_path = "/usr/lib/fracgpu/libfracgpu.so";
  const json spec = build_cdi_spec(plan, "/run/fracgpu/tenants/dra-" + kUid, options);
  EXPECT_EQ(spec["cdiVersion"], "0.6.0");
  EXPECT_EQ(spec["kind"], "gpu.fracgpu.io/claim");
  ASSERT_EQ(spec["devices"].size(), 1u);
  EXPECT_EQ(spec["devices"][0]["name"], kUid);
  const json& edits = spec["devices"][0]["containerEdits"];
  // No variable that would differ between two claims of one container.
  EXPECT_EQ(edits["env"], json({"LD_PRELOAD=/usr/lib/fracgpu/libfracgpu.so", "FRACGPU_UNMANAGED=deny"}));
  const json mounts = {{{"hostPath", "/run/fracgpu/tenants/dra-" + kUid},
                        {"containerPath", "/run/fracgpu/claims/" + kUid},
                        {"options", {"ro", "nosuid", "nodev", "bind"}}},
                       {{"hostPath", "/run/fracgpu/tenants/dra-" + kUid + "/usage"},
                        {"containerPath", "/run/fracgpu/claims/" + kUid + "/usage"},
                        {"options", {"rw", "nosuid", "nodev", "bind"}}},
                       {{"hostPath", "/host/lib/libfracgpu.so"},
                        {"containerPath", "/usr/lib/fracgpu/libfracgpu.so"},
                        {"options", {"ro", "nosuid", "nodev", "bind"}}}};
  EXPECT_EQ(edits["mounts"], mounts);
  EXPECT_FALSE(edits.contains("deviceNodes"));
  EXPECT_EQ(cdi_spec_file_name(kUid), "gpu.fracgpu.io-claim_" + kUid + ".json");
  EXPECT_EQ(cdi_device_ids(plan, plan.devices[0], options),
            std::vector<std::string>({"gpu.fracgpu.io/claim=" + kUid, "nvidia.com/gpu=" + plan.devices[0].uuid}));

  options.device_nodes = kDeviceNodesHost;
  const json with_nodes = build_cdi_spec(plan, "/t", options);
  EXPECT_EQ(with_nodes["devices"][0]["containerEdits"]["deviceNodes"], json({{{"path", "/dev/nvidiactl"}},
                                                                             {{"path", "/dev/nvidia-uvm"}},
                                                                             {{"path", "/dev/nvidia-uvm-tools"}},
                                                                             {{"path", "/dev/nvidia1"}}}));
  EXPECT_EQ(cdi_device_ids(plan, plan.devices[0], options), std::vector<std::string>({"gpu.fracgpu.io/claim=" + kUid}));
}

TEST(ClaimStore, ARecordRoundTripsAndIsBelievedOnlyForItsOwnClaim) {
  TempDir dir;
  ClaimStore store(dir.path());
  std::string error;
  EXPECT_FALSE(store.get(kUid, &error));
  EXPECT_EQ(error, "");  // none: not an error
  const ClaimPlan plan = plan_ok(claim({result("gpu-0"), result("gpu-1", {{"memory", "20Gi"}, {"share", "500m"}})},
                                       {gpu_config("FromClaim", "0.75"), priority_config("FromClaim", "latency")}));
  ASSERT_TRUE(store.put(plan, &error)) << error;
  struct stat st {};
  ASSERT_EQ(stat((dir / "kube/claims").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(store.list(), std::vector<std::string>{kUid});
  auto back = store.get(kUid, &error);
  ASSERT_TRUE(back) << error;
  EXPECT_EQ(back->tenant, "dra-" + kUid);
  EXPECT_EQ(plan_to_json(back->plan), plan_to_json(plan));
  EXPECT_EQ(tenant_spec(back->plan), tenant_spec(plan));
  EXPECT_EQ(back->plan.priority, "latency");
  // A record from before priorities: its tenant is normal, its spec as it was.
  json old_plan = plan_to_json(plan);
  old_plan.erase("priority");
  const auto old = plan_from_json(old_plan, &error);
  ASSERT_TRUE(old) << error;
  EXPECT_EQ(old->priority, "normal");
  EXPECT_FALSE(tenant_spec(*old).contains("priority"));
  old_plan["priority"] = "urgent";
  EXPECT_FALSE(plan_from_json(old_plan, &error));
  // No temporary file left beside it.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "kube/claims"), fs::directory_iterator()), 1);

  // A record copied under another uid's name is not believed.
  const std::string other = "00000000-1111-2222-3333-444444444444";
  fs::copy_file(dir / ("kube/claims/" + kUid + ".json"), dir / ("kube/claims/" + other + ".json"));
  EXPECT_FALSE(store.get(other, &error));
  EXPECT_NE(error.find("names another claim"), std::string::npos) << error;
  fracgpu::testing::write_file(dir / ("kube/claims/" + other + ".json"), "{\"version\": 1");
  EXPECT_FALSE(store.get(other, &error));
  EXPECT_NE(error.find("not a claim record of version 1"), std::string::npos) << error;
  // A link is not followed.
  fs::remove(dir / ("kube/claims/" + other + ".json"));
  fs::create_symlink(dir / ("kube/claims/" + kUid + ".json"), dir / ("kube/claims/" + other + ".json"));
  EXPECT_FALSE(store.get(other, &error));
  EXPECT_NE(error, "");

  ASSERT_TRUE(store.remove(kUid, &error)) << error;
  EXPECT_TRUE(store.remove(kUid, &error)) << error;  // absent: fine
  EXPECT_FALSE(store.get(kUid, &error));
  EXPECT_EQ(error, "");
  EXPECT_FALSE(store.put(ClaimPlan{{"ns", "n", "../../etc"}, {}, {}}, &error));
}

// The health stream's board: a version step only on a change, the time a
// state was first seen kept while it lasts, Unknown while the daemon is away.
TEST(DeviceHealthBoard, FollowsTheFencesAndMovesOnlyOnChanges) {
  DeviceHealthBoard board;
  EXPECT_EQ(board.snapshot().version, 0u);
  json node = {{"gpus", {{{"index", 0}, {"fenced", false}}, {{"index", 1}, {"fenced", false}}}}};
  board.update_from_node(node, 100);
  DeviceHealthSnapshot s = board.snapshot();
  ASSERT_EQ(s.devices.size(), 2u);
  EXPECT_EQ(s.devices[1].device, "gpu-1");
  EXPECT_EQ(s.devices[1].state, DeviceHealthState::kHealthy);
  EXPECT_EQ(s.devices[1].since_unix, 100);
  const uint64_t first = s.version;
  EXPECT_GT(first, 0u);
  board.update_from_node(node, 101);
  EXPECT_EQ(board.snapshot().version, first);
  EXPECT_EQ(board.wait_newer_than(first, std::chrono::milliseconds(1)).version, first);  // timed out

  node["gpus"][1]["fenced"] = true;
  board.update_from_node(node, 102);
  s = board.wait_newer_than(first, std::chrono::milliseconds(1));
  EXPECT_GT(s.version, first);
  EXPECT_EQ(s.devices[0].since_unix, 100);
  EXPECT_EQ(s.devices[1].state, DeviceHealthState::kUnhealthy);
  EXPECT_EQ(s.devices[1].since_unix, 102);

  board.mark_unknown(103);
  s = board.snapshot();
  EXPECT_EQ(s.devices[0].state, DeviceHealthState::kUnknown);
  EXPECT_EQ(s.devices[1].state, DeviceHealthState::kUnknown);
  node["gpus"].erase(1);
  board.update_from_node(node, 104);
  s = board.snapshot();
  ASSERT_EQ(s.devices.size(), 1u);
  EXPECT_EQ(s.devices[0].state, DeviceHealthState::kHealthy);

  board.close();
  EXPECT_TRUE(board.wait_newer_than(s.version, std::chrono::seconds(10)).closed);  // at once
}

// A fence's class in the board, and what the claim's status shows of it.
TEST(DeviceHealthBoard, AFenceCarriesItsClass) {
  DeviceHealthBoard board;
  json node = {{"gpus", {{{"index", 0}, {"fenced", true}, {"fence_reason", "GPU lost: cannot find it"}}}}};
  board.update_from_node(node, 100);
  EXPECT_EQ(board.snapshot().devices[0].reason, "gpu-lost");
  const uint64_t v = board.snapshot().version;
  node["gpus"][0]["fence_reason"] = "ECC errors: 3 uncorrectable";
  board.update_from_node(node, 101);
  EXPECT_GT(board.snapshot().version, v);
  EXPECT_EQ(board.snapshot().devices[0].reason, "ecc-errors");
  EXPECT_EQ(board.snapshot().devices[0].since_unix, 100) << "still fenced since 100";
  EXPECT_EQ(fence_condition_reason("gpu-lost"), "GpuLost");
  EXPECT_EQ(fence_condition_reason("sensors-unreadable"), "SensorsUnreadable");
  EXPECT_EQ(fence_condition_reason("xid"), "Xid");
  EXPECT_EQ(fence_condition_reason(""), "Unhealthy");
}

// Requirement (issue 33, 3): the status entry of each allocated device: its
// key as the allocation's result, Ready and GPUHealthy conditions, and the
// tenant's quota, share, limit and priority with the GPU's health as data.
TEST(ClaimStatus, EachDeviceShowsTheTenantsPartAndTheGpusHealth) {
  json a = result("gpu-1", {{"memory", "4Gi"}, {"share", "250m"}});
  a["shareID"] = "00000000-aaaa-4bbb-8ccc-000000000001";
  json config = gpu_config("FromClaim", "0.5");
  config["opaque"]["parameters"]["priority"] = "latency";
  const ClaimPlan plan = plan_ok(claim({a, result("gpu-2", nullptr, "whole")}, {config}));
  std::map<std::string, DeviceHealthEntry> health;
  health["gpu-1"] = {"gpu-1", DeviceHealthState::kHealthy, 1700000000, ""};
  health["gpu-2"] = {"gpu-2", DeviceHealthState::kUnhealthy, 1700000100, "gpu-lost"};
  const json body = claim_status_apply(plan, health, 1700000050);
  EXPECT_EQ(body["apiVersion"], "resource.k8s.io/v1");
  EXPECT_EQ(body["kind"], "ResourceClaim");
  EXPECT_EQ(body["metadata"], json({{"name", "train-gpu"}, {"namespace", "team-a"}, {"uid", kUid}}));
  ASSERT_EQ(body["status"].size(), 1u) << "only status.devices: nothing else of the claim is the plugin's";
  const json& devices = body["status"]["devices"];
  ASSERT_EQ(devices.size(), 2u);

  const json& first = devices[0];
  EXPECT_EQ(first["driver"], "gpu.fracgpu.io");
  EXPECT_EQ(first["pool"], kNode);
  EXPECT_EQ(first["device"], "gpu-1");
  EXPECT_EQ(first["shareID"], "00000000-aaaa-4bbb-8ccc-000000000001");
  ASSERT_EQ(first["conditions"].size(), 2u);
  EXPECT_EQ(first["conditions"][0]["type"], "Ready");
  EXPECT_EQ(first["conditions"][0]["status"], "True");
  EXPECT_EQ(first["conditions"][0]["lastTransitionTime"], "2023-11-14T22:14:10Z");
  EXPECT_EQ(first["conditions"][1]["type"], "GPUHealthy");
  EXPECT_EQ(first["conditions"][1]["status"], "True");
  EXPECT_EQ(first["conditions"][1]["lastTransitionTime"], "2023-11-14T22:13:20Z");
  EXPECT_EQ(first["data"]["tenant"], "dra-" + kUid);
  EXPECT_EQ(first["data"]["memory"], std::to_string(4ull << 30));
  EXPECT_EQ(first["data"]["share"], 0.25);
  EXPECT_EQ(first["data"]["limit"], 0.5);
  EXPECT_EQ(first["data"]["priority"], "latency");
  EXPECT_EQ(first["data"]["health"], "Healthy");
  EXPECT_FALSE(first["data"].contains("fenceReason"));

  const json& second = devices[1];
  EXPECT_FALSE(second.contains("shareID"));
  EXPECT_EQ(second["conditions"][1]["status"], "False");
  EXPECT_EQ(second["conditions"][1]["reason"], "GpuLost");
  EXPECT_EQ(second["data"]["share"], 1.0);
  EXPECT_EQ(second["data"]["memory"], std::to_string(kGpuMemory));
  EXPECT_TRUE(second["data"]["limit"].is_null()) << "a whole GPU has no limit";
  EXPECT_EQ(second["data"]["health"], "Unhealthy");
  EXPECT_EQ(second["data"]["fenceReason"], "gpu-lost");

  // Nothing known of the GPUs yet: Unknown, since the claim's preparation.
  const json unknown = claim_status_apply(plan, {}, 1700000050);
  EXPECT_EQ(unknown["status"]["devices"][0]["conditions"][1]["status"], "Unknown");
  EXPECT_EQ(unknown["status"]["devices"][0]["conditions"][1]["reason"], "DaemonUnreachable");
  EXPECT_EQ(unknown["status"]["devices"][0]["data"]["health"], "Unknown");
  EXPECT_EQ(claim_status_path(kRef),
            "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/train-gpu/status"
            "?fieldManager=gpu.fracgpu.io&force=true");
}

}  // namespace

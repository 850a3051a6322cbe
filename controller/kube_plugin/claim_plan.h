// From a ResourceClaim (resource.k8s.io/v1, as the API server returns it) and
// the daemon's NODE object (control API "node") to what the plugin makes on
// this node: the tenant's spec and the devices the kubelet is told about.
// Pure: no I/O, so every rule is unit-tested (kube_plugin_unit_test).
//
// The rules (docs/kubernetes.md, "Prepare"):
// - results of driver gpu.fracgpu.io in pool <node name> are this node's;
//   others (another driver's) are ignored; none at all is an error;
// - device "gpu-<index>" is the GPU of that index in NODE;
// - consumedCapacity memory / share are the tenant's quota and share on that
//   GPU; a capacity absent is the whole of it (memory: the GPU's memory;
//   share: 1); several results on one GPU add up;
// - limit from the opaque config of driver gpu.fracgpu.io, parameters
//   {apiVersion: gpu.fracgpu.io/v1alpha1, kind: GpuConfig, limit: "share" |
//   "<fraction>"}, applying to the result's request (no requests: every
//   request); a FromClaim config wins over a FromClass one, a later one over
//   an earlier one of the same source; a whole GPU (share 1) has no limit;
// - priority from the same configs, `priority: latency | normal | batch`
//   (absent: normal), checked in every config that applies; the claim is one
//   tenant, so the winning config (as above) among those naming one for any
//   of its requests sets it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fracgpu::kube_plugin {

inline constexpr const char* kConfigApiVersion = "gpu.fracgpu.io/v1alpha1";
inline constexpr const char* kConfigKind = "GpuConfig";
inline constexpr const char* kTenantPrefix = "dra-";

// What the kubelet names in a prepare or unprepare call.
struct ClaimRef {
  std::string ns;
  std::string name;
  std::string uid;
  // "ns/name", as errors and logs name the claim.
  std::string shown() const { return ns + "/" + name; }
};

// One allocation result, as the kubelet hears of it.
struct PreparedDevice {
  std::string request;  // the result's request ("gpu", or "gpu/sub")
  std::string pool;
  std::string device;    // "gpu-<index>"
  std::string uuid;      // the GPU's
  std::string share_id;  // the result's shareID, when the scheduler gave one
};

// One GPU of the tenant.
struct PlannedGpu {
  std::string uuid;
  int64_t index = 0;
  uint64_t memory = 0;          // bytes
  double share = 0;             // (0, 1], to a millionth
  std::optional<double> limit;  // absent: the share (a hard cap)
};

struct ClaimPlan {
  ClaimRef claim;
  std::vector<PlannedGpu> gpus;         // one per GPU, in index order
  std::vector<PreparedDevice> devices;  // one per result, in the claim's order
  std::string priority = "normal";      // the tenant's: "latency", "normal" or "batch"
};

// A UID the plugin accepts in file names and tenant names: 1 to 58 of
// [a-z0-9-] (Kubernetes UIDs are 36), starting with a letter or digit.
bool valid_claim_uid(const std::string& uid);
// The request name the kubelet matches a container's claims against: a
// result's request with the subrequest of a prioritized list (firstAvailable:
// "gpu/quarter") taken off, as the upstream helper library hands it back.
std::string kubelet_request_name(const std::string& request);

// "dra-<uid>".
std::string tenant_name(const std::string& uid);

// The plan for `claim` (a ResourceClaim object) on node `node_name`, whose
// daemon answered `node`. nullopt with *error, a sentence starting with the
// claim ("claim ns/name: ...") and naming the field or GPU at fault.
std::optional<ClaimPlan> plan_claim(const ClaimRef& ref, const nlohmann::json& claim, const std::string& node_name,
                                    const nlohmann::json& node, std::string* error);

// The control API SPEC of the plan's tenant, with annotations naming the claim.
nlohmann::json tenant_spec(const ClaimPlan& plan);

// A plan <-> JSON, for the claim record.
nlohmann::json plan_to_json(const ClaimPlan& plan);
std::optional<ClaimPlan> plan_from_json(const nlohmann::json& j, std::string* error);

}  // namespace fracgpu::kube_plugin

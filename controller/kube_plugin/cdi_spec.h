// The CDI spec of a prepared claim: what the container runtime adds to each
// container of the pod (docs/containers.md's recipe, docs/security.md):
//   env     LD_PRELOAD=<the interposer in the container>, FRACGPU_UNMANAGED=deny
//           (the same in every claim's spec)
//   mounts  the tenant's directory read-only at /run/fracgpu/claims/<claim UID>,
//           its usage file read-write over it, the interposer read-only
//   devices the GPUs' /dev/nvidia* nodes only when asked (--device-nodes=host);
//           by default NVIDIA's own CDI spec brings them (nvidia.com/gpu=UUID)
// One spec file per claim, kind gpu.fracgpu.io/claim, one device named after
// the claim's UID. A runtime applying several claims' edits to one container
// keeps one mount per container path and one value per variable, so each
// claim's tenant directory has a path of its own (the interposer attaches to
// every directory under /run/fracgpu/claims: docs/kubernetes.md) and no
// variable differs between claims.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kube_plugin/claim_plan.h"

namespace fracgpu::kube_plugin {

inline constexpr const char* kCdiVersion = "0.6.0";
inline constexpr const char* kCdiKind = "gpu.fracgpu.io/claim";
// Where each claim's tenant directory is mounted: <this>/<claim UID>.
inline constexpr const char* kContainerClaimsDir = "/run/fracgpu/claims";
// --device-nodes values.
inline constexpr const char* kDeviceNodesNvidiaCdi = "nvidia-cdi";
inline constexpr const char* kDeviceNodesHost = "host";

struct CdiOptions {
  std::string library_host_path = "/usr/local/lib/fracgpu/libfracgpu.so";
  std::string library_container_path = "/usr/lib/fracgpu/libfracgpu.so";
  // kDeviceNodesNvidiaCdi: no device nodes here, NVIDIA's CDI device per GPU
  // in the answer. kDeviceNodesHost: /dev/nvidiactl, /dev/nvidia-uvm,
  // /dev/nvidia-uvm-tools and /dev/nvidia<index> of each GPU in the spec
  // (the GPU's minor number taken to be its index), no NVIDIA CDI device.
  std::string device_nodes = kDeviceNodesNvidiaCdi;
};

// "gpu.fracgpu.io-claim_<uid>.json".
std::string cdi_spec_file_name(const std::string& uid);
// "gpu.fracgpu.io/claim=<uid>".
std::string cdi_device_id(const std::string& uid);
// The CDI ids the kubelet passes to the runtime for this claim's devices:
// ours, then NVIDIA's per GPU of the device (nvidia-cdi mode).
std::vector<std::string> cdi_device_ids(const ClaimPlan& plan, const PreparedDevice& device, const CdiOptions& options);

// kContainerClaimsDir/<uid>: the claim's tenant directory in its containers.
std::string container_tenant_dir(const std::string& uid);

// The spec for `plan`, whose tenant's directory on the host is
// `host_tenant_dir`.
nlohmann::json build_cdi_spec(const ClaimPlan& plan, const std::string& host_tenant_dir, const CdiOptions& options);

}  // namespace fracgpu::kube_plugin

#include "kube_plugin/cdi_spec.h"

#include <fmt/format.h>

#include "kube/resource_slice.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;

std::string cdi_spec_file_name(const std::string& uid) {
  return fmt::format("{}-claim_{}.json", kube::kDriverName, uid);
}

std::string cdi_device_id(const std::string& uid) { return fmt::format("{}={}", kCdiKind, uid); }

std::vector<std::string> cdi_device_ids(const ClaimPlan& plan, const PreparedDevice& device,
                                        const CdiOptions& options) {
  std::vector<std::string> ids{cdi_device_id(plan.claim.uid)};
  if (options.device_nodes == kDeviceNodesNvidiaCdi) ids.push_back("nvidia.com/gpu=" + device.uuid);
  return ids;
}

std::string container_tenant_dir(const std::string& uid) { return fmt::format("{}/{}", kContainerClaimsDir, uid); }

json build_cdi_spec(const ClaimPlan& plan, const std::string& host_tenant_dir, const CdiOptions& options) {
  auto mount = [](const std::string& host, const std::string& container, const char* mode) {
    return json{{"hostPath", host}, {"containerPath", container}, {"options", {mode, "nosuid", "nodev", "bind"}}};
  };
  // Every claim of a container adds these edits: only paths of this claim's
  // own, and variables with the same value in every claim, so that no
  // claim's edit replaces another's.
  const std::string tenant_dir = container_tenant_dir(plan.claim.uid);
  json edits = {{"env", {"LD_PRELOAD=" + options.library_container_path, "FRACGPU_UNMANAGED=deny"}},
                {"mounts",
                 {mount(host_tenant_dir, tenant_dir, "ro"), mount(host_tenant_dir + "/usage", tenant_dir + "/usage", "rw"),
                  mount(options.library_host_path, options.library_container_path, "ro")}}};
  if (options.device_nodes == kDeviceNodesHost) {
    json nodes = json::array();
    for (const char* path : {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"})
      nodes.push_back({{"path", path}});
    for (const PlannedGpu& gpu : plan.gpus) nodes.push_back({{"path", fmt::format("/dev/nvidia{}", gpu.index)}});
    edits["deviceNodes"] = std::move(nodes);
  }
  return {{"cdiVersion", kCdiVersion},
          {"kind", kCdiKind},
          {"devices", {{{"name", plan.claim.uid}, {"containerEdits", std::move(edits)}}}}};
}

}  // namespace fracgpu::kube_plugin

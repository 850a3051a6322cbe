// The plugin's two gRPC endpoints, both Unix sockets made by the plugin,
// mode 0600 (the kubelet runs as root), stale ones removed at start:
//   <registry-dir>/gpu.fracgpu.io-reg.sock  pluginregistration.Registration:
//       GetInfo -> {type "DRAPlugin", name "gpu.fracgpu.io",
//                   endpoint <plugin-dir>/dra.sock,
//                   supported_versions ["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"]}
//       (the kubelet's name for the service k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin,
//       and the health service's full gRPC name);
//       NotifyRegistrationStatus -> logged.
//   <plugin-dir>/dra.sock  k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin:
//       NodePrepareResources / NodeUnprepareResources, claim by claim
//       through Driver; errors are per claim, the call itself succeeds.
//     and v1alpha1.DRAResourceHealth (the kubelet's gate ResourceHealthStatus):
//       NodeWatchResources, a stream of every device's health
//       (DeviceHealthBoard): the whole pool at once, then at each change.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include <spdlog/logger.h>

#include "kube_plugin/device_health.h"
#include "kube_plugin/driver.h"

namespace grpc {
class Server;
}

namespace fracgpu::kube_plugin {

inline constexpr const char* kPluginType = "DRAPlugin";
inline constexpr const char* kDraServiceVersion = "v1.DRAPlugin";
inline constexpr const char* kDraSocketName = "dra.sock";
inline constexpr const char* kHealthServiceName = "v1alpha1.DRAResourceHealth";

// "<driver>-reg.sock".
std::string registration_socket_name();

class PluginServers {
 public:
  // `pool`: the pool the health stream names (the node's name, as the slice's).
  PluginServers(Driver& driver, DeviceHealthBoard& health, std::string pool, std::string plugin_dir,
                std::string registry_dir, std::shared_ptr<spdlog::logger> log);
  ~PluginServers();

  // Serves the DRA socket first, then the registration socket (the kubelet
  // calls the DRA socket as soon as it has registered). false with *error.
  bool start(std::string* error);
  // Stops both and removes their sockets (the kubelet then deregisters);
  // closes the health board, which ends the open health streams.
  void stop();

  // Whether the kubelet last said the registration succeeded.
  bool registered() const { return registered_.load(); }
  // How many times the kubelet has registered the plugin. A kubelet that
  // starts deletes every ResourceSlice of the node, then registers the
  // plugins again: the slice loop publishes at once when this moves.
  uint64_t registrations() const { return registrations_.load(std::memory_order_acquire); }

  struct Services;

 private:
  Driver& driver_;
  DeviceHealthBoard& health_;
  std::string pool_;
  std::string plugin_dir_;
  std::string registry_dir_;
  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<Services> services_;
  std::unique_ptr<grpc::Server> dra_server_;
  std::unique_ptr<grpc::Server> registration_server_;
  std::atomic<bool> registered_{false};
  std::atomic<uint64_t> registrations_{0};
};

}  // namespace fracgpu::kube_plugin

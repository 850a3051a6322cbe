#include "kube_plugin/grpc_servers.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <initializer_list>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "dra_health_v1alpha1.grpc.pb.h"
#include "dra_v1.grpc.pb.h"
#include "kube/resource_slice.h"
#include "pluginregistration_v1.grpc.pb.h"
#include "state/run_dir.h"

namespace fracgpu::kube_plugin {

namespace dra = k8s::io::kubelet::pkg::apis::dra::v1;
namespace reg = pluginregistration;
namespace health = v1alpha1;

std::string registration_socket_name() { return std::string(kube::kDriverName) + "-reg.sock"; }

namespace {

ClaimRef ref_of(const dra::Claim& c) { return {c.namespace_(), c.name(), c.uid()}; }

class DraService final : public dra::DRAPlugin::Service {
 public:
  explicit DraService(Driver& driver) : driver_(driver) {}

  grpc::Status NodePrepareResources(grpc::ServerContext* context, const dra::NodePrepareResourcesRequest* request,
                                    dra::NodePrepareResourcesResponse* response) override {
    const auto abandoned = [context] { return context->IsCancelled(); };
    for (const dra::Claim& claim : request->claims()) {
      PrepareResult result;
      try {
        result = driver_.prepare(ref_of(claim), abandoned);
      } catch (const std::exception& e) {  // never expected; the claim fails, the plugin stays up
        result.error = fmt::format("claim {}: internal error: {}", ref_of(claim).shown(), e.what());
      }
      dra::NodePrepareResourceResponse& out = (*response->mutable_claims())[claim.uid()];
      if (!result.error.empty()) {
        out.set_error(result.error);
        continue;
      }
      for (size_t i = 0; i < result.devices.size(); ++i) {
        const PreparedDevice& d = result.devices[i];
        dra::Device* device = out.add_devices();
        // The kubelet hands a device to a container whose claim names this
        // request; a subrequest of a prioritized list would match none.
        device->add_request_names(kubelet_request_name(d.request));
        device->set_pool_name(d.pool);
        device->set_device_name(d.device);
        for (const std::string& id : result.cdi_ids[i]) device->add_cdi_device_ids(id);
        if (!d.share_id.empty()) device->set_share_id(d.share_id);
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status NodeUnprepareResources(grpc::ServerContext*, const dra::NodeUnprepareResourcesRequest* request,
                                      dra::NodeUnprepareResourcesResponse* response) override {
    for (const dra::Claim& claim : request->claims()) {
      std::string error;
      try {
        error = driver_.unprepare(ref_of(claim));
      } catch (const std::exception& e) {  // as above
        error = fmt::format("claim {}: internal error: {}", ref_of(claim).shown(), e.what());
      }
      (*response->mutable_claims())[claim.uid()].set_error(error);
    }
    return grpc::Status::OK;
  }

 private:
  Driver& driver_;
};

// The kubelet opens one stream per registered plugin and keeps it open: the
// whole list at once, then again at every change, and at least every
// kResend: the kubelet takes a device it has heard nothing of for 30 s
// (its DefaultHealthTimeout, counted from when a message arrived) as
// Unknown. The handler holds a gRPC thread while it waits, which the
// synchronous server replaces, so prepare and unprepare calls are served
// beside it.
class HealthService final : public health::DRAResourceHealth::Service {
 public:
  HealthService(const DeviceHealthBoard& board, std::string pool, std::shared_ptr<spdlog::logger> log)
      : board_(board), pool_(std::move(pool)), log_(std::move(log)) {}

  grpc::Status NodeWatchResources(grpc::ServerContext* context, const health::NodeWatchResourcesRequest*,
                                  grpc::ServerWriter<health::NodeWatchResourcesResponse>* writer) override {
    log_->info("health: the kubelet watches the devices' health");
    uint64_t sent = 0;
    auto sent_at = std::chrono::steady_clock::now();
    for (;;) {
      // Woken by a change or by close(); the timeout notices a kubelet that
      // went away, and when the list is due again.
      const DeviceHealthSnapshot now = board_.wait_newer_than(sent, kCancelCheck);
      if (now.closed) return grpc::Status::OK;
      if (context->IsCancelled()) return grpc::Status::CANCELLED;
      if (now.version == 0) continue;  // nothing known yet
      if (now.version == sent && std::chrono::steady_clock::now() - sent_at < kResend) continue;
      health::NodeWatchResourcesResponse response;
      for (const DeviceHealthEntry& entry : now.devices) {
        health::DeviceHealth* device = response.add_devices();
        device->mutable_device()->set_pool_name(pool_);
        device->mutable_device()->set_device_name(entry.device);
        device->set_health(entry.state == DeviceHealthState::kHealthy     ? health::HEALTHY
                           : entry.state == DeviceHealthState::kUnhealthy ? health::UNHEALTHY
                                                                          : health::UNKNOWN);
        device->set_last_updated_time(entry.since_unix);
      }
      if (!writer->Write(response)) return grpc::Status::CANCELLED;  // the kubelet went away
      sent = now.version;
      sent_at = std::chrono::steady_clock::now();
    }
  }

 private:
  static constexpr std::chrono::milliseconds kCancelCheck{500};
  static constexpr std::chrono::seconds kResend{10};
  const DeviceHealthBoard& board_;
  std::string pool_;
  std::shared_ptr<spdlog::logger> log_;
};

class RegistrationService final : public reg::Registration::Service {
 public:
  RegistrationService(std::string endpoint, std::atomic<bool>& registered, std::atomic<uint64_t>& registrations,
                      std::shared_ptr<spdlog::logger> log)
      : endpoint_(std::move(endpoint)), registered_(registered), registrations_(registrations), log_(std::move(log)) {}

  grpc::Status GetInfo(grpc::ServerContext*, const reg::InfoRequest*, reg::PluginInfo* info) override {
    info->set_type(kPluginType);
    info->set_name(kube::kDriverName);
    info->set_endpoint(endpoint_);
    info->add_supported_versions(kDraServiceVersion);
    // Newer kubelets open the health stream only for a plugin that names the
    // service here (1.34 tries it on any plugin). The kubelet takes the first
    // DRAPlugin version it knows from this list and passes over other names.
    info->add_supported_versions(kHealthServiceName);
    log_->info("registration: the kubelet asked who we are (endpoint {})", endpoint_);
    return grpc::Status::OK;
  }

  grpc::Status NotifyRegistrationStatus(grpc::ServerContext*, const reg::RegistrationStatus* status,
                                        reg::RegistrationStatusResponse*) override {
    registered_.store(status->plugin_registered());
    if (status->plugin_registered()) {
      registrations_.fetch_add(1, std::memory_order_release);
      log_->info("registration: the kubelet registered the plugin");
    }
    else
      log_->error("registration: the kubelet refused the plugin: {}", status->error());
    return grpc::Status::OK;
  }

 private:
  std::string endpoint_;
  std::atomic<bool>& registered_;
  std::atomic<uint64_t>& registrations_;
  std::shared_ptr<spdlog::logger> log_;
};

// Serves `services` on the Unix socket `path` (a stale file removed first), mode 0600.
std::unique_ptr<grpc::Server> serve(std::initializer_list<grpc::Service*> services, const std::string& path,
                                    std::string* error) {
  if (!controller::make_path(path.substr(0, path.rfind('/')), 0750, error)) return nullptr;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    *error = fmt::format("remove the stale {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials(), &bound);
  for (grpc::Service* service : services) builder.RegisterService(service);
  auto server = builder.BuildAndStart();
  if (!server || !bound) {
    *error = "cannot serve gRPC on " + path;
    return nullptr;
  }
  if (::chmod(path.c_str(), 0600) != 0) {
    *error = fmt::format("chmod 0600 {}: {}", path, std::strerror(errno));
    server->Shutdown();
    return nullptr;
  }
  return server;
}

}  // namespace

struct PluginServers::Services {
  DraService dra;
  HealthService health;
  RegistrationService registration;
};

PluginServers::PluginServers(Driver& driver, DeviceHealthBoard& health, std::string pool, std::string plugin_dir,
                             std::string registry_dir, std::shared_ptr<spdlog::logger> log)
    : driver_(driver),
      health_(health),
      pool_(std::move(pool)),
      plugin_dir_(std::move(plugin_dir)),
      registry_dir_(std::move(registry_dir)),
      log_(std::move(log)) {}

PluginServers::~PluginServers() { stop(); }

bool PluginServers::start(std::string* error) {
  const std::string endpoint = plugin_dir_ + "/" + kDraSocketName;
  services_.reset(new Services{DraService(driver_), HealthService(health_, pool_, log_),
                               RegistrationService(endpoint, registered_, registrations_, log_)});
  // The kubelet calls the health service on the DRA socket: one endpoint.
  dra_server_ = serve({&services_->dra, &services_->health}, endpoint, error);
  if (!dra_server_) return false;
  const std::string reg_path = registry_dir_ + "/" + registration_socket_name();
  registration_server_ = serve({&services_->registration}, reg_path, error);
  if (!registration_server_) {
    stop();
    return false;
  }
  log_->info("serving {} and {} on {}, registration on {}", kDraServiceVersion, kHealthServiceName, endpoint, reg_path);
  return true;
}

namespace {
// A call still running then is cancelled: the kubelet retries it.
constexpr auto kShutdownGrace = std::chrono::milliseconds(500);
}  // namespace

void PluginServers::stop() {
  // The registration socket first: the kubelet stops sending calls.
  if (registration_server_) {
    registration_server_->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
    registration_server_.reset();
    ::unlink((registry_dir_ + "/" + registration_socket_name()).c_str());
  }
  if (dra_server_) {
    // Health streams wait on the board, not on gRPC: end them first, or
    // Shutdown would wait out its grace period and cancel them.
    health_.close();
    dra_server_->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
    dra_server_.reset();
    ::unlink((plugin_dir_ + "/" + kDraSocketName).c_str());
  }
}

}  // namespace fracgpu::kube_plugin

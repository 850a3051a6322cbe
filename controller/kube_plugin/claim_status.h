// What each prepared claim got, written into the claim itself: one entry of
// status.devices (resource.k8s.io/v1 AllocatedDeviceStatus; the API server's
// feature DRAResourceClaimDeviceStatus) for each device allocated to it, so
// that `kubectl get resourceclaim -o yaml` shows what the pod really has.
//
// Each entry: driver, pool, device (and the result's shareID), two
// conditions and data:
//   Ready       True once the claim's tenant exists (reason TenantReady);
//   GPUHealthy  True while the GPU is healthy (reason Healthy), False while
//               fracgpud's health probe has it fenced (reason the fault's
//               class: GpuLost, EccErrors, Xid, SensorsUnreadable,
//               Unhealthy), Unknown while fracgpud does not answer (reason
//               DaemonUnreachable);
//   data        {"tenant", "gpu" (UUID), "index", "memory" (the tenant's
//               quota on that GPU, bytes, as a quantity), "share" (its part
//               of the GPU's time, a fraction), "limit" (the most it may
//               use while others leave the GPU idle; null: no limit),
//               "priority", "health" ("Healthy", "Unhealthy" or "Unknown"),
//               "fenceReason" (while fenced: the fault's class)}.
// Several results on one GPU show the tenant's totals on that GPU.
//
// Written by server-side apply (PATCH .../resourceclaims/NAME/status,
// field manager gpu.fracgpu.io, forced), so the plugin owns its entries and
// nothing else of the claim; with metadata.uid, so a claim deleted and made
// again under the same name is not written. The API server needs
// `patch` on resourceclaims/status and, from 1.36 (the gate
// DRAResourceClaimGranularStatusAuthorization), `associated-node:patch` on
// resourceclaims/driver for the driver's name (deploy/rbac.yaml).
//
// A background thread writes: after each prepare (the kubelet's call does not
// wait for it), and whenever a GPU's health changes (DeviceHealthBoard); a
// write that fails is tried again after a pause (doubling while it keeps
// failing). Nothing is written at
// unprepare: the claim is then being released, and the scheduler's
// deallocation clears status.devices with the allocation.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "kube/api_client.h"
#include "kube_plugin/claim_plan.h"
#include "kube_plugin/device_health.h"

namespace fracgpu::kube_plugin {

inline constexpr const char* kReadyCondition = "Ready";
inline constexpr const char* kGpuHealthyCondition = "GPUHealthy";

// The server-side-apply body for `plan`'s claim: its devices' entries as
// above. `health`: the board's entries by device name ("gpu-1"); a device
// absent from it is Unknown. `prepared_unix`: Ready's lastTransitionTime.
nlohmann::json claim_status_apply(const ClaimPlan& plan, const std::map<std::string, DeviceHealthEntry>& health,
                                  int64_t prepared_unix);

// The path the body is applied to.
std::string claim_status_path(const ClaimRef& claim);

// "gpu-lost" -> "GpuLost": a fence's class as a condition reason.
std::string fence_condition_reason(const std::string& taint_value);

class ClaimStatusReporter {
 public:
  ClaimStatusReporter(kube::ApiClient* api, DeviceHealthBoard* health, std::shared_ptr<spdlog::logger> log,
                      std::chrono::milliseconds retry_after = std::chrono::seconds(5));
  ~ClaimStatusReporter();
  void start();
  void stop();

  // The claim is prepared (again): report it.
  void prepared(const ClaimPlan& plan);
  // The claim is unprepared: stop reporting it.
  void unprepared(const std::string& uid);

 private:
  struct Entry {
    ClaimPlan plan;
    int64_t prepared_unix = 0;
    nlohmann::json written;  // the last body the server took (null: none)
    std::chrono::steady_clock::time_point retry_at{};
    int failures = 0;  // in a row
  };
  void run();

  kube::ApiClient* api_;
  DeviceHealthBoard* health_;
  std::shared_ptr<spdlog::logger> log_;
  std::chrono::milliseconds retry_after_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<std::string, Entry> claims_;  // by uid
  bool stop_ = false;
  bool dirty_ = false;
  std::thread thread_;
};

}  // namespace fracgpu::kube_plugin

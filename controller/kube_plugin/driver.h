// NodePrepareResources and NodeUnprepareResources for one claim each: the
// plugin's work between the kubelet, the API server, fracgpud's control API
// and the CDI spec directory (docs/kubernetes.md, "What happens on the node").
//
// Prepare:   record? -- yes --> (re)create the tenant, (re)write the spec
//              | no
//            GET the claim, ask the daemon for NODE, plan (claim_plan.h),
//            write the record, create tenant dra-<uid>, write the CDI spec.
// Unprepare: record? -- no --> done (success)
//              | yes
//            delete tenant dra-<uid> (draining while processes live),
//            remove the CDI spec, then the record.
// Every step is idempotent, so a retry, or a plugin restarted after being
// killed anywhere in between, ends where a single call would have.
// Calls are serialized (one mutex): the kubelet sends few, and the daemon
// decides capacity in order anyway.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <spdlog/logger.h>

#include "kube/api_client.h"
#include "kube_plugin/cdi_spec.h"
#include "kube_plugin/claim_plan.h"
#include "kube_plugin/claim_store.h"

namespace fracgpu::kube_plugin {

// The test hook FRACGPU_KUBE_PLUGIN_TEST_CRASH names one of these: the plugin
// _exit()s there (status kCrashExitStatus), as if killed.
inline constexpr const char* kCrashEnv = "FRACGPU_KUBE_PLUGIN_TEST_CRASH";
inline constexpr const char* kCrashPoints[] = {"after-record", "after-tenant", "after-cdi"};
inline constexpr int kCrashExitStatus = 86;

struct DriverOptions {
  std::string node_name;
  std::string run_dir = "/run/fracgpu";
  std::string cdi_dir = "/var/run/cdi";
  CdiOptions cdi;
  std::chrono::milliseconds control_timeout{10'000};
  std::string crash_point;  // from kCrashEnv; empty: none
};

// One claim's outcome: devices on success, else error.
struct PrepareResult {
  std::vector<PreparedDevice> devices;
  std::vector<std::vector<std::string>> cdi_ids;  // per device
  std::string error;
};

class ClaimStatusReporter;

class Driver {
 public:
  // `status` (optional): told of every claim prepared and unprepared, to
  // write what each got into the claim (claim_status.h).
  Driver(DriverOptions options, kube::ApiClient* api, std::shared_ptr<spdlog::logger> log,
         ClaimStatusReporter* status = nullptr);

  // Tells the status reporter of every claim with a record (at start: the
  // claims prepared before the plugin restarted).
  void report_recorded();

  // `abandoned`: whether the kubelet has given up on the call (its deadline
  // passed while this one waited for the lock or the API server): then
  // nothing is made, since the kubelet may have unprepared the claim since.
  PrepareResult prepare(const ClaimRef& claim, const std::function<bool()>& abandoned = {});
  // "" on success (an unknown claim included).
  std::string unprepare(const ClaimRef& claim);

  // Bumped after each prepare or unprepare that changed something: the slice
  // loop republishes then.
  uint64_t changes() const;

 private:
  PrepareResult apply(const ClaimRecord& record);
  void crash_point(const char* point) const;
  std::string host_tenant_dir(const std::string& uid) const;

  DriverOptions options_;
  kube::ApiClient* api_;
  std::shared_ptr<spdlog::logger> log_;
  ClaimStatusReporter* status_;
  ClaimStore store_;
  mutable std::mutex mutex_;
  // Not under mutex_: a prepare holds that across API and control calls (up
  // to a minute), and the slice loop, which reads this, must not wait on it.
  std::atomic<uint64_t> changes_{0};
};

}  // namespace fracgpu::kube_plugin

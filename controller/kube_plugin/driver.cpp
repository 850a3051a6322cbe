#include "kube_plugin/driver.h"

#include <unistd.h>

#include <set>
#include <string>

#include <fmt/format.h>

#include "control/client.h"
#include "control/protocol.h"
#include "kube/resource_slice.h"
#include "kube_plugin/atomic_file.h"
#include "kube_plugin/claim_status.h"
#include "state/run_dir.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;

Driver::Driver(DriverOptions options, kube::ApiClient* api, std::shared_ptr<spdlog::logger> log,
               ClaimStatusReporter* status)
    : options_(std::move(options)), api_(api), log_(std::move(log)), status_(status), store_(options_.run_dir) {}

void Driver::report_recorded() {
  if (!status_) return;
  std::lock_guard lock(mutex_);
  // A record whose tenant does not exist is a prepare that never finished
  // (killed between the record and the tenant, or the daemon never
  // answered): the kubelet retries it, and it is reported when it succeeds.
  // Without the daemon's list every record is taken as prepared.
  const control::Reply list = control::call(control::socket_path_in(options_.run_dir), {{"op", control::op::kList}},
                                            options_.control_timeout);
  std::set<std::string> tenants;
  if (list.ok)
    for (const json& t : list.body.value("tenants", json::array()))
      if (t.is_object()) tenants.insert(t.value("name", std::string()));
  for (const std::string& uid : store_.list()) {
    std::string error;
    auto record = store_.get(uid, &error);
    if (!record) continue;
    if (list.ok && !tenants.contains(record->tenant)) {
      log_->info("claim {}: recorded, but its tenant {} does not exist: not reported prepared until it is",
                 record->plan.claim.shown(), record->tenant);
      continue;
    }
    status_->prepared(record->plan);
  }
}

uint64_t Driver::changes() const { return changes_.load(std::memory_order_acquire); }

void Driver::crash_point(const char* point) const {
  if (options_.crash_point == point) {
    log_->warn("test hook {}={}: exiting here", kCrashEnv, point);
    log_->flush();
    ::_exit(kCrashExitStatus);
  }
}

std::string Driver::host_tenant_dir(const std::string& uid) const {
  return options_.run_dir + "/" + controller::kTenantsDirName + "/" + tenant_name(uid);
}

PrepareResult Driver::prepare(const ClaimRef& claim, const std::function<bool()>& abandoned) {
  std::lock_guard lock(mutex_);
  const std::string who = "claim " + claim.shown();
  const auto given_up = [&] {
    if (!abandoned || !abandoned()) return false;
    log_->warn("{}: the kubelet gave up on this prepare; nothing made (it will ask again if it still wants it)", who);
    return true;
  };
  if (given_up()) return {{}, {}, who + ": the kubelet gave up on the call"};
  if (!valid_claim_uid(claim.uid))
    return {{}, {}, fmt::format("{}: uid \"{}\" is not one this plugin takes", who, claim.uid)};

  std::string error;
  if (auto record = store_.get(claim.uid, &error)) {
    log_->info("{} ({}): prepared before (record found), making sure of its tenant and CDI spec", who, claim.uid);
    return apply(*record);
  }
  if (!error.empty()) {
    log_->error("{}: {}", who, error);
    return {{}, {}, who + ": " + error};
  }

  if (!api_) return {{}, {}, who + ": no API server to read it from"};
  const std::string path = fmt::format("{}/namespaces/{}/resourceclaims/{}", kube::kResourceApi,
                                       kube::escape_query_value(claim.ns), kube::escape_query_value(claim.name));
  const kube::HttpResult got = api_->get(path);  // failures are logged by the client with path and status
  if (!got.ok()) return {{}, {}, fmt::format("{}: GET {}: {}", who, path, got.error)};
  const json object = json::parse(got.body, nullptr, false);

  const control::Reply node =
      control::call(control::socket_path_in(options_.run_dir), {{"op", control::op::kNode}}, options_.control_timeout);
  if (!node.ok) {
    error = fmt::format("{}: fracgpud's node: [{}] {}", who, node.code, node.error);
    log_->error("{}", error);
    return {{}, {}, error};
  }

  const json node_object = node.body.is_object() ? node.body.value("node", json()) : json();
  auto plan = plan_claim(claim, object, options_.node_name, node_object, &error);
  if (!plan) {
    log_->error("{}", error);
    return {{}, {}, error};
  }
  if (given_up()) return {{}, {}, who + ": the kubelet gave up on the call"};
  if (!store_.put(*plan, &error)) {
    log_->error("{}: recording it: {}", who, error);
    return {{}, {}, who + ": recording it: " + error};
  }
  crash_point("after-record");
  changes_.fetch_add(1, std::memory_order_release);
  return apply({*plan, tenant_name(claim.uid), cdi_spec_file_name(claim.uid)});
}

PrepareResult Driver::apply(const ClaimRecord& record) {
  const ClaimPlan& plan = record.plan;
  const std::string who = "claim " + plan.claim.shown();
  const control::Reply created =
      control::call(control::socket_path_in(options_.run_dir),
                    {{"op", control::op::kCreate}, {"tenant", tenant_spec(plan)}}, options_.control_timeout);
  if (!created.ok) {
    const std::string error = fmt::format("{}: {}", who, created.error);
    log_->error("{} (creating tenant {}: {})", error, record.tenant, created.code);
    // A refusal with no tenant of that name made nothing: forget the claim,
    // so that a retry reads it again. Otherwise (no answer; or a tenant made
    // by an earlier attempt, now refused, e.g. its GPU fenced meanwhile) keep
    // the record, which a retry or an unprepare completes or undoes.
    const control::Reply existing =
        control::call(control::socket_path_in(options_.run_dir), {{"op", control::op::kGet}, {"name", record.tenant}},
                      options_.control_timeout);
    if (existing.code == control::code::kNotFound) {
      std::string ignored;
      if (!store_.remove(plan.claim.uid, &ignored)) log_->error("{}: {}", who, ignored);
    }
    return {{}, {}, error};
  }
  log_->info("{} ({}): tenant {} {}", who, plan.claim.uid, record.tenant,
             created.body.value("created", false) ? "created" : "already there");
  crash_point("after-tenant");

  std::string error;
  if (!controller::make_path(options_.cdi_dir, 0755, &error) ||
      !write_file_atomic(options_.cdi_dir, record.cdi_spec,
                         build_cdi_spec(plan, host_tenant_dir(plan.claim.uid), options_.cdi).dump(2) + "\n", &error)) {
    log_->error("{}: writing its CDI spec: {}", who, error);
    return {{}, {}, who + ": writing its CDI spec: " + error};
  }
  crash_point("after-cdi");
  changes_.fetch_add(1, std::memory_order_release);

  if (status_) status_->prepared(plan);

  PrepareResult result;
  for (const PreparedDevice& device : plan.devices) {
    result.devices.push_back(device);
    result.cdi_ids.push_back(cdi_device_ids(plan, device, options_.cdi));
  }
  return result;
}

std::string Driver::unprepare(const ClaimRef& claim) {
  std::lock_guard lock(mutex_);
  const std::string who = "claim " + claim.shown();
  if (!valid_claim_uid(claim.uid)) {
    log_->info("{}: uid \"{}\" was never prepared here; nothing to do", who, claim.uid);
    return "";
  }
  std::string error;
  auto record = store_.get(claim.uid, &error);
  if (!record && error.empty()) {
    log_->info("{} ({}): no record, nothing prepared here", who, claim.uid);
    return "";
  }
  // Only a tenant named dra-<uid> of a claim this plugin recorded is
  // deleted. A record that cannot be read (another version's format, a
  // damaged file) is still this plugin's, and what it named follows from
  // the uid alone: refusing would leave the pod terminating for good.
  if (!record) log_->warn("{}: {}; unpreparing by the names its uid gives", who, error);
  const std::string tenant = record ? record->tenant : tenant_name(claim.uid);
  const std::string cdi_spec = record ? record->cdi_spec : cdi_spec_file_name(claim.uid);
  error.clear();
  const control::Reply deleted = control::call(control::socket_path_in(options_.run_dir),
                                               {{"op", control::op::kDelete}, {"name", tenant}}, options_.control_timeout);
  if (!deleted.ok) {
    log_->error("{}: deleting tenant {}: [{}] {}", who, tenant, deleted.code, deleted.error);
    return fmt::format("{}: deleting tenant {}: {}", who, tenant, deleted.error);
  }
  log_->info("{} ({}): tenant {} {}", who, claim.uid, tenant, deleted.body.value("state", ""));
  if (!remove_file_durable(options_.cdi_dir, cdi_spec, &error) || !store_.remove(claim.uid, &error)) {
    log_->error("{}: {}", who, error);
    return who + ": " + error;
  }
  if (status_) status_->unprepared(claim.uid);
  changes_.fetch_add(1, std::memory_order_release);
  return "";
}

}  // namespace fracgpu::kube_plugin

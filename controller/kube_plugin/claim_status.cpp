#include "kube_plugin/claim_status.h"

#include <algorithm>
#include <cctype>
#include <ctime>
#include <vector>

#include <fmt/format.h>

#include "kube/quantity.h"
#include "kube/resource_slice.h"

namespace fracgpu::kube_plugin {

using nlohmann::json;

namespace {

std::string rfc3339(int64_t unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char out[32];
  std::strftime(out, sizeof out, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return out;
}

const char* state_name(DeviceHealthState state) {
  switch (state) {
    case DeviceHealthState::kHealthy:
      return "Healthy";
    case DeviceHealthState::kUnhealthy:
      return "Unhealthy";
    default:
      return "Unknown";
  }
}

json health_condition(const DeviceHealthEntry* entry, int64_t fallback_unix) {
  json c = {{"type", kGpuHealthyCondition}};
  const DeviceHealthState state = entry ? entry->state : DeviceHealthState::kUnknown;
  switch (state) {
    case DeviceHealthState::kHealthy:
      c["status"] = "True";
      c["reason"] = "Healthy";
      c["message"] = "fracgpud's health probe finds the GPU healthy";
      break;
    case DeviceHealthState::kUnhealthy:
      c["status"] = "False";
      c["reason"] = fence_condition_reason(entry->reason);
      c["message"] = fmt::format("fracgpud fenced the GPU ({}): its tenants' processes keep running, no new claim "
                                 "is given it",
                                 entry->reason.empty() ? "unhealthy" : entry->reason);
      break;
    default:
      c["status"] = "Unknown";
      c["reason"] = "DaemonUnreachable";
      c["message"] = "fracgpud does not answer: the GPU's health is not known";
  }
  c["lastTransitionTime"] = rfc3339(entry && entry->since_unix > 0 ? entry->since_unix : fallback_unix);
  return c;
}

}  // namespace

std::string fence_condition_reason(const std::string& taint_value) {
  // A condition reason: CamelCase, letters first ([A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?).
  std::string out;
  bool upper = true;
  for (unsigned char c : taint_value) {
    if (!std::isalnum(c)) {
      upper = true;
      continue;
    }
    if (out.empty() && !std::isalpha(c)) continue;
    out.push_back(static_cast<char>(upper ? std::toupper(c) : c));
    upper = false;
  }
  return out.empty() ? "Unhealthy" : out;
}

std::string claim_status_path(const ClaimRef& claim) {
  return fmt::format("{}/namespaces/{}/resourceclaims/{}/status?fieldManager={}&force=true", kube::kResourceApi,
                     kube::escape_query_value(claim.ns), kube::escape_query_value(claim.name),
                     kube::escape_query_value(kube::kDriverName));
}

json claim_status_apply(const ClaimPlan& plan, const std::map<std::string, DeviceHealthEntry>& health,
                        int64_t prepared_unix) {
  json devices = json::array();
  for (const PreparedDevice& device : plan.devices) {
    const PlannedGpu* gpu = nullptr;
    for (const PlannedGpu& g : plan.gpus)
      if (g.uuid == device.uuid) gpu = &g;
    const auto found = health.find(device.device);
    const DeviceHealthEntry* entry = found == health.end() ? nullptr : &found->second;
    json entry_json = {{"driver", kube::kDriverName}, {"pool", device.pool}, {"device", device.device}};
    if (!device.share_id.empty()) entry_json["shareID"] = device.share_id;
    entry_json["conditions"] = json::array(
        {{{"type", kReadyCondition},
          {"status", "True"},
          {"reason", "TenantReady"},
          {"message", fmt::format("fracgpu tenant {} holds this claim's part of the GPU", tenant_name(plan.claim.uid))},
          {"lastTransitionTime", rfc3339(prepared_unix)}},
         health_condition(entry, prepared_unix)});
    json data = {{"tenant", tenant_name(plan.claim.uid)},
                 {"gpu", device.uuid},
                 {"priority", plan.priority},
                 {"health", state_name(entry ? entry->state : DeviceHealthState::kUnknown)}};
    if (gpu) {
      data["index"] = gpu->index;
      data["memory"] = kube::bytes_quantity(gpu->memory);
      data["share"] = gpu->share;
      data["limit"] = gpu->limit ? json(*gpu->limit) : json(nullptr);
    }
    if (entry && entry->state == DeviceHealthState::kUnhealthy) data["fenceReason"] = entry->reason;
    entry_json["data"] = std::move(data);
    devices.push_back(std::move(entry_json));
  }
  return {{"apiVersion", "resource.k8s.io/v1"},
          {"kind", "ResourceClaim"},
          {"metadata", {{"name", plan.claim.name}, {"namespace", plan.claim.ns}, {"uid", plan.claim.uid}}},
          {"status", {{"devices", std::move(devices)}}}};
}

ClaimStatusReporter::ClaimStatusReporter(kube::ApiClient* api, DeviceHealthBoard* health,
                                         std::shared_ptr<spdlog::logger> log, std::chrono::milliseconds retry_after)
    : api_(api), health_(health), log_(std::move(log)), retry_after_(retry_after) {}

ClaimStatusReporter::~ClaimStatusReporter() { stop(); }

void ClaimStatusReporter::start() {
  if (!api_ || thread_.joinable()) return;
  thread_ = std::thread([this] { run(); });
}

void ClaimStatusReporter::stop() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ClaimStatusReporter::prepared(const ClaimPlan& plan) {
  std::lock_guard lock(mutex_);
  auto [it, added] = claims_.try_emplace(plan.claim.uid);
  it->second.plan = plan;
  if (added) it->second.prepared_unix = static_cast<int64_t>(std::time(nullptr));
  it->second.retry_at = {};
  dirty_ = true;
  wake_.notify_all();
}

void ClaimStatusReporter::unprepared(const std::string& uid) {
  std::lock_guard lock(mutex_);
  claims_.erase(uid);
}

void ClaimStatusReporter::run() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      // Woken by a prepare; otherwise look at the GPUs' health (and due
      // retries) a few times a second.
      wake_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stop_ || dirty_; });
      if (stop_) return;
      dirty_ = false;
    }
    std::map<std::string, DeviceHealthEntry> health;
    if (health_)
      for (const DeviceHealthEntry& e : health_->snapshot().devices) health[e.device] = e;
    // What to write: each claim whose body differs from what the server took.
    std::vector<std::pair<std::string, json>> due;
    const auto now = std::chrono::steady_clock::now();
    {
      std::lock_guard lock(mutex_);
      for (auto& [uid, entry] : claims_) {
        if (now < entry.retry_at) continue;
        json body = claim_status_apply(entry.plan, health, entry.prepared_unix);
        if (body != entry.written) due.emplace_back(uid, std::move(body));
      }
    }
    for (auto& [uid, body] : due) {
      ClaimRef ref;
      {
        std::lock_guard lock(mutex_);
        const auto it = claims_.find(uid);
        if (it == claims_.end()) continue;  // unprepared meanwhile
        ref = it->second.plan.claim;
      }
      const kube::HttpResult r = api_->apply(claim_status_path(ref), body);
      std::lock_guard lock(mutex_);
      const auto it = claims_.find(uid);
      if (it == claims_.end()) continue;
      if (r.ok()) {
        log_->info("claim {} ({}): status.devices written ({} device(s))", ref.shown(), uid,
                   body["status"]["devices"].size());
        it->second.written = std::move(body);
      } else if (r.status == 404 || r.status == 409) {
        // Gone, or another claim of that name now: nothing to tell it.
        log_->info("claim {} ({}): not writing its status: {}", ref.shown(), uid, r.error);
        it->second.written = std::move(body);
      } else {
        // Twice as long after each failure in a row, up to 64 times the first
        // pause: a missing permission is not retried every few seconds forever.
        const auto pause = retry_after_ * (1 << std::min(it->second.failures, 6));
        ++it->second.failures;
        log_->warn("claim {} ({}): writing status.devices: {}; trying again in {} ms", ref.shown(), uid, r.error,
                   pause.count());
        it->second.retry_at = std::chrono::steady_clock::now() + pause;
        continue;
      }
      it->second.failures = 0;
    }
  }
}

}  // namespace fracgpu::kube_plugin

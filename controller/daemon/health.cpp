#include "daemon/health.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "config/placement.h"
#include "state/run_dir.h"
#include "safe_file.h"

namespace fracgpu::controller {

HealthMonitor::HealthMonitor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log,
                             std::string run_dir)
    : nvml_(nvml), run_dir_(std::move(run_dir)), log_(log) {
  const uint64_t now = static_cast<uint64_t>(time(nullptr));
  for (const DiscoveredGpu& g : gpus) {
    GpuHealth h;
    h.index = g.index;
    h.uuid = g.uuid;
    h.since_unix = now;
    gpus_.push_back(std::move(h));
  }
  handles_.assign(gpus_.size(), nullptr);
  registered_.assign(gpus_.size(), false);
  sticky_xid_.assign(gpus_.size(), std::string());
  fenced_on_disk_.assign(gpus_.size(), false);
  // Fences left by an earlier daemon: the GPU stays unhealthy until cleared,
  // from the start, with NVML or without (a driver whose NVML no longer
  // loads after a GPU's failure is no reason to trust that GPU again).
  for (size_t i = 0; i < gpus_.size() && !run_dir_.empty(); ++i) {
    const std::optional<XidFence> f = read_xid_fence(run_dir_, gpus_[i].uuid);
    if (!f) continue;
    GpuHealth& g = gpus_[i];
    fenced_on_disk_[i] = true;
    g.last_xid = f->xid;
    sticky_xid_[i] = fmt::format("{} (fenced since {}; clear with `fracgpu gpu clear {}`)", f->why, f->since_unix,
                                 g.uuid);
    g.healthy = false;
    g.reason = ledger::kGpuXid;
    g.detail = static_cast<uint32_t>(f->xid);
    g.why = sticky_xid_[i];
    log_.warn("health: GPU {} ({}) stays fenced: {}", g.index, g.uuid, sticky_xid_[i]);
  }
  if (nvml_ == nullptr) return;
  const Nvml::Api& api = nvml_->api();
  if (api.event_set_create == nullptr || api.register_events == nullptr || api.event_wait == nullptr) {
    log_.warn("health: this NVML has no event API: Xid errors are not watched");
  } else if (nvmlReturn_t rc = api.event_set_create(&events_); rc != NVML_SUCCESS) {
    log_.warn("health: nvmlEventSetCreate failed ({}): Xid errors are not watched", nvml_->describe(rc));
    events_ = nullptr;
  }
}

HealthMonitor::~HealthMonitor() {
  if (events_ != nullptr && nvml_->api().event_set_free != nullptr) nvml_->api().event_set_free(events_);
}

const GpuHealth* HealthMonitor::find(const std::string& uuid) const {
  for (const GpuHealth& g : gpus_)
    if (g.uuid == uuid) return &g;
  return nullptr;
}

void HealthMonitor::drain_xid_events() {
  if (events_ == nullptr) return;
  // Timeout 0: take what is queued, never wait (the daemon's loop must not stall).
  for (int n = 0; n < 1024; ++n) {
    nvmlEventData_t data{};
    if (nvml_->api().event_wait(events_, &data, 0) != NVML_SUCCESS) return;
    if ((data.eventType & nvmlEventTypeXidCriticalError) == 0) continue;
    for (size_t i = 0; i < gpus_.size(); ++i) {
      if (handles_[i] != data.device) continue;
      GpuHealth& g = gpus_[i];
      ++g.xid_events;
      g.last_xid = data.eventData;
      if (kApplicationXids.contains(data.eventData)) {
        log_.info("health: GPU {} ({}): Xid {} (an application fault, not the GPU's: ignored)", g.index, g.uuid,
                  data.eventData);
      } else if (sticky_xid_[i].empty()) {
        fence(i, data.eventData);
      }
    }
  }
}

void HealthMonitor::fence(size_t i, uint64_t xid) {
  GpuHealth& g = gpus_[i];
  const XidFence f{xid, fmt::format("critical Xid {} reported by NVML", xid), static_cast<uint64_t>(time(nullptr))};
  sticky_xid_[i] = f.why;
  if (run_dir_.empty()) return;
  std::string error;
  if (write_xid_fence(run_dir_, g, f, &error)) {
    fenced_on_disk_[i] = true;
    sticky_xid_[i] += fmt::format(" (clear with `fracgpu gpu clear {}`)", g.uuid);
  } else {
    log_.error("health: GPU {} ({}): {}; its Xid fence lasts only until fracgpud restarts", g.index, g.uuid, error);
  }
}

// A fence whose file is gone was cleared by the operator.
void HealthMonitor::check_fences_cleared() {
  for (size_t i = 0; i < gpus_.size(); ++i) {
    if (!fenced_on_disk_[i] || sticky_xid_[i].empty()) continue;
    struct stat st {};
    if (stat(xid_fence_path(run_dir_, gpus_[i].uuid).c_str(), &st) == 0 || errno != ENOENT) continue;
    fenced_on_disk_[i] = false;
    sticky_xid_[i].clear();
    log_.info("health: GPU {} ({}): Xid fence cleared by the operator", gpus_[i].index, gpus_[i].uuid);
  }
}

HealthMonitor::Probe HealthMonitor::probe_one(GpuHealth& gpu, nvmlDevice_t* handle) {
  const Nvml::Api& api = nvml_->api();
  Probe lost, ecc, sensors;
  if (*handle == nullptr) {
    nvmlDevice_t h = nullptr;
    if (nvmlReturn_t rc = api.get_handle_by_uuid(gpu.uuid.c_str(), &h); rc != NVML_SUCCESS)
      return {ledger::kGpuLost, 0, fmt::format("NVML cannot find it: {}", nvml_->describe(rc))};
    *handle = h;
  }
  auto note_lost = [&](nvmlReturn_t rc, const char* call) {
    if (rc == NVML_ERROR_GPU_IS_LOST && lost.reason == ledger::kGpuAvailable)
      lost = {ledger::kGpuLost, 0, fmt::format("{}: {}", call, nvml_->describe(rc))};
    return rc == NVML_ERROR_GPU_IS_LOST;
  };
  // Temperature and power: reachable and readable. NOT_SUPPORTED is a
  // property of the board (some report no power), not a failure.
  if (api.get_temperature != nullptr) {
    unsigned temp = 0;
    const nvmlReturn_t rc = api.get_temperature(*handle, NVML_TEMPERATURE_GPU, &temp);
    gpu.temperature_c = rc == NVML_SUCCESS ? static_cast<int64_t>(temp) : -1;
    if (!note_lost(rc, "nvmlDeviceGetTemperature") && rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_SUPPORTED)
      sensors = {ledger::kGpuSensors, 0, fmt::format("temperature cannot be read: {}", nvml_->describe(rc))};
  }
  if (api.get_power != nullptr) {
    unsigned mw = 0;
    const nvmlReturn_t rc = api.get_power(*handle, &mw);
    gpu.power_mw = rc == NVML_SUCCESS ? static_cast<int64_t>(mw) : -1;
    if (!note_lost(rc, "nvmlDeviceGetPowerUsage") && rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_SUPPORTED &&
        sensors.reason == ledger::kGpuAvailable)
      sensors = {ledger::kGpuSensors, 0, fmt::format("power cannot be read: {}", nvml_->describe(rc))};
  }
  if (api.get_ecc != nullptr) {
    // Volatile: since the driver loaded (a GPU reset clears it), so a GPU
    // that was reset after its errors counts as healthy again.
    unsigned long long count = 0;
    const nvmlReturn_t rc = api.get_ecc(*handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, &count);
    gpu.ecc_uncorrected = rc == NVML_SUCCESS ? static_cast<int64_t>(count) : -1;
    if (!note_lost(rc, "nvmlDeviceGetTotalEccErrors") && rc == NVML_SUCCESS && count > 0)
      ecc = {ledger::kGpuEcc, static_cast<uint32_t>(std::min<unsigned long long>(count, UINT32_MAX)),
             fmt::format("{} uncorrected ECC error(s) since the driver loaded", count)};
  }
  if (!registered_[&gpu - gpus_.data()] && events_ != nullptr && lost.reason == ledger::kGpuAvailable) {
    const nvmlReturn_t rc = api.register_events(*handle, nvmlEventTypeXidCriticalError, events_);
    registered_[&gpu - gpus_.data()] = true;  // tried: a GPU without event support says so once
    if (rc != NVML_SUCCESS)
      log_.warn("health: GPU {} ({}): Xid events not available ({}): Xid errors are not watched there", gpu.index,
                gpu.uuid, nvml_->describe(rc));
  }
  if (lost.reason != ledger::kGpuAvailable) return lost;
  if (ecc.reason != ledger::kGpuAvailable) return ecc;
  return sensors;
}

bool HealthMonitor::probe() {
  check_fences_cleared();
  drain_xid_events();
  bool changed = false;
  const uint64_t now = static_cast<uint64_t>(time(nullptr));
  for (size_t i = 0; i < gpus_.size(); ++i) {
    GpuHealth& g = gpus_[i];
    // Without NVML only the fences are known.
    Probe p = nvml_ != nullptr ? probe_one(g, &handles_[i]) : Probe{};
    if (p.reason == ledger::kGpuAvailable && !sticky_xid_[i].empty())
      p = {ledger::kGpuXid, static_cast<uint32_t>(g.last_xid), sticky_xid_[i]};
    if (p.reason == g.reason && p.detail == g.detail) {
      g.why = p.why;  // same state: refresh the text (error strings), log nothing
      continue;
    }
    changed = true;
    const bool was_healthy = g.healthy;
    g.healthy = p.reason == ledger::kGpuAvailable;
    g.reason = p.reason;
    g.detail = p.detail;
    g.why = p.why;
    g.since_unix = now;
    if (!g.healthy)
      log_.warn("health: GPU {} ({}) is unhealthy: {}; new processes of its tenants are refused at cuInit, running "
                "ones are left alone",
                g.index, g.uuid, g.why);
    else if (!was_healthy)
      log_.info("health: GPU {} ({}) is healthy again; new processes are accepted", g.index, g.uuid);
  }
  return changed;
}

}  // namespace fracgpu::controller

namespace fracgpu::controller {

const char* unavailable_reason_name(ledger::GpuUnavailableReason reason) {
  switch (reason) {
    case ledger::kGpuAvailable: return "healthy";
    case ledger::kGpuLost: return "lost";
    case ledger::kGpuXid: return "xid";
    case ledger::kGpuEcc: return "ecc";
    case ledger::kGpuSensors: return "sensors";
    case ledger::kGpuBypassDenied: return "bypass";
  }
  return "unknown";
}

std::string node_checks_json(const NodeChecks& checks) {
  nlohmann::json j;
  j["nvml"] = checks.nvml;
  j["nvml_problem"] = checks.nvml_problem;
  j["updated_unix"] = static_cast<uint64_t>(time(nullptr));
  j["gpus"] = nlohmann::json::array();
  for (const GpuHealth& g : checks.gpus) {
    j["gpus"].push_back({{"index", g.index},
                         {"uuid", g.uuid},
                         {"healthy", g.healthy},
                         {"reason", unavailable_reason_name(g.reason)},
                         {"why", g.why},
                         {"since_unix", g.since_unix},
                         {"temperature_c", g.temperature_c},
                         {"power_mw", g.power_mw},
                         {"ecc_uncorrected", g.ecc_uncorrected},
                         {"xid_events", g.xid_events},
                         {"last_xid", g.last_xid}});
  }
  j["audit"]["action"] = audit_action_name(checks.audit_action);
  j["audit"]["findings"] = nlohmann::json::array();
  for (const AuditFinding& f : checks.findings) {
    j["audit"]["findings"].push_back({{"gpu_index", f.gpu_index},
                                      {"gpu_uuid", f.gpu_uuid},
                                      {"pid", f.pid},
                                      {"bytes", f.bytes},
                                      {"comm", f.comm},
                                      {"tenant", f.tenant},
                                      {"claimed_tenant", f.claimed},
                                      {"action", f.action},
                                      {"first_seen_unix", f.first_seen_unix}});
  }
  j["memory_audit"]["action"] = memory_audit_action_name(checks.memory_action);
  j["memory_audit"]["overuses"] = nlohmann::json::array();
  for (const MemoryOveruse& o : checks.overuses) {
    j["memory_audit"]["overuses"].push_back({{"tenant", o.tenant},
                                             {"gpu_index", o.gpu_index},
                                             {"gpu_uuid", o.gpu_uuid},
                                             {"quota", o.quota},
                                             {"allowed", o.allowed},
                                             {"used", o.used},
                                             {"processes", o.processes},
                                             {"since_unix", o.since_unix},
                                             {"action", o.action}});
  }
  // A process's name is its own to choose, not necessarily UTF-8: replaced
  // bytes, not an exception that would stop the daemon.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

bool write_node_checks(const std::string& run_dir, const NodeChecks& checks, std::string* error) {
  return write_run_file(run_dir, "", kHealthFileName, node_checks_json(checks), error);
}

std::string xid_fence_path(const std::string& run_dir, const std::string& uuid) {
  return fmt::format("{}/{}/{}", run_dir, kFencesDirName, uuid);
}

std::optional<XidFence> read_xid_fence(const std::string& run_dir, const std::string& uuid) {
  const std::string path = xid_fence_path(run_dir, uuid);
  XidFence fence;
  std::string error;
  bool missing = false;
  std::optional<std::string> text;
  if (const std::optional<RunDirView> view = open_run_dir_view(run_dir, &error)) {
    char err[512] = {};
    const shm::Opened fences =
        shm::open_dir_at(view->root.get(), kFencesDirName, view->owner, false, run_dir.c_str(), err, sizeof err);
    if (fences.status == shm::FileStatus::kMissing) return std::nullopt;
    error = err;
    if (fences.ok()) {
      const UniqueFd dir(fences.fd);
      text = read_file_at(dir.get(), fmt::format("{}/{}", run_dir, kFencesDirName), uuid.c_str(), view->owner,
                          kMaxRunFileBytes, &error, &missing);
    }
  }
  if (missing) return std::nullopt;
  const nlohmann::json j =
      text ? nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false) : nlohmann::json();
  if (!j.is_object()) {
    // Damaged, hand-made or refused: still a fence (failing safe), with what is known.
    fence.why = text ? fmt::format("Xid fence {} (unreadable contents)", path)
                     : fmt::format("Xid fence {} ({})", path, error);
    return fence;
  }
  // Fields of another type (hand-made) are left as unknown: still a fence.
  const auto field = [&](const char* key) { return j.contains(key) ? &j.at(key) : nullptr; };
  if (const auto* xid = field("xid"); xid != nullptr && xid->is_number_unsigned()) fence.xid = xid->get<uint64_t>();
  fence.why = "critical Xid";
  if (const auto* why = field("why"); why != nullptr && why->is_string()) fence.why = why->get<std::string>();
  if (const auto* since = field("since_unix"); since != nullptr && since->is_number_unsigned())
    fence.since_unix = since->get<uint64_t>();
  return fence;
}

bool write_xid_fence(const std::string& run_dir, const GpuHealth& gpu, const XidFence& fence, std::string* error) {
  nlohmann::ordered_json j;
  j["uuid"] = gpu.uuid;
  j["index"] = gpu.index;
  j["xid"] = fence.xid;
  j["why"] = fence.why;
  j["since_unix"] = fence.since_unix;
  return write_run_file(run_dir, kFencesDirName, gpu.uuid, j.dump(2) + "\n", error);
}

}  // namespace fracgpu::controller

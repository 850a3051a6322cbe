#include "daemon/memory_audit.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include <fmt/format.h>

#include "daemon/audit.h"
#include "ledger.h"  // shm/: monotonic_ns
#include "common/units.h"

namespace fracgpu::controller {

std::optional<MemoryAuditAction> parse_memory_audit_action(std::string_view text) {
  if (text == "report") return MemoryAuditAction::kReport;
  if (text == "terminate") return MemoryAuditAction::kTerminate;
  return std::nullopt;
}

const char* memory_audit_action_name(MemoryAuditAction action) {
  return action == MemoryAuditAction::kReport ? "report" : "terminate";
}

MemoryAuditor::MemoryAuditor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log)
    : nvml_(nvml), log_(log), gpus_(gpus) {}

bool MemoryAuditor::check(const std::map<int32_t, std::string>& owners, const std::vector<TenantQuota>& quotas,
                          const MemoryAuditSettings& settings, const std::string& run_dir) {
  if (nvml_ == nullptr) return false;
  const Nvml::Api& api = nvml_->api();
  const uint64_t now = ledger::monotonic_ns();
  const uint64_t grace_ns = static_cast<uint64_t>(settings.grace.count()) * 1000;
  std::set<std::pair<std::string, std::string>> over_now;
  for (const DiscoveredGpu& gpu : gpus_) {
    bool any_quota = false;
    for (const TenantQuota& q : quotas) any_quota |= q.gpu_uuid == gpu.uuid;
    if (!any_quota) continue;
    nvmlDevice_t handle = nullptr;
    if (api.get_handle_by_uuid(gpu.uuid.c_str(), &handle) != NVML_SUCCESS) continue;  // health reports it
    std::vector<Nvml::Process> processes;
    if (nvml_->compute_processes(handle, &processes) != NVML_SUCCESS) continue;
    // Each process on this GPU, by tenant: verified owners first, then
    // uncharged processes in a tenant's container. Its start time is read
    // first: the process found to be the tenant's is the one (PID, start
    // time) names, and only that one is ever signalled.
    struct Held {
      Nvml::Process p;
      uint64_t start_time;
    };
    std::map<std::string, std::vector<Held>> by_tenant;
    for (const Nvml::Process& p : processes) {
      const auto pid = static_cast<int32_t>(p.pid);
      const uint64_t start_time = pid > 1 ? process_start_time(pid) : 0;
      if (start_time == 0) continue;  // gone, or not visible here (the bypass audit says so)
      std::string tenant;
      if (auto it = owners.find(pid); it != owners.end())
        tenant = it->second;
      else
        tenant = attribute_process(pid, owners, run_dir);
      if (!tenant.empty()) by_tenant[tenant].push_back({p, start_time});
    }
    for (const TenantQuota& q : quotas) {
      if (q.gpu_uuid != gpu.uuid) continue;
      std::vector<Held>& mine = by_tenant[q.tenant];
      uint64_t used = 0;
      for (const Held& h : mine) used += h.p.used_bytes;
      const uint64_t allowed = q.quota + settings.tolerance_per_process * mine.size();
      const auto key = std::make_pair(q.tenant, gpu.uuid);
      if (used <= allowed) continue;
      over_now.insert(key);
      Over& o = over_[key];
      MemoryOveruse& r = o.report;
      r.tenant = q.tenant;
      r.gpu_index = gpu.index;
      r.gpu_uuid = gpu.uuid;
      r.quota = q.quota;
      r.allowed = allowed;
      r.used = used;
      r.processes = static_cast<uint32_t>(mine.size());
      if (o.since_ns == 0) {
        o.since_ns = now;
        r.since_unix = static_cast<uint64_t>(time(nullptr));
        r.action = "over (within grace)";
        log_.warn("memory audit: tenant \"{}\" holds {} on GPU {} ({}) by the driver's count, over its quota {} "
                  "plus tolerance ({} allowed for {} process(es)); acting ({}) if it lasts {} ms",
                  q.tenant, format_size(used), gpu.index, gpu.uuid, format_size(q.quota), format_size(allowed),
                  mine.size(), memory_audit_action_name(settings.action), settings.grace.count() / 1000);
        continue;
      }
      if (now - o.since_ns < grace_ns) continue;
      if (settings.action == MemoryAuditAction::kReport) {
        if (r.action != "reported")
          log_.warn("memory audit: tenant \"{}\" still over on GPU {}: {} held, {} allowed: reported", q.tenant,
                    gpu.uuid, format_size(used), format_size(allowed));
        r.action = "reported";
        continue;
      }
      // Largest first, until what is left fits. The PID must still name the
      // process attributed above (same start time) when it is signalled.
      std::sort(mine.begin(), mine.end(), [](const Held& a, const Held& b) { return a.p.used_bytes > b.p.used_bytes; });
      std::string killed;
      uint64_t left = used, allowed_left = allowed;
      for (const Held& h : mine) {
        if (left <= allowed_left) break;
        const auto pid = static_cast<int32_t>(h.p.pid);
        if (process_start_time(pid) != h.start_time) {
          log_.warn("memory audit: process {} of tenant \"{}\" exited before it could be terminated", pid, q.tenant);
          continue;
        }
        if (kill(pid, SIGKILL) != 0) {
          log_.warn("memory audit: cannot terminate process {} of tenant \"{}\": {}", pid, q.tenant, strerror(errno));
          continue;
        }
        killed += fmt::format(" {}", pid);
        left -= std::min(left, h.p.used_bytes);
        allowed_left -= std::min(allowed_left, settings.tolerance_per_process);
        log_.warn("memory audit: tenant \"{}\" over its quota on GPU {} ({} held, {} allowed): terminated process {} "
                  "(SIGKILL, {} by the driver's count)",
                  q.tenant, gpu.uuid, format_size(used), format_size(allowed), pid, format_size(h.p.used_bytes));
      }
      if (!killed.empty()) r.action = "terminated" + killed;
    }
  }
  bool changed = false;
  for (auto it = over_.begin(); it != over_.end();) {
    if (over_now.contains(it->first)) {
      ++it;
      continue;
    }
    log_.info("memory audit: tenant \"{}\" is within its quota on GPU {} again", it->first.first, it->first.second);
    it = over_.erase(it);
    changed = true;
  }
  std::vector<MemoryOveruse> now_list;
  for (const auto& [key, o] : over_) now_list.push_back(o.report);
  if (now_list.size() != overuses_.size()) changed = true;
  else
    for (size_t i = 0; i < now_list.size(); ++i)
      changed |= now_list[i].action != overuses_[i].action || now_list[i].tenant != overuses_[i].tenant;
  overuses_ = std::move(now_list);
  return changed;
}

}  // namespace fracgpu::controller

#include "daemon/memory_audit.h"

#include <signal.h>
#include <unistd.h>

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

namespace {

// Whether `pid` runs in one of the operator's node agent cgroups.
bool in_node_agent_cgroup(int32_t pid, const ProcessReader& proc, const std::vector<std::string>& agent_cgroups) {
  if (agent_cgroups.empty()) return false;
  const std::optional<KernelTies> t = proc.ties(pid);
  if (!t) return false;
  return std::any_of(agent_cgroups.begin(), agent_cgroups.end(), [&](const std::string& agent) {
    return cgroup_within(t->cgroup, agent) || cgroup_within(t->systemd_cgroup, agent);
  });
}

// How a log line names whose memory it is.
std::string holder_name(const std::string& tenant) {
  return tenant == kUnownedProcesses ? std::string("processes no tenant owns")
                                     : fmt::format("tenant \"{}\"", tenant);
}

}  // namespace

bool MemoryAuditor::check(const ProcessOwners& owners, const std::vector<TenantQuota>& quotas,
                          const MemoryAuditSettings& settings, const std::string& run_dir,
                          const std::set<std::string>& managed_gpus) {
  if (nvml_ == nullptr) return false;
  const Nvml::Api& api = nvml_->api();
  const uint64_t now = ledger::monotonic_ns();
  const uint64_t grace_ns = static_cast<uint64_t>(settings.grace.count()) * 1000;
  std::set<std::pair<std::string, std::string>> over_now;
  // For the mount-namespace rule of process_tenants: one tenant per PID is enough.
  std::map<int32_t, std::string> charged;
  for (const auto& [pid, tenants] : owners) charged.emplace(pid, *tenants.begin());
  // Where the tenants' verified processes run: read at most once per pass,
  // and only once a process with no slot is seen (most passes see none).
  const ProcReader proc(run_dir);
  std::optional<TenantContainers> containers;
  const std::string unowned(kUnownedProcesses);
  const auto self = static_cast<int32_t>(getpid());
  held_.clear();
  read_.clear();
  for (const DiscoveredGpu& gpu : gpus_) {
    // Every GPU, granted or not: on a GPU a tenant has no grant on, its quota is 0.
    std::map<std::string, uint64_t> quota_here;
    for (const TenantQuota& q : quotas)
      if (q.gpu_uuid == gpu.uuid) quota_here[q.tenant] = q.quota;
    nvmlDevice_t handle = nullptr;
    std::vector<Nvml::Process> processes;
    if (api.get_handle_by_uuid(gpu.uuid.c_str(), &handle) != NVML_SUCCESS ||  // health reports it
        nvml_->compute_processes(handle, &processes) != NVML_SUCCESS)
      continue;
    read_.insert(gpu.uuid);
    for (const Nvml::Process& p : processes) {
      if (p.used_known || !blind_said_.insert(gpu.uuid).second) continue;
      log_.warn("memory audit: NVML does not say how much memory process {} holds on GPU {} ({}): such processes "
                "count as holding nothing there, so the audit cannot stop a tenant that holds more than its quota "
                "through them",
                p.pid, gpu.index, gpu.uuid);
    }
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
      const auto it = owners.find(pid);
      if (it == owners.end() && !containers) containers.emplace(charged, proc);
      const std::set<std::string> tenants = it != owners.end() ? it->second : containers->tenants_of(pid);
      if (tenants.empty()) {
        // Nobody's: on a GPU fracgpu manages, held with the others like it
        // to the allowance, unless it is a node agent the operator named.
        if (managed_gpus.contains(gpu.uuid) && pid != self &&
            !in_node_agent_cgroup(pid, proc, settings.node_agent_cgroups))
          by_tenant[unowned].push_back({p, start_time});
        continue;
      }
      // Tied to several tenants: counted against those with a grant here,
      // or, if none has one, against every one of them.
      std::set<std::string> granted;
      for (const std::string& t : tenants)
        if (quota_here.contains(t)) granted.insert(t);
      for (const std::string& t : granted.empty() ? tenants : granted) by_tenant[t].push_back({p, start_time});
    }
    for (auto& [tenant, mine] : by_tenant) {
      const bool nobodys = tenant == unowned;
      const auto found = quota_here.find(tenant);
      const uint64_t quota = nobodys ? settings.unowned_allowance : found == quota_here.end() ? 0 : found->second;
      uint64_t used = 0;
      for (const Held& h : mine) used += h.p.used_bytes;
      const auto key = std::make_pair(tenant, gpu.uuid);
      if (used > 0) held_[key] = used;
      if (quota == ledger::kUnlimited) continue;
      // Nobody's processes get the allowance alone: the tolerance is for a
      // tenant's contexts beyond what its quota charges.
      const uint64_t tolerance = nobodys ? 0 : settings.tolerance;
      const uint64_t allowed = quota > UINT64_MAX - tolerance ? UINT64_MAX : quota + tolerance;
      if (used <= allowed) continue;
      over_now.insert(key);
      Over& o = over_[key];
      MemoryOveruse& r = o.report;
      r.tenant = tenant;
      r.gpu_index = gpu.index;
      r.gpu_uuid = gpu.uuid;
      r.quota = quota;
      r.allowed = allowed;
      r.used = used;
      r.processes = static_cast<uint32_t>(mine.size());
      if (o.since_ns == 0) {
        o.since_ns = now;
        r.since_unix = static_cast<uint64_t>(time(nullptr));
        r.action = "over (within grace)";
        if (nobodys)
          log_.warn("memory audit: processes no tenant owns hold {} on GPU {} ({}) by the driver's count in {} "
                    "process(es), over their allowance ({}: unowned_memory_allowance); acting ({}) if it lasts {} ms",
                    format_size(used), gpu.index, gpu.uuid, mine.size(), format_size(allowed),
                    memory_audit_action_name(settings.action), settings.grace.count() / 1000);
        else
          log_.warn("memory audit: tenant \"{}\" holds {} on GPU {} ({}) by the driver's count in {} process(es), "
                    "over {} ({} allowed: quota {} plus the tolerance); acting ({}) if it lasts {} ms",
                    tenant, format_size(used), gpu.index, gpu.uuid, mine.size(),
                    found == quota_here.end() ? "a GPU it has no grant on" : "its quota", format_size(allowed),
                    format_size(quota), memory_audit_action_name(settings.action), settings.grace.count() / 1000);
        continue;
      }
      if (now - o.since_ns < grace_ns) continue;
      if (settings.action == MemoryAuditAction::kReport) {
        if (r.action != "reported")
          log_.warn("memory audit: {} still over on GPU {}: {} held, {} allowed: reported", holder_name(tenant),
                    gpu.uuid, format_size(used), format_size(allowed));
        r.action = "reported";
        continue;
      }
      // Largest first, until what is left fits. The PID must still name the
      // process attributed above (same start time) when it is signalled.
      std::sort(mine.begin(), mine.end(), [](const Held& a, const Held& b) { return a.p.used_bytes > b.p.used_bytes; });
      std::string killed;
      uint64_t left = used;
      for (const Held& h : mine) {
        if (left <= allowed) break;
        const auto pid = static_cast<int32_t>(h.p.pid);
        if (process_start_time(pid) != h.start_time) {
          log_.warn("memory audit: process {} ({}) exited before it could be terminated", pid, holder_name(tenant));
          continue;
        }
        if (kill(pid, SIGKILL) != 0) {
          log_.warn("memory audit: cannot terminate process {} ({}): {}", pid, holder_name(tenant), strerror(errno));
          continue;
        }
        killed += fmt::format(" {}", pid);
        left -= std::min(left, h.p.used_bytes);
        log_.warn("memory audit: {} over {} on GPU {} ({} held, {} allowed): terminated process {} "
                  "(SIGKILL, {} by the driver's count)",
                  holder_name(tenant), nobodys ? "their allowance" : "its quota", gpu.uuid, format_size(used),
                  format_size(allowed), pid, format_size(h.p.used_bytes));
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
    log_.info("memory audit: {} {} within {} on GPU {} again", holder_name(it->first.first),
              it->first.first == unowned ? "are" : "is", it->first.first == unowned ? "their allowance" : "its quota",
              it->first.second);
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

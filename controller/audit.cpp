#include "audit.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace fracgpu::controller {
namespace {

std::string read_proc(int32_t pid, const char* what) {
  std::ifstream in(fmt::format("/proc/{}/{}", pid, what), std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// Field 22 of /proc/<pid>/stat (clock ticks after boot); 0 if the process is gone.
uint64_t start_time(int32_t pid) {
  const std::string stat = read_proc(pid, "stat");
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i)
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  return 0;
}

}  // namespace

std::optional<AuditAction> parse_audit_action(std::string_view text) {
  if (text == "report") return AuditAction::kReport;
  if (text == "deny") return AuditAction::kDeny;
  if (text == "terminate") return AuditAction::kTerminate;
  return std::nullopt;
}

const char* audit_action_name(AuditAction action) {
  switch (action) {
    case AuditAction::kReport: return "report";
    case AuditAction::kDeny: return "deny";
    case AuditAction::kTerminate: return "terminate";
  }
  return "?";
}

std::string tenant_of_process(int32_t pid, const std::string& run_dir) {
  const std::string environ = read_proc(pid, "environ");
  const std::string tenants = run_dir + "/tenants/";
  std::string tenant;
  size_t start = 0;
  while (start < environ.size()) {
    size_t end = environ.find('\0', start);
    if (end == std::string::npos) end = environ.size();
    const std::string_view var(environ.data() + start, end - start);
    if (var.starts_with("FRACGPU_TENANT=")) {
      tenant = std::string(var.substr(15));
    } else if (var.starts_with("FRACGPU_TENANT_DIR=") && tenant.empty()) {
      std::string_view dir = var.substr(19);
      while (dir.ends_with('/')) dir.remove_suffix(1);
      if (dir.starts_with(tenants) && dir.find('/', tenants.size()) == std::string_view::npos)
        tenant = std::string(dir.substr(tenants.size()));
    }
    start = end + 1;
  }
  return tenant;
}

Auditor::Auditor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log)
    : nvml_(nvml), log_(log), gpus_(gpus) {}

bool Auditor::audit(const std::set<int32_t>& charged, AuditAction action, const std::string& run_dir) {
  if (nvml_ == nullptr) return false;
  const Nvml::Api& api = nvml_->api();
  const int32_t self = static_cast<int32_t>(getpid());
  std::set<std::pair<int32_t, std::string>> present;
  std::set<int32_t> invisible;
  for (const DiscoveredGpu& gpu : gpus_) {
    nvmlDevice_t handle = nullptr;
    if (api.get_handle_by_uuid(gpu.uuid.c_str(), &handle) != NVML_SUCCESS) continue;  // health reports it
    std::vector<Nvml::Process> processes;
    if (nvmlReturn_t rc = nvml_->compute_processes(handle, &processes); rc != NVML_SUCCESS) {
      log_.debug("audit: GPU {} ({}): no process list: {}", gpu.index, gpu.uuid, nvml_->describe(rc));
      continue;
    }
    for (const Nvml::Process& p : processes) {
      const auto pid = static_cast<int32_t>(p.pid);
      if (pid <= 1 || pid == self || charged.contains(pid)) continue;
      const uint64_t started = start_time(pid);
      if (started == 0) {
        // Already gone, or in a PID namespace we cannot see. Listed again in
        // the next pass: not an exit race; say once that such processes are
        // not audited (fracgpud without the host's PID namespace).
        invisible.insert(pid);
        if (invisible_before_.contains(pid) && !warned_invisible_) {
          warned_invisible_ = true;
          log_.warn("audit: NVML lists process {} on GPU {} ({}) but /proc has no such process: fracgpud does not "
                    "see the host's PIDs (in Kubernetes: hostPID: true), and processes it cannot see are not "
                    "audited (logged once)",
                    pid, gpu.index, gpu.uuid);
        }
        continue;
      }
      const auto key = std::make_pair(pid, gpu.uuid);
      present.insert(key);
      Seen& s = seen_[key];
      if (s.start_time != started) s = Seen{started, 0, {}, false};  // a new process behind a reused PID
      ++s.passes;
      AuditFinding& f = s.finding;
      f.bytes = p.used_bytes;
      if (s.passes != 2) continue;
      // Second pass in a row uncharged: a finding, logged once.
      f.gpu_index = gpu.index;
      f.gpu_uuid = gpu.uuid;
      f.pid = pid;
      f.comm = read_proc(pid, "comm");
      while (!f.comm.empty() && f.comm.back() == '\n') f.comm.pop_back();
      f.tenant = tenant_of_process(pid, run_dir);
      f.first_seen_unix = static_cast<uint64_t>(time(nullptr));
      f.action = "reported";
      const std::string who = f.tenant.empty() ? std::string("tenant unknown") : fmt::format("tenant \"{}\"", f.tenant);
      if (action == AuditAction::kDeny)
        f.action = f.tenant.empty() ? "reported (deny: tenant unknown)" : "tenant denied";
      if (action == AuditAction::kTerminate) {
        // Checked again just before: the PID must still name the process we saw.
        if (start_time(pid) != started) {
          f.action = "not terminated: the process exited (or its PID was reused) before the signal";
        } else if (kill(pid, SIGKILL) == 0) {
          f.action = "terminated (SIGKILL)";
          s.terminated = true;
        } else {
          f.action = fmt::format("terminate failed: {}", strerror(errno));
        }
      }
      log_.warn("audit: process {} ({}, {}) uses {} bytes on GPU {} ({}) without being charged to any tenant "
                "(no interposer, or no tenant): {}",
                pid, f.comm, who, f.bytes, gpu.index, gpu.uuid, f.action);
    }
  }
  // Forget processes no longer listed (gone, or now charged).
  bool changed = false;
  for (auto it = seen_.begin(); it != seen_.end();) {
    if (present.contains(it->first)) {
      ++it;
      continue;
    }
    if (it->second.passes >= 2) {
      log_.info("audit: process {} no longer uses GPU {} uncharged", it->first.first, it->first.second);
      changed = true;
    }
    it = seen_.erase(it);
  }
  invisible_before_ = std::move(invisible);
  std::vector<AuditFinding> now;
  for (const auto& [key, s] : seen_)
    if (s.passes >= 2) now.push_back(s.finding);
  if (now.size() != findings_.size()) changed = true;
  else
    for (size_t i = 0; i < now.size(); ++i)
      if (now[i].pid != findings_[i].pid || now[i].gpu_uuid != findings_[i].gpu_uuid) changed = true;
  findings_ = std::move(now);
  return changed;
}

}  // namespace fracgpu::controller

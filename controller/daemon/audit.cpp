#include "daemon/audit.h"

#include <fcntl.h>
#include <linux/nsfs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>

#include "common/text_escape.h"
#include "ledger.h"  // shm/: which GPUs a mounted tenant holds

namespace fracgpu::controller {
namespace fs = std::filesystem;
namespace {

// What the audits read of /proc is the processes' to shape: a process can
// point its environment at a terabyte of address space (prctl
// PR_SET_MM_MAP needs no privilege) or, in a user namespace of its own,
// mount until its mountinfo runs to hundreds of megabytes. So every read
// stops at a bound well above what any real process shows.
constexpr size_t kProcSmallBytes = 64 << 10;   // status, cgroup, comm
constexpr size_t kEnvironBytes = 1 << 20;      // environ: a claim's variables are looked for in this much
constexpr size_t kMountinfoBytes = 4 << 20;    // tens of thousands of mounts

// At most `limit` bytes of `path`; `*cut` says whether there was more.
std::string read_proc_text(const std::string& path, size_t limit, bool* cut = nullptr) {
  std::string out;
  if (cut != nullptr) *cut = false;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buffer[16 << 10];
  for (;;) {
    const ssize_t n = read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    const size_t room = limit - out.size();
    out.append(buffer, std::min(static_cast<size_t>(n), room));
    if (static_cast<size_t>(n) >= room) {
      if (cut != nullptr) *cut = static_cast<size_t>(n) > room || read(fd, buffer, 1) > 0;
      break;
    }
  }
  close(fd);
  return out;
}

std::string read_proc(int32_t pid, const char* what, size_t limit = kProcSmallBytes) {
  return read_proc_text(fmt::format("/proc/{}/{}", pid, what), limit);
}

}  // namespace

uint64_t process_start_time(int32_t pid) {
  ledger::ProcessIdentity identity{};
  return ledger::read_process_identity(pid, &identity) ? identity.start_time : 0;
}

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

std::string mount_namespace_of(int32_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/ns/mnt", pid);
  char link[128];
  const ssize_t n = readlink(path, link, sizeof link - 1);
  if (n <= 0) return {};
  return std::string(link, static_cast<size_t>(n));
}

namespace {

// One line of /proc/<pid>/mountinfo: the device ("maj:min"), the path of the
// mount's root within that filesystem, and where it is mounted.
struct MountEntry {
  std::string device, root, mount_point;
};

// mountinfo writes space, tab, newline and backslash as \ooo octal.
std::string unescape_mount_path(std::string_view text) {
  const auto octal = [](char c) { return c >= '0' && c <= '7'; };
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 3 < text.size() && octal(text[i + 1]) && octal(text[i + 2]) && octal(text[i + 3])) {
      out += static_cast<char>((text[i + 1] - '0') * 64 + (text[i + 2] - '0') * 8 + (text[i + 3] - '0'));
      i += 3;
      continue;
    }
    out += text[i];
  }
  return out;
}

std::vector<MountEntry> read_mountinfo(const std::string& pid) {
  std::vector<MountEntry> entries;
  bool cut = false;
  std::string text = read_proc_text("/proc/" + pid + "/mountinfo", kMountinfoBytes, &cut);
  if (cut) text.erase(text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1);  // no half line
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, mount_point;
    if (!(fields >> id >> parent >> device >> root >> mount_point)) continue;
    entries.push_back({device, unescape_mount_path(root), unescape_mount_path(mount_point)});
  }
  return entries;
}

}  // namespace

std::set<std::string> tenants_mounted_in(const std::string& pid, const std::string& run_dir) {
  std::set<std::string> tenants;
  // Where <run_dir>/tenants lives: the daemon's own mount that holds it,
  // and the directory's path within that filesystem.
  std::error_code ec;
  const std::string dir = fs::weakly_canonical(fs::path(run_dir) / "tenants", ec).string();
  if (ec) return tenants;
  const MountEntry* holder = nullptr;
  const std::vector<MountEntry> own = read_mountinfo("self");
  for (const MountEntry& m : own) {
    const bool under = m.mount_point == "/" || dir == m.mount_point || dir.starts_with(m.mount_point + "/");
    if (under && (holder == nullptr || m.mount_point.size() >= holder->mount_point.size())) holder = &m;
  }
  if (holder == nullptr) return tenants;
  std::string inside = holder->root;
  const std::string rest = holder->mount_point == "/" ? dir : dir.substr(holder->mount_point.size());
  inside = (inside == "/" ? "" : inside) + rest;  // "<root>/<rest>"
  for (const MountEntry& m : read_mountinfo(pid)) {
    if (m.device != holder->device || !m.root.starts_with(inside + "/")) continue;
    const std::string name = m.root.substr(inside.size() + 1, m.root.find('/', inside.size() + 1) - inside.size() - 1);
    if (!name.empty()) tenants.insert(name);
  }
  return tenants;
}

namespace {

// Of `tenants`, those whose policy (read-only) has an entry for the GPU `uuid`.
std::set<std::string> tenants_holding_gpu(const std::set<std::string>& tenants, const std::string& run_dir,
                                          const std::string& uuid) {
  std::set<std::string> holding;
  uint8_t bytes[16];
  if (!ledger::parse_gpu_uuid_text(uuid, bytes)) return holding;
  for (const std::string& name : tenants) {
    const std::string dir = run_dir + "/tenants/" + name;
    ledger::TenantLedger l;
    char err[256] = {};
    if (ledger::open_ledger(dir.c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err, sizeof err) !=
        ledger::LedgerError::kOk)
      continue;
    if (ledger::find_gpu(l, bytes) >= 0) holding.insert(name);
    ledger::close_ledger(&l);
  }
  return holding;
}

}  // namespace

std::string cgroup_path_in(std::string_view proc_cgroup, std::string_view controllers) {
  // Each line: "<hierarchy id>:<controllers>:<path>"; the path may hold ':'.
  size_t start = 0;
  while (start < proc_cgroup.size()) {
    size_t end = proc_cgroup.find('\n', start);
    if (end == std::string_view::npos) end = proc_cgroup.size();
    const std::string_view line = proc_cgroup.substr(start, end - start);
    start = end + 1;
    const size_t first = line.find(':');
    const size_t second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    if (line.substr(first + 1, second - first - 1) != controllers) continue;
    // cgroup v2's line is the one of hierarchy 0 and no controllers.
    if (controllers.empty() && line.substr(0, first) != "0") continue;
    return std::string(line.substr(second + 1));
  }
  return {};
}

int32_t parent_pid_in(std::string_view proc_status) {
  const size_t at = proc_status.starts_with("PPid:") ? 0 : proc_status.find("\nPPid:");
  if (at == std::string_view::npos) return 0;
  const size_t value = proc_status.find_first_not_of(" \t", at + (at == 0 ? 5 : 6));
  if (value == std::string_view::npos) return 0;
  return static_cast<int32_t>(std::strtol(std::string(proc_status.substr(value, 12)).c_str(), nullptr, 10));
}

bool cgroup_within(std::string_view path, std::string_view prefix) {
  if (path.empty() || prefix.empty()) return false;
  if (prefix == "/") return path.starts_with('/');
  return path == prefix || (path.starts_with(prefix) && path[prefix.size()] == '/');
}

namespace {

// The inode of the namespace `fd` refers to; 0 if unreadable.
uint64_t namespace_inode(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// The PID namespace of `pid`, then each parent (NS_GET_PARENT), up to
// `stop` (the daemon's own, not included). Empty unless the chain reaches
// `stop`: a namespace the daemon's is not an ancestor of (the daemon not in
// the host's) ties nothing. PID namespaces nest at most 32 deep.
std::vector<uint64_t> pid_namespace_chain(const std::string& pid, uint64_t stop) {
  std::vector<uint64_t> chain;
  bool reached = false;
  int fd = open(("/proc/" + pid + "/ns/pid").c_str(), O_RDONLY | O_CLOEXEC);
  while (fd >= 0 && chain.size() < 33) {
    const uint64_t inode = namespace_inode(fd);
    if (inode == 0) break;
    if (inode == stop) {
      reached = true;
      break;
    }
    chain.push_back(inode);
    const int parent = ioctl(fd, NS_GET_PARENT);
    close(fd);
    fd = parent;
  }
  if (fd >= 0) close(fd);
  if (!reached) chain.clear();
  return chain;
}

uint64_t own_pid_namespace() {
  static const uint64_t inode = [] {
    const int fd = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    const uint64_t found = fd >= 0 ? namespace_inode(fd) : 0;
    if (fd >= 0) close(fd);
    return found;
  }();
  return inode;
}

}  // namespace

int32_t ProcReader::self() const { return static_cast<int32_t>(getpid()); }

std::optional<KernelTies> ProcReader::ties(int32_t pid) const {
  const std::string status = read_proc(pid, "status");
  if (status.empty()) return std::nullopt;
  KernelTies t;
  t.parent = parent_pid_in(status);
  const std::string cgroups = read_proc(pid, "cgroup");
  t.cgroup = cgroup_path_in(cgroups, "");
  t.systemd_cgroup = cgroup_path_in(cgroups, "name=systemd");
  t.mount_ns = mount_namespace_of(pid);
  t.pid_namespaces = pid_namespace_chain(std::to_string(pid), own_pid_namespace());
  return t;
}

std::set<std::string> ProcReader::mounted_tenants(int32_t pid) const {
  return tenants_mounted_in(std::to_string(pid), run_dir_);
}

TenantContainers::TenantContainers(const std::map<int32_t, std::string>& charged, const ProcessReader& proc)
    : charged_(charged),
      proc_(proc),
      daemon_(proc.ties(proc.self()).value_or(KernelTies{})),
      init_mount_ns_(proc.ties(1).value_or(KernelTies{}).mount_ns) {
  // A cgroup names a container only if it is neither the daemon's nor above
  // it (the root cgroup, a slice holding the daemon too).
  const auto names_a_container = [](const std::string& path, const std::string& daemons) {
    return !path.empty() && !daemons.empty() && !cgroup_within(daemons, path);
  };
  for (const auto& [pid, tenant] : charged) {
    const std::optional<KernelTies> t = proc.ties(pid);
    if (!t) continue;
    const bool own_mounts = !t->mount_ns.empty() && t->mount_ns != daemon_.mount_ns && t->mount_ns != init_mount_ns_;
    const bool own_pids = !t->pid_namespaces.empty();
    if (!own_mounts && !own_pids) continue;  // on the host: ties only its descendants (tenants_of)
    if (own_mounts) mount_namespaces_[t->mount_ns].insert(tenant);
    if (own_pids) pid_namespaces_[t->pid_namespaces.front()].insert(tenant);
    if (names_a_container(t->cgroup, daemon_.cgroup)) cgroups_.emplace_back(t->cgroup, tenant);
    if (names_a_container(t->systemd_cgroup, daemon_.systemd_cgroup))
      systemd_cgroups_.emplace_back(t->systemd_cgroup, tenant);
  }
}

std::set<std::string> TenantContainers::tenants_of(int32_t pid) const {
  const std::optional<KernelTies> t = proc_.ties(pid);
  if (!t) return {};
  std::set<std::string> found = proc_.mounted_tenants(pid);
  for (const auto& [cgroup, tenant] : cgroups_)
    if (cgroup_within(t->cgroup, cgroup)) found.insert(tenant);
  for (const auto& [cgroup, tenant] : systemd_cgroups_)
    if (cgroup_within(t->systemd_cgroup, cgroup)) found.insert(tenant);
  for (const uint64_t ns : t->pid_namespaces)
    if (const auto it = pid_namespaces_.find(ns); it != pid_namespaces_.end()) found.insert(it->second.begin(), it->second.end());
  if (const auto it = mount_namespaces_.find(t->mount_ns); it != mount_namespaces_.end())
    found.insert(it->second.begin(), it->second.end());
  // The nearest ancestor that is a tenant's: a process's parent is whoever
  // forked it (or the subreaper that adopted it, itself an ancestor), never
  // something the process picks. Bounded: a chain is never this long.
  int32_t ancestor = t->parent;
  for (int hops = 0; hops < 64 && ancestor > 1 && ancestor != proc_.self(); ++hops) {
    if (const auto it = charged_.find(ancestor); it != charged_.end()) {
      found.insert(it->second);
      break;
    }
    if (std::set<std::string> mounted = proc_.mounted_tenants(ancestor); !mounted.empty()) {
      found.insert(mounted.begin(), mounted.end());
      break;
    }
    const std::optional<KernelTies> up = proc_.ties(ancestor);
    if (!up) break;
    ancestor = up->parent;
  }
  return found;
}

std::string attribute_process(int32_t pid, const std::map<int32_t, std::string>& charged, const std::string& run_dir,
                              const std::string& gpu_uuid) {
  std::set<std::string> tenants = process_tenants(pid, charged, run_dir);
  // A container with several claims has several tenants (docs/kubernetes.md):
  // on a GPU, its process is the one's among them whose policy holds that GPU.
  if (tenants.size() > 1 && !gpu_uuid.empty()) tenants = tenants_holding_gpu(tenants, run_dir, gpu_uuid);
  return tenants.size() == 1 ? *tenants.begin() : std::string();
}

std::set<std::string> attribute_process_on_gpu(int32_t pid, const std::map<int32_t, std::string>& charged,
                                               const std::string& run_dir, const std::string& gpu_uuid) {
  const ProcReader proc(run_dir);
  return attribute_process_on_gpu(pid, TenantContainers(charged, proc), run_dir, gpu_uuid);
}

std::set<std::string> attribute_process_on_gpu(int32_t pid, const TenantContainers& containers,
                                               const std::string& run_dir, const std::string& gpu_uuid) {
  std::set<std::string> tenants = containers.tenants_of(pid);
  return tenants.size() > 1 ? tenants_holding_gpu(tenants, run_dir, gpu_uuid) : tenants;
}

std::set<std::string> process_tenants(int32_t pid, const std::map<int32_t, std::string>& charged,
                                      const std::string& run_dir) {
  const ProcReader proc(run_dir);
  return TenantContainers(charged, proc).tenants_of(pid);
}

std::string claimed_tenant_of_process(int32_t pid, const std::string& run_dir) {
  const std::string environ = read_proc(pid, "environ", kEnvironBytes);
  const std::string tenants = run_dir + "/tenants/";
  std::string tenant;
  size_t start = 0;
  while (start < environ.size()) {
    size_t end = environ.find('\0', start);
    if (end == std::string::npos) end = environ.size();
    const std::string_view var(environ.data() + start, end - start);
    if (var.starts_with("FRACGPU_TENANT=")) {
      tenant = std::string(var.substr(15, 64));
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

bool Auditor::audit(const std::map<int32_t, std::string>& charged, AuditAction action, const std::string& run_dir) {
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
      const uint64_t started = process_start_time(pid);
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
      f.tenant = attribute_process(pid, charged, run_dir, gpu.uuid);
      f.claimed = claimed_tenant_of_process(pid, run_dir);
      f.first_seen_unix = static_cast<uint64_t>(time(nullptr));
      f.action = "reported";
      std::string who = f.tenant.empty() ? std::string("tenant unknown") : fmt::format("tenant \"{}\"", f.tenant);
      if (f.tenant.empty() && !f.claimed.empty())
        who += fmt::format(", claims \"{}\" (unverified)", escape_terminal(f.claimed));
      if (action == AuditAction::kDeny)
        f.action = f.tenant.empty() ? "reported (deny: tenant unknown)" : "tenant denied";
      if (action == AuditAction::kTerminate) {
        // Checked again just before: the PID must still name the process we saw.
        if (process_start_time(pid) != started) {
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
                pid, escape_terminal(f.comm), who, f.bytes, gpu.index, gpu.uuid, f.action);
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

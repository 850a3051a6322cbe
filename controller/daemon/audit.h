// The bypass audit (docs/operations.md): fracgpud compares the processes NVML
// lists on each GPU with the processes attached to a tenant ledger, and
// reports those that hold GPU memory without being charged anywhere: no
// interposer (statically linked CUDA, a stripped LD_PRELOAD), or an
// interposer without a tenant. It does not compare amounts (the memory audit,
// memory_audit.h, does). What follows a finding is [daemon] audit_action:
// report (default), deny, or terminate.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <spdlog/logger.h>

#include "common/gpu_discovery.h"
#include "common/nvml.h"

namespace fracgpu::controller {

enum class AuditAction { kReport, kDeny, kTerminate };
std::optional<AuditAction> parse_audit_action(std::string_view text);
const char* audit_action_name(AuditAction action);
inline constexpr std::string_view kAuditActionList = "report, deny, terminate";

struct AuditFinding {
  int gpu_index = 0;
  std::string gpu_uuid;
  int32_t pid = 0;         // host PID, as NVML reports it
  uint64_t bytes = 0;      // GPU memory NVML says it holds
  std::string comm;        // /proc/<pid>/comm
  std::string tenant;      // the tenant it belongs to, as the kernel shows it (attribute_process); empty: unknown
  std::string claimed;     // the tenant its environment names (FRACGPU_TENANT / _DIR): display only, never acted on
  std::string action;      // what was done: "reported", "tenant denied", "terminated (SIGKILL)", ...
  uint64_t first_seen_unix = 0;
};

class Auditor {
 public:
  // `nvml` may be null: then audit() finds nothing.
  Auditor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log);

  // One pass. `charged`: host PIDs owning a live slot in some tenant ledger,
  // with their tenant, as the daemon verified them (never as a tenant wrote them).
  // A process is a finding once it has been seen uncharged in two passes in
  // a row (a process between its first allocation and its attach, or just
  // exiting, is not one). With kTerminate the finding is SIGKILLed (after
  // checking its start time, so a reused PID is never hit). Each finding is
  // logged once. Returns true if the findings changed.
  bool audit(const std::map<int32_t, std::string>& charged, AuditAction action, const std::string& run_dir);
  const std::vector<AuditFinding>& findings() const { return findings_; }

 private:
  struct Seen {
    uint64_t start_time = 0;  // /proc/<pid>/stat field 22: (pid, start) names one process
    int passes = 0;
    AuditFinding finding;
    bool terminated = false;
  };
  Nvml* nvml_;
  spdlog::logger& log_;
  std::vector<DiscoveredGpu> gpus_;
  std::map<std::pair<int32_t, std::string>, Seen> seen_;  // (pid, GPU uuid)
  std::set<int32_t> invisible_before_;  // listed by NVML, absent from /proc, last pass
  bool warned_invisible_ = false;
  std::vector<AuditFinding> findings_;
};

// The tenant a process names in its environment (FRACGPU_TENANT, or
// FRACGPU_TENANT_DIR under <run_dir>/tenants/); empty if none or unreadable.
// The process wrote that itself: a claim, shown to the operator, never acted on.
std::string claimed_tenant_of_process(int32_t pid, const std::string& run_dir);

// What the kernel says about a process that ties it to a container. None of
// it can be changed by the process itself: a process can enter new
// namespaces (unshare -U -r -m, pivot_root), but it keeps its cgroup (it may
// only move within a subtree delegated to it), its PID namespace stays a
// descendant of the one it left, and its parent chain stays its own.
struct KernelTies {
  std::string cgroup;          // its cgroup v2 path ("0::" line of /proc/<pid>/cgroup); empty: none
  std::string systemd_cgroup;  // its cgroup v1 "name=systemd" path, where v2 tracks nothing; empty: none
  std::string mount_ns;        // /proc/<pid>/ns/mnt's link text; empty: unreadable
  // Its PID namespace's inode, then its parent's, and so on, stopping before
  // the daemon's own (or where the kernel lets the daemon see no further).
  std::vector<uint64_t> pid_namespaces;
  int32_t parent = 0;  // PPid of /proc/<pid>/status; 0: none or unreadable
};

// Where attribution reads what the kernel says: /proc (ProcReader), or, in
// tests, fabricated processes.
class ProcessReader {
 public:
  virtual ~ProcessReader() = default;
  virtual int32_t self() const = 0;  // the daemon's own PID
  // nullopt: the process is gone, or not visible here.
  virtual std::optional<KernelTies> ties(int32_t pid) const = 0;
  // Tenants whose directory is mounted into its mount namespace (tenants_mounted_in).
  virtual std::set<std::string> mounted_tenants(int32_t pid) const = 0;
};

// The live system's /proc, for the tenant directories under `run_dir`.
class ProcReader : public ProcessReader {
 public:
  explicit ProcReader(std::string run_dir) : run_dir_(std::move(run_dir)) {}
  int32_t self() const override;
  std::optional<KernelTies> ties(int32_t pid) const override;
  std::set<std::string> mounted_tenants(int32_t pid) const override;

 private:
  std::string run_dir_;
};

// Where each tenant's verified processes (`charged`: host PID -> tenant, as
// the daemon found them) run, by the kernel's account, and so which tenants
// an uncharged process belongs to. Built once per audit pass: it reads each
// verified process once.
//
// A verified process in the daemon's own PID namespace and in its mount
// namespace or PID 1's is on the host, not in a container: its cgroup (a login session, a system service)
// is shared with processes of nobody's, so it ties nothing but its own
// descendants. A cgroup that holds the daemon itself, or is above it, ties
// nothing either.
class TenantContainers {
 public:
  TenantContainers(const std::map<int32_t, std::string>& charged, const ProcessReader& proc);

  // Every tenant `pid` is tied to, by any of (each one the process cannot
  // undo; a tenant can never make another tenant's process look like its own):
  //  - a tenant directory mounted into its mount namespace;
  //  - its cgroup: at or beneath the cgroup of a tenant's verified process in
  //    a container (matched by that cgroup as a prefix, never the reverse: a
  //    tenant may create sub-cgroups beneath its own, never above);
  //  - its PID namespace: that of a tenant's containerized verified process,
  //    or a descendant of it;
  //  - its mount namespace: shared with a tenant's verified process outside
  //    the daemon's own and PID 1's;
  //  - its parent chain: the nearest ancestor that is a tenant's verified
  //    process or has a tenant directory mounted.
  // Several tenants: one container with several claims. Empty: nobody's.
  std::set<std::string> tenants_of(int32_t pid) const;

 private:
  const std::map<int32_t, std::string>& charged_;
  const ProcessReader& proc_;
  KernelTies daemon_;
  // PID 1's mount namespace: the host's where the daemon sees the host's
  // PIDs. A daemon under systemd's sandboxing (PrivateTmp, ProtectSystem)
  // runs in a mount namespace of its own, and a process in the host's is no
  // more in a container than one in the daemon's.
  std::string init_mount_ns_;
  std::vector<std::pair<std::string, std::string>> cgroups_;          // (cgroup v2 path, tenant)
  std::vector<std::pair<std::string, std::string>> systemd_cgroups_;  // (v1 name=systemd path, tenant)
  std::map<uint64_t, std::set<std::string>> pid_namespaces_;          // container PID namespace -> tenants
  std::map<std::string, std::set<std::string>> mount_namespaces_;     // container mount namespace -> tenants
};

// The tenant an uncharged process belongs to, from what the kernel says, not
// what the process says (TenantContainers::tenants_of): exactly one, else
// empty. So a process can never get another tenant denied or charged by
// naming it, nor by running beside it on the host.
// Given `gpu_uuid` (the GPU the process was seen on), of several tenants (a
// container with several claims) the one whose policy holds that GPU.
std::string attribute_process(int32_t pid, const std::map<int32_t, std::string>& charged, const std::string& run_dir,
                              const std::string& gpu_uuid = {});
// The same, every tenant it names whose policy holds the GPU `gpu_uuid`: one
// for a container with one claim there, several for a container whose
// claims share that GPU (the GPU time it uses there is theirs together).
std::set<std::string> attribute_process_on_gpu(int32_t pid, const std::map<int32_t, std::string>& charged,
                                               const std::string& run_dir, const std::string& gpu_uuid);
// The same, with where the tenants' processes run read once for many
// processes (`containers`, built from the daemon's verified processes).
std::set<std::string> attribute_process_on_gpu(int32_t pid, const TenantContainers& containers,
                                               const std::string& run_dir, const std::string& gpu_uuid);
// The same evidence, every tenant it names (TenantContainers::tenants_of
// over /proc). Empty when nothing ties it to a tenant.
std::set<std::string> process_tenants(int32_t pid, const std::map<int32_t, std::string>& charged,
                                      const std::string& run_dir);

// The parts of /proc text that attribution reads, parsed (exposed for tests).
// /proc/<pid>/cgroup: the path of the line whose controllers field is
// `controllers` ("" for cgroup v2's "0::" line, "name=systemd"); empty if none.
std::string cgroup_path_in(std::string_view proc_cgroup, std::string_view controllers);
// /proc/<pid>/status: the PPid field; 0 if absent.
int32_t parent_pid_in(std::string_view proc_status);
// Whether cgroup `path` is `prefix` or beneath it, by whole path components
// ("/a/b" is within "/a", "/ab" is not).
bool cgroup_within(std::string_view path, std::string_view prefix);

// Tenants whose directory under `run_dir` is mounted into the mount
// namespace of `pid`: what a container of that tenant is given. "self" reads the caller's.
std::set<std::string> tenants_mounted_in(const std::string& pid, const std::string& run_dir);

// Field 22 of /proc/<pid>/stat (clock ticks after boot): with the PID, names
// one process across PID reuse. 0 if the process is gone.
uint64_t process_start_time(int32_t pid);

// /proc/<pid>/ns/mnt's link text ("mnt:[4026531840]"); empty if unreadable.
std::string mount_namespace_of(int32_t pid);

}  // namespace fracgpu::controller

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

// The tenant an uncharged process belongs to, from what the kernel says, not
// what the process says. First, the one tenant whose directory
// (<run_dir>/tenants/<name>, or a file in it) is mounted into the process's
// mount namespace (/proc/<pid>/mountinfo): what a container of that tenant
// is given, and a process without CAP_SYS_ADMIN can neither add nor remove.
// Else, the one tenant whose verified processes (`charged`: host PID ->
// tenant) share its mount namespace, unless that is the daemon's own (the
// host's: processes outside containers are in no tenant's). Empty when
// neither tells exactly one tenant. So a process can never get another
// tenant denied or charged by naming it, nor by running beside it on the host.
// Given `gpu_uuid` (the GPU the process was seen on), of several tenants (a
// container with several claims) the one whose policy holds that GPU.
std::string attribute_process(int32_t pid, const std::map<int32_t, std::string>& charged, const std::string& run_dir,
                              const std::string& gpu_uuid = {});
// The same, every tenant it names whose policy holds the GPU `gpu_uuid`: one
// for a container with one claim there, several for a container whose
// claims share that GPU (the GPU time it uses there is theirs together).
std::set<std::string> attribute_process_on_gpu(int32_t pid, const std::map<int32_t, std::string>& charged,
                                               const std::string& run_dir, const std::string& gpu_uuid);
// The same evidence, every tenant it names: each tenant mounted in the
// process's container (a container with several claims has several), or
// the tenants whose verified processes share its mount namespace (one
// container: mount namespaces are never shared between containers). Empty
// when nothing ties it to a tenant.
std::set<std::string> process_tenants(int32_t pid, const std::map<int32_t, std::string>& charged,
                                      const std::string& run_dir);

// Tenants whose directory under `run_dir` is mounted into the mount
// namespace of `pid` (see attribute_process). "self" reads the caller's.
std::set<std::string> tenants_mounted_in(const std::string& pid, const std::string& run_dir);

// Field 22 of /proc/<pid>/stat (clock ticks after boot): with the PID, names
// one process across PID reuse. 0 if the process is gone.
uint64_t process_start_time(int32_t pid);

// /proc/<pid>/ns/mnt's link text ("mnt:[4026531840]"); empty if unreadable.
std::string mount_namespace_of(int32_t pid);

}  // namespace fracgpu::controller

// The bypass audit (docs/operations.md): fracgpud compares the processes NVML
// lists on each GPU with the processes attached to a tenant ledger, and
// reports those that hold GPU memory without being charged anywhere: no
// interposer (statically linked CUDA, a stripped LD_PRELOAD), or an
// interposer without a tenant. It does not compare amounts: a process
// attached to a ledger that under-reports its usage is not caught. What follows a
// finding is [daemon] audit_action: report (default), deny, or terminate.
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

#include "gpu_discovery.h"
#include "nvml.h"

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
  std::string tenant;      // from its environment (FRACGPU_TENANT / FRACGPU_TENANT_DIR); empty: unknown
  std::string action;      // what was done: "reported", "tenant denied", "terminated (SIGKILL)", ...
  uint64_t first_seen_unix = 0;
};

class Auditor {
 public:
  // `nvml` may be null: then audit() finds nothing.
  Auditor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log);

  // One pass. `charged`: host PIDs owning a live slot in some tenant ledger.
  // A process is a finding once it has been seen uncharged in two passes in
  // a row (a process between its first allocation and its attach, or just
  // exiting, is not one). With kTerminate the finding is SIGKILLed (after
  // checking its start time, so a reused PID is never hit). Each finding is
  // logged once. Returns true if the findings changed.
  bool audit(const std::set<int32_t>& charged, AuditAction action, const std::string& run_dir);
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
std::string tenant_of_process(int32_t pid, const std::string& run_dir);

}  // namespace fracgpu::controller

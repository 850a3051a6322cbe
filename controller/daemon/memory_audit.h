// The memory audit: the driver, not the tenant, is the authority on memory
// (docs/security.md).
//
// A tenant's charges live in its usage file, which the tenant's own processes
// must be able to write: a hostile tenant can zero them and allocate past its
// quota through the interposer, and nothing in the ledger would show it. So
// fracgpud also counts what NVML says each of the tenant's processes really
// holds on each GPU, and when the sum passes the tenant's quota by more than
// a tolerance for longer than a grace period, it acts: by default it kills the
// tenant's processes on that GPU, largest first, until the rest fit (the
// node's other tenants come first: they were promised that memory).
//
// Which processes are the tenant's is decided from what the kernel says, never
// from what the tenant wrote: the host PIDs the daemon itself found holding
// the record locks of the tenant's slots, and uncharged processes in the
// tenant's container (attribute_process in audit.h). A process that dropped
// its slot (closed its usage file, so its record lock went) still counts if
// the kernel ties it to the tenant's container.
#pragma once

#include <sys/types.h>

#include <chrono>
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

enum class MemoryAuditAction { kReport, kTerminate };
std::optional<MemoryAuditAction> parse_memory_audit_action(std::string_view text);
const char* memory_audit_action_name(MemoryAuditAction action);
inline constexpr std::string_view kMemoryAuditActionList = "report, terminate";

struct MemoryAuditSettings {
  // How often NVML's per-process figures are compared (`memory_audit_interval`).
  std::chrono::microseconds interval{250'000};
  // How long a tenant may stay over before the action (`memory_grace`): an
  // allocation racing a free, or a process exiting, is not an overuse.
  std::chrono::microseconds grace{1'000'000};
  // Per process, what the driver may hold beyond what fracgpu charges
  // (`memory_tolerance`): the context's real footprint past the configured
  // context_memory, allocation rounding. Not measured on a real GPU yet.
  uint64_t tolerance_per_process = 512ull << 20;
  MemoryAuditAction action = MemoryAuditAction::kTerminate;  // `memory_audit_action`
};

// One tenant's memory quota on one GPU, and its processes as the daemon knows them.
struct TenantQuota {
  std::string tenant;
  std::string gpu_uuid;
  uint64_t quota = 0;
};

// A tenant over its quota on a GPU (reported in health.json and status).
struct MemoryOveruse {
  std::string tenant;
  int gpu_index = 0;
  std::string gpu_uuid;
  uint64_t quota = 0;
  uint64_t allowed = 0;    // quota + processes x tolerance
  uint64_t used = 0;       // what NVML says the tenant's processes hold
  uint32_t processes = 0;
  uint64_t since_unix = 0;
  std::string action;      // "over (grace)", "reported", "terminated 1234 5678", ...
};

class MemoryAuditor {
 public:
  // `nvml` may be null: then check() finds nothing.
  MemoryAuditor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log);

  // One pass. `owners`: host PID -> tenant for every process the daemon
  // verified as a tenant's (its slot's record-lock holder); `quotas`: every
  // finite quota. Returns true if the overuses changed.
  bool check(const std::map<int32_t, std::string>& owners, const std::vector<TenantQuota>& quotas,
             const MemoryAuditSettings& settings, const std::string& run_dir);
  const std::vector<MemoryOveruse>& overuses() const { return overuses_; }

 private:
  struct Over {
    uint64_t since_ns = 0;
    MemoryOveruse report;
  };
  Nvml* nvml_;
  spdlog::logger& log_;
  std::vector<DiscoveredGpu> gpus_;
  std::map<std::pair<std::string, std::string>, Over> over_;  // (tenant, GPU uuid)
  std::vector<MemoryOveruse> overuses_;
};

}  // namespace fracgpu::controller

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
// The tolerance is one per tenant and GPU, never one per process: a tenant
// that runs more processes must not get more memory. Every GPU is audited,
// not only those the tenant has a grant on: on a GPU without one its quota
// is 0, so memory held there (a process without the interposer, opening a
// device it was never granted) is acted on like any other overuse.
//
// Which processes are the tenant's is decided from what the kernel says, never
// from what the tenant wrote: the host PIDs the daemon itself found holding
// the record locks of the tenant's slots, and uncharged processes in the
// tenant's container (attribute_process in audit.h). A process that dropped
// its slot (closed its usage file, so its record lock went) still counts if
// the kernel ties it to the tenant's container. A process tied to several
// tenants (a container with two claims: two slots, or two tenant mounts) is
// counted on a GPU against those of its tenants with a grant there, or, when
// none has one, against all of them: it is never left out. A process tied
// to no tenant at all, on a GPU fracgpu manages, is held with every other
// such process there to a small allowance (unowned_allowance), unless it
// runs in a node agent's cgroup.
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
  // Per tenant and GPU, what the driver may hold beyond the quota
  // (`memory_tolerance`): the real context footprint past the configured
  // context_memory, allocation rounding. Not per process: more processes buy
  // no more memory, so context_memory must be the real footprint for a
  // many-process tenant to fit. Not measured on a real GPU yet.
  uint64_t tolerance = 512ull << 20;
  MemoryAuditAction action = MemoryAuditAction::kTerminate;  // `memory_audit_action`
  // Per managed GPU, what processes no tenant owns (TenantContainers finds
  // no tie to any tenant) may hold there together (`unowned_memory_allowance`):
  // about one context, for a host tool that opens the GPU briefly. Beyond
  // it for the grace, `action` applies to them as to a tenant. Together, not
  // per process: more nobody's processes buy no more memory.
  uint64_t unowned_allowance = 512ull << 20;
  // Cgroups of node agents (monitoring, a device plugin) exempt from that
  // allowance (`node_agent_cgroups`): paths as /proc/<pid>/cgroup shows
  // them to fracgpud, cgroup v2's, or v1's name=systemd; a process at or
  // beneath one is exempt. A cgroup, not an executable path: a process can
  // put any file at any path in a mount namespace of its own, but cannot
  // leave its cgroup subtree.
  std::vector<std::string> node_agent_cgroups;
};

// The name under which processes no tenant owns are reported (overuses,
// held()): not a valid tenant name, so never confused with one.
inline constexpr std::string_view kUnownedProcesses = "(no tenant)";

// One tenant's memory quota on one GPU (ledger::kUnlimited: not audited).
// A tenant with no entry for a GPU has quota 0 there.
struct TenantQuota {
  std::string tenant;
  std::string gpu_uuid;
  uint64_t quota = 0;
};

// Host PID -> the tenants the daemon verified it as (one per slot it holds).
using ProcessOwners = std::map<int32_t, std::set<std::string>>;

// A tenant over its quota on a GPU (reported in health.json and status).
struct MemoryOveruse {
  std::string tenant;
  int gpu_index = 0;
  std::string gpu_uuid;
  uint64_t quota = 0;
  uint64_t allowed = 0;    // quota + tolerance
  uint64_t used = 0;       // what NVML says the tenant's processes hold
  uint32_t processes = 0;
  uint64_t since_unix = 0;
  std::string action;      // "over (grace)", "reported", "terminated 1234 5678", ...
};

class MemoryAuditor {
 public:
  // `nvml` may be null: then check() finds nothing.
  MemoryAuditor(Nvml* nvml, const std::vector<DiscoveredGpu>& gpus, spdlog::logger& log);

  // One pass. `owners`: every process the daemon verified as a tenant's
  // (its slots' record-lock holder); `quotas`: every grant of every tenant.
  // `managed_gpus`: the uuids of the GPUs fracgpu manages: only there are
  // processes no tenant owns held to settings.unowned_allowance.
  // Returns true if the overuses changed.
  bool check(const ProcessOwners& owners, const std::vector<TenantQuota>& quotas,
             const MemoryAuditSettings& settings, const std::string& run_dir,
             const std::set<std::string>& managed_gpus = {});
  const std::vector<MemoryOveruse>& overuses() const { return overuses_; }
  // What each tenant's processes held on each GPU at the last pass, by the
  // driver's count, (tenant, GPU uuid) -> bytes: every process attributed to
  // the tenant, with or without the interposer; pairs holding nothing are
  // absent. Absence proves nothing on a GPU the last pass did not read.
  const std::map<std::pair<std::string, std::string>, uint64_t>& held() const { return held_; }
  // Whether the last pass read the processes of GPU `uuid`.
  bool held_read(const std::string& uuid) const { return read_.contains(uuid); }

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
  std::map<std::pair<std::string, std::string>, uint64_t> held_;
  std::set<std::string> read_;  // GPU uuids the last pass read
  // GPUs on which NVML gave some process's memory as not available: said
  // once each (the audit counts such a process as holding nothing).
  std::set<std::string> blind_said_;
};

}  // namespace fracgpu::controller

// The node config (TOML): parsing, validation against the GPUs found on the
// node, and placement of fractional tenants. The result is a fully resolved
// NodeConfig, or every error found, each naming file, line and reason.
// Nothing here touches the ledgers: the daemon applies a NodeConfig only once
// it is known to be valid, so a bad config never changes anything.
// Every key is described in docs/configuration.md.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/audit.h"
#include "daemon/memory_audit.h"
#include "common/gpu_discovery.h"
#include "config/placement.h"
#include "common/units.h"
#include "common/uuid.h"

namespace fracgpu::controller {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError };

// "trace" ... "error"; nullopt for anything else.
std::optional<LogLevel> parse_log_level(std::string_view text);
inline constexpr std::string_view kLogLevelList = "trace, debug, info, warn, error";

inline constexpr uint64_t kDefaultContextMemory = 256ull << 20;
// Memory quotas derived from fractions are rounded down to this, the
// driver's large-page granularity, so a quota never promises a partial page.
inline constexpr uint64_t kQuotaGranularity = 2ull << 20;
inline constexpr int kMinReapIntervalMs = 10;
inline constexpr int kMaxReapIntervalMs = 1000;
inline constexpr std::chrono::microseconds kMinTimeSlice{2'000};
inline constexpr std::chrono::microseconds kMaxTimeSlice{200'000};
// GPU health probe and bypass audit periods (docs/operations.md).
inline constexpr std::chrono::microseconds kMinCheckInterval{10'000};
inline constexpr std::chrono::microseconds kMaxCheckInterval{3'600'000'000};
// The memory audit's grace: longer would let a tenant hold others' memory for long.
inline constexpr std::chrono::microseconds kMaxMemoryGrace{60'000'000};
// /healthz: how old the daemon's heartbeat may be (docs/operations.md).
inline constexpr std::chrono::microseconds kMinLivenessTimeout{1'000'000};
inline constexpr std::chrono::microseconds kMaxLivenessTimeout{3'600'000'000};
// Loopback only unless the operator says otherwise: the figures name tenants.
inline constexpr std::string_view kDefaultMetricsAddress = "127.0.0.1:9410";

struct DaemonSettings {
  std::string run_dir = "/run/fracgpu";
  int run_dir_line = 0;  // where the config sets run_dir; 0: not set (the default)
  LogLevel log_level = LogLevel::kInfo;
  std::chrono::milliseconds reap_interval{200};
  bool allow_overcommit = false;
  std::chrono::microseconds time_slice{20'000};  // one exclusive GPU time slice (`time_slice`, e.g. "20ms")
  // `gpu_time_charging`: "held" (default: tenants pay the time they hold
  // the GPU, one at a time, audited by NVML's samples) or "measured" (they
  // pay the GPU time NVML attributes to their processes and share the GPU
  // while it has room). docs/sm-time.md says why held is the default.
  bool gpu_time_measured = false;
  // `side_by_side` (held charging): light tenants of equal shares hold the
  // GPU together where the driver time-slices contexts, instead of taking
  // turns (docs/sm-time.md, "Side by side").
  bool side_by_side = true;
  PlacementPolicy placement = PlacementPolicy::kBundle;  // `placement`: where `gpus` without `devices` go
  // `metrics_address`: "host:port" of the Prometheus endpoint; empty: off.
  std::string metrics_address = std::string(kDefaultMetricsAddress);
  std::chrono::microseconds health_interval{5'000'000};  // `health_interval`: NVML health probe period
  std::chrono::microseconds audit_interval{10'000'000};  // `audit_interval`: NVML bypass audit period
  AuditAction audit_action = AuditAction::kReport;       // `audit_action`: report, deny, terminate
  std::chrono::microseconds liveness_timeout{30'000'000};  // `liveness_timeout`: /healthz fails past this
  MemoryAuditSettings memory_audit;  // `memory_*`: the driver's count against quotas (memory_audit.h)
  // `control_group`: a group whose members may use the control API (docs/security.md);
  // empty: root and the daemon's user only. Resolved when the config is read.
  std::string control_group;
  gid_t control_gid = 0;
  std::vector<uid_t> control_members;  // users the group file lists as members (their uids)
};

// Looks up `group` in the node's group database: sets control_group, its
// gid and the uids of the users it lists as members. False and *why (a
// phrase completing `control_group "x" ...`) if there is no such group.
bool resolve_control_group(const std::string& group, DaemonSettings* settings, std::string* why);

// A [[gpu]] that fracgpu manages, resolved against the discovery.
struct ManagedGpu {
  int index = 0;  // driver ordinal on this node
  std::string uuid;
  GpuUuid uuid_bytes{};
  std::string name;
  uint64_t memory_bytes = 0;  // quotas are computed from this: discovered, or the override
  uint64_t context_memory = kDefaultContextMemory;
  int line = 0;
};

// One GPU granted to a tenant.
struct Grant {
  size_t gpu = 0;          // index into NodeConfig::gpus
  uint32_t share_ppm = 0;  // fraction of the GPU, parts per million; 0 for memory-only grants
  // Cap on GPU time when others leave it idle, parts per million, >= share_ppm:
  // the tenant's `limit` (default: the share) on a fractional grant; 1000000 on
  // whole GPUs and memory-only grants. See docs/sm-time.md.
  uint32_t limit_ppm = kPpmPerGpu;
  uint64_t memory_quota = 0;
};

// How urgently a tenant's kernels go on its GPUs (docs/sm-time.md, "Latency
// tenants"); the values are the arbiter's (gputime::TenantPriority).
enum class Priority : uint32_t { kNormal = 0, kBatch = 1, kLatency = 2 };
inline constexpr std::string_view kPriorityList = "latency, normal, batch";

// "latency", "normal", "batch"; nullopt for anything else.
std::optional<Priority> parse_priority(std::string_view text);
std::string_view priority_name(Priority priority);
// A priority as an arbiter row stores it (TenantTime::priority): the file
// may be stale or damaged, so any value but batch or latency is normal, as
// the scheduler itself reads it (gputime::priority_rank).
Priority priority_of_stored(uint32_t value);

// Where a tenant was defined.
enum class TenantSource {
  kConfig,  // a [[tenant]] of the node config
  kApi,     // created through the control API (api_tenant.h); persisted in the run dir
};

using Annotations = std::map<std::string, std::string, std::less<>>;

struct Tenant {
  std::string name;
  bool count_managed = true;
  uint64_t gpus_ppm = 0;      // `gpus` in parts per million; 0 when not given
  std::vector<Grant> grants;  // placement order; at most one per GPU
  PlacementReason placement = PlacementReason::kMemoryOnly;  // why the grants are where they are
  int line = 0;               // 0 for API tenants
  TenantSource source = TenantSource::kConfig;
  // API tenants only: deleted while processes were alive. New processes are
  // refused; its capacity stays booked until the last one is gone.
  bool draining = false;
  Annotations annotations;  // API tenants only: the client's, shown as they were given
  Priority priority = Priority::kNormal;
};

// One GPU of a tenant created through the control API, as requested and
// resolved: every value explicit.
struct ApiGrant {
  GpuUuid uuid{};
  uint32_t share_ppm = 0;  // (0, 1000000]
  uint32_t limit_ppm = 0;  // [share, 1000000]; 1000000 when the share is
  uint64_t memory = 0;     // bytes

  bool operator==(const ApiGrant&) const = default;
};

// A tenant of the control API, independent of the config's GPU order (GPUs
// by UUID), so it can be set beside any config that still manages its GPUs.
struct ApiTenant {
  std::string name;
  std::vector<ApiGrant> gpus;  // request order; at most one per GPU
  bool count_managed = true;
  Annotations annotations;
  bool draining = false;
  Priority priority = Priority::kNormal;
};
using ApiTenants = std::map<std::string, ApiTenant, std::less<>>;

struct NodeConfig {
  std::string source;  // the file it was read from
  DaemonSettings daemon;
  std::vector<ManagedGpu> gpus;  // config order
  std::vector<Tenant> tenants;   // config order

  const Tenant* find_tenant(std::string_view name) const;
  const ManagedGpu* find_gpu(const GpuUuid& uuid) const;
};

struct ConfigError {
  std::string file;
  int line = 0;
  std::string message;

  // "<file>:<line>: <message>"
  std::string to_string() const;
};

struct ConfigResult {
  std::optional<NodeConfig> config;  // set iff errors is empty
  std::vector<ConfigError> errors;   // in line order

  bool ok() const { return config.has_value(); }
};

// Parses `text` (named `source` in messages) against the GPUs of the node.
// `prior` (may be null): tenants' current placement (running ones from their
// ledgers, idle ones from placement.json), kept where the
// config still allows (placement.h).
// `api` (may be null): the tenants of the control API. Their capacity is
// taken before any [[tenant]] is placed; a config that no longer fits beside
// them (a GPU they hold no longer configured, shares or memory past a GPU's,
// a [[tenant]] taking one's name) is invalid, the error naming the API
// tenant. They follow the config's tenants in NodeConfig::tenants, by name.
ConfigResult parse_config(std::string_view text, std::string_view source, const std::vector<DiscoveredGpu>& node,
                          const PriorPlacement* prior = nullptr, const ApiTenants* api = nullptr);

// Reads and parses a file. A file that cannot be read, is not a regular file
// (a FIFO, a device, a directory, a symlink to one) or is larger than
// kMaxConfigBytes is one error at line 0 naming the reason (config_file.h).
ConfigResult load_config(const std::string& path, const std::vector<DiscoveredGpu>& node,
                         const PriorPlacement* prior = nullptr, const ApiTenants* api = nullptr);

}  // namespace fracgpu::controller

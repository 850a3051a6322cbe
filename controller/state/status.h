// `fracgpu status`: a snapshot of every tenant ledger under a run dir, read
// only (the CLI never writes a ledger), rendered as a table or as JSON.
// The JSON schema is documented in docs/configuration.md ("Status JSON").
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/placement.h"

namespace fracgpu::controller {

// `fracgpu` exit codes.
inline constexpr int kStatusOk = 0;            // every ledger was read
inline constexpr int kStatusNoRunDir = 1;      // the run dir cannot be read
inline constexpr int kStatusBadLedger = 2;     // printed, but some ledger could not be read
inline constexpr int kStatusNoFence = 3;       // `gpu clear`: that GPU has no Xid fence
inline constexpr int kStatusUsage = 64;        // bad command line
inline constexpr int kStatusInternal = 70;     // a bug: an unexpected exception

// The daemon counts as alive while its heartbeat is younger than this.
inline constexpr uint64_t kHeartbeatFreshMs = 2000;
inline constexpr int kStatusSchemaVersion = 1;

// A tenant's GPU time on one GPU, from the GPU's arbiter (docs/sm-time.md),
// which the daemon links into the tenant dir as gputime-<entry>.
// All of it is the daemon's scheduler's (the arbiter file is written by
// the daemon alone).
struct GpuTimeStatus {
  uint32_t achieved_1s_ppm = 0;   // GPU time used (measured; held without a meter) over the last 1 s / 10 s, ppm
  uint32_t achieved_10s_ppm = 0;
  uint64_t used_ns = 0;           // GPU time charged, total
  bool measured = false;          // the daemon charges measured GPU time (else time held)
  uint64_t measured_ns = 0;       // GPU time its processes used, as measured, total
  // Held mode's audit (docs/sm-time.md): the driver's sampling period as the
  // daemon sees it (0: no audit), and the GPU time its samples found the
  // tenant's processes using outside its grants (charged), with their count.
  uint64_t sample_period_ns = 0;
  uint64_t out_of_grant_ns = 0;
  uint64_t out_of_grant_samples = 0;
  uint64_t held_ns = 0;           // time it held a grant, total
  uint64_t throttled_ns = 0;      // time it wanted the GPU and did not hold it, total
  uint64_t slices = 0;            // times it was granted the GPU
  bool holding = false;           // it holds the GPU now (or is giving it back)
  uint32_t waiting_processes = 0; // its live processes asking for the GPU (the scheduler's last pass)
  uint32_t tenants_sharing = 0;   // tenants with a share of this GPU (the arbiter's active tenants)
  // Its processes ask for grants: false for a tenant alone on the GPU with
  // no limit below a whole one, whose processes run unshared there.
  bool gated = true;
  uint32_t missed_deadlines = 0;  // revocations its processes did not drain in time, total
  bool blocked = false;           // not granted again until a process that missed the deadline drains
  bool side_by_side = false;      // holds the GPU beside others, shared by the driver's time slices
  bool yields = false;            // a process of it runs outside the gate: it gives way to every tenant that asks
  bool takes_turns = false;       // found taking more than its part of the driver's turns side by side: it takes turns
  // "latency", "normal" or "batch", as the daemon configured the row (an
  // unknown value, from a stale or damaged file, reads as normal).
  std::string priority = "normal";
  // Latency tenants only (0 for others): how long it waited from asking for
  // the GPU to its grant, percentiles over its last gputime::kWaitWindow
  // waits, and how many waits it had in all.
  uint64_t wait_p50_ns = 0;
  uint64_t wait_p99_ns = 0;
  uint64_t wait_p999_ns = 0;
  uint64_t waits = 0;
};

struct GpuEntryStatus {
  uint32_t entry = 0;  // index in the ledger's GPU table
  std::string uuid;
  std::string state;                   // "granted" or "revoked"
  std::optional<uint64_t> memory_quota;  // nullopt: unlimited
  uint64_t memory_used = 0;
  uint64_t context_memory = 0;
  uint32_t share_ppm = 0;
  uint32_t limit_ppm = 0;
  bool count_managed = false;
  // The daemon's health mark on this GPU in the tenant's policy ("" when
  // there is none): why new processes are refused there (health.h's reason
  // names: "lost", "xid", "ecc", "sensors", "bypass").
  std::string unavailable;
  // nullopt: no arbiter linked for this entry (a daemon without GPU-time
  // arbiters), or it cannot be read: then gpu_time_error says why.
  std::optional<GpuTimeStatus> gpu_time;
  std::string gpu_time_error;
};

struct ProcessCharge {
  std::string uuid;
  uint64_t bytes = 0;
};

// A process's GPU time on one GPU, from its slot's GpuTimeRequest in the
// tenant's usage file: figures the process writes itself (for display).
struct ProcessGpuTime {
  std::string uuid;
  uint64_t used_ns = 0;    // time its tenant held the GPU while its gate was open, total
  uint64_t waited_ns = 0;  // time it waited for the GPU, total
  bool waiting = false;    // asks for the GPU now
  bool holding = false;    // has entered its tenant's current grant
};

struct ProcessStatus {
  uint32_t slot = 0;
  std::optional<int32_t> host_pid;  // the slot lock's holder as we see it; nullopt if invisible or gone
  int32_t pid = 0;                  // as the process sees itself (its own PID namespace)
  std::string comm;
  bool running = false;  // it holds its slot lock; false: exited, awaiting reclaim
  std::vector<ProcessCharge> charges;
  uint64_t total_bytes = 0;
  std::vector<ProcessGpuTime> gpu_time;  // per GPU with an arbiter where it asked for or used time
};

struct TenantStatus {
  std::string name;
  std::string source = "config";  // "api": made through the control API (<run_dir>/api-tenants.json)
  std::string state = "active";   // "draining": deleted, waiting for its processes to end
  std::map<std::string, std::string, std::less<>> annotations;  // API tenants: the client's
  std::string dir;
  std::string error;  // non-empty: the ledger could not be read; nothing else is set
  uint64_t generation = 0;  // the node's committed generation of policy, as read
  uint64_t heartbeat_ns = 0;  // CLOCK_MONOTONIC, 0 if never
  int32_t daemon_pid = 0;
  std::vector<GpuEntryStatus> gpus;
  std::vector<ProcessStatus> processes;
};

struct DaemonStatus {
  bool alive = false;
  std::optional<int32_t> pid;
  std::optional<uint64_t> heartbeat_age_ms;  // the freshest heartbeat in any ledger
};

struct StatusReport {
  std::string run_dir;
  DaemonStatus daemon;
  std::vector<TenantStatus> tenants;  // by name
  // What the daemon last applied: policy, and why each tenant is where it is.
  std::optional<PlacementRecord> placement;
  // GPU health and bypass audit findings: <run_dir>/health.json as the daemon
  // last wrote it (health.h); nullopt when absent or unreadable.
  std::optional<nlohmann::json> gpu_health;

  bool all_ledgers_read() const;
};

// The run dir to use when none is given: $FRACGPU_RUN_DIR, else /run/fracgpu.
std::string default_run_dir();

// Reads every <run_dir>/tenants/* ledger. nullopt (and *error) only when the
// run dir itself cannot be read; a bad ledger is reported in its TenantStatus.
std::optional<StatusReport> collect_status(const std::string& run_dir, std::string* error);

// `rows` as aligned columns (two spaces apart), every cell escaped
// (text_escape.h): process names, tenant names, annotations, error texts
// may all carry bytes someone else chose.
std::string render_table(std::vector<std::vector<std::string>> rows);

// The per-GPU table, shared by `fracgpu status` and the live view
// (live_view.h): a row per tenant and GPU it has, by GPU (UUID), then
// tenant; then a row (gpu null) per readable tenant without any GPU.
struct GpuRow {
  const TenantStatus* tenant = nullptr;
  const GpuEntryStatus* gpu = nullptr;  // null: the tenant has no GPU
};
std::vector<GpuRow> gpu_rows(const StatusReport& report);

// The daemon's state in a few words: "alive (pid 42, heartbeat 0.3 s ago)",
// "NOT RUNNING (last heartbeat 12.0 s ago)", ...
std::string daemon_summary(const DaemonStatus& daemon);

// Cells of the tables: a share or limit as a fraction of a GPU ("0.5"; "-"
// for none), parts per million as a percentage ("30.0%"), a duration
// ("0.4 s", "12.5 min", "3.2 h").
std::string format_share(uint32_t ppm);
std::string format_ppm_percent(uint32_t ppm);
std::string format_duration_ms(uint64_t ms);
std::string format_duration_ns(uint64_t ns);

// Keys keep the documented order (ordered_json), so diffs and eyes can follow.
nlohmann::ordered_json status_to_json(const StatusReport& report);
std::string status_to_text(const StatusReport& report);

}  // namespace fracgpu::controller

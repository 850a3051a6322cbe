// fracgpud's engine: turns a validated NodeConfig into the tenants' ledgers and
// keeps them healthy (reclaims dead processes, heartbeats). fracgpud.cpp is
// only argument parsing around this, so tests can drive the same code.
//
// Life of the daemon:
//   start()  discover GPUs, load + validate the config (nothing is touched
//            if it is invalid), lock the run dir (run_dir_lock.h) and the
//            pid file, create or re-adopt every tenant's ledger and commit
//            every tenant's policy at once (commit_policies);
//            and each GPU's time arbiter, whose scheduler thread then
//            grants the GPU's time (gpu_scheduler.h);
//   run()    every reap_interval: reclaim dead slots, compute achieved
//            GPU-time shares, heartbeat, remove drained API tenants; SIGHUP
//            reloads, SIGTERM/SIGINT return 0. Signals arrive on a signalfd:
//            no work ever runs in a signal handler. Between ticks it serves
//            the control API (control_server.h), one request at a time.
// Tenants come from the config and from the control API (api_tenant.h); both
// are one NodeConfig, applied the same way. API tenants are kept in
// <run_dir>/api-tenants.json, read back at start, never changed by a reload.
// Everything the daemon writes is a single atomic store into a mapped file,
// so a SIGKILL at any point leaves valid ledgers; the next start re-adopts them.
// Policy changes, across all tenants, take effect at one store (the node
// file's generation): a SIGKILL during a reload leaves the old policy set.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include <spdlog/logger.h>

#include "config/api_tenant.h"
#include "config/config.h"
#include "common/gpu_discovery.h"
#include "daemon/gpu_scheduler.h"
#include "gputime.h"
#include "daemon/memory_audit.h"
#include "daemon/health.h"
#include "ledger.h"
#include "daemon/control_server.h"
#include "daemon/metrics.h"
#include "state/run_dir.h"
#include "daemon/run_dir_lock.h"

namespace fracgpu::controller {

// fracgpud's exit codes (documented in docs/configuration.md).
inline constexpr int kExitOk = 0;           // clean stop, or --check found the config valid
inline constexpr int kExitCheckFailed = 1;  // --check found the config invalid
inline constexpr int kExitBadConfig = 2;    // start refused: invalid config, nothing changed
inline constexpr int kExitCannotStart = 3;  // run dir (another fracgpud?), pid file or signals failed
inline constexpr int kExitUsage = 64;       // bad command line
inline constexpr int kExitInternal = 70;    // a bug: an unexpected exception

struct DaemonOptions {
  std::string config_path;
  std::optional<LogLevel> log_level;  // --log-level: wins over [daemon] log_level
  std::string cuda_library = "libcuda.so.1";
  std::string nvml_library = "libnvidia-ml.so.1";  // absent: discovery by CUDA alone, no health or audit
};

// When a node check due at `due_ns` (and run at its tick `now_ns`) runs next:
// on its interval's own grid, so that checks looked at only at the daemon's
// tick (every reap_interval_ms) keep their interval on average (`now +
// interval` would stretch a 250 ms interval to two 200 ms ticks). One that
// fell a whole interval behind (a slow pass) starts again from now rather
// than running at every tick to catch up.
inline uint64_t next_check_ns(uint64_t due_ns, uint64_t now_ns, uint64_t interval_ns) {
  const uint64_t next = due_ns + interval_ns;
  return next > now_ns ? next : now_ns + interval_ns;
}

// A stderr logger with fracgpud's format.
std::shared_ptr<spdlog::logger> make_daemon_logger();
void set_log_level(spdlog::logger& log, LogLevel level);

// The GPU table `tenant` must have, from `current` (its latest table): each
// grant bound (an entry appended if needed), its limits filled, granted; every
// other granted entry revoked (`tenant` == nullptr revokes all). Bindings and
// unavailable marks are kept. Usage is never touched, so a quota below current
// use only refuses new charges. Returns false (with *error) if no free GPU
// entry is left for a grant; the other grants are still planned. The daemon
// writes the plans of all tenants and commits them at once (Daemon::apply).
bool plan_policy(const ledger::GpuTable& current, const Tenant* tenant, const NodeConfig& config,
                 ledger::GpuTable* out, std::string* error);

// Blocks the signals fracgpud handles (SIGHUP, SIGTERM, SIGINT) in the calling
// thread; call first thing in main(), before any thread exists, so that they
// queue for the signalfd instead of killing the process during start-up.
void block_daemon_signals();

// fracgpud --check: discovery + validation, errors to stderr, a summary of the
// placement to stdout. Returns kExitOk or kExitCheckFailed.
int check_config(const DaemonOptions& options);

class Daemon {
 public:
  Daemon(DaemonOptions options, std::shared_ptr<spdlog::logger> log);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Returns kExitOk when ready to run(); otherwise an exit code, after
  // printing every config error to stderr.
  int start();
  // The main loop; returns the exit code. Requires block_daemon_signals().
  int run();

  // One pass of the loop: reclaim dead slots and heartbeat, on every ledger.
  void tick();
  // SIGHUP: re-read the config; keeps the old policy if it is invalid.
  bool reload();
  // What the health probe and the bypass audit last found (also in
  // <run_dir>/health.json).
  NodeChecks node_checks() const;
  // One control API request (a JSON object's text) -> the reply's text.
  // Runs on the main loop's thread (control_server.h). Never throws.
  std::string handle_control(const std::string& line, const ControlPeer& peer);

 private:
  struct OpenLedger {
    std::string dir;
    UniqueFd dir_fd;  // the tenant directory: its files are opened by name from here
    ledger::TenantLedger ledger;
    bool configured = false;  // in the current config (else all its GPUs are revoked)
    // Each slot's owner as this daemon found it (record-lock holder with the
    // slot's start time), 0 where none: the audits act on these, never on
    // the copy in the tenant-writable usage file.
    std::array<int32_t, ledger::kMaxSlots> host_pids{};
    ledger::HostPidMemo owners_checked;  // so that each owner costs one read of /proc, not one a tick
    // Non-empty: why the usage file is unusable (shrunk, faulted, replaced).
    // It is unmapped (ledger.usage is null) and re-validated every pass;
    // nothing is reclaimed in it meanwhile.
    std::string corrupt;
    // While it is corrupt: the file it was (a descriptor kept from before),
    // for counting its processes by their record locks, which a live process
    // holds whatever became of the file's contents or name.
    UniqueFd corrupt_locks;
    // When a corruption was last logged as an error: a tenant flipping its
    // file back and forth gets one error a minute, the rest at debug.
    uint64_t corrupt_logged_ns = 0;
    bool corrupt_logged = false;  // the current corruption was logged as an error
  };

  // The config at options_.config_path, placed keeping running tenants where
  // they are (placement.h): their current placement is read from the run dir.
  // With the API tenants (api_tenants_, or at start <run_dir>/api-tenants.json
  // into *api_loaded) beside the config's.
  ConfigResult load_placed_config(ApiTenants* api_loaded) const;
  // The same with the API tenants `api` (null: read from the run dir into
  // *api_loaded), instead of api_tenants_.
  ConfigResult load_placed_config_with(const ApiTenants* api, ApiTenants* api_loaded) const;
  // load_placed_config(), and when only API tenants keep the config from
  // loading (a GPU gone from the config, a [[tenant]] that took an API
  // tenant's name, capacity that shrank), the config with every API tenant
  // that still fits; the others are left in unplaced_ with the reason, so
  // the daemon comes up, says which it cannot place, and the control API
  // can repair them. `api`: all API tenants, placed or not. `placed_stay`
  // (a reload): only tenants already unplaced may stay out; if a placed one
  // no longer fits, the result is the failure.
  ConfigResult load_placing_what_fits(const ApiTenants& api, bool placed_stay);
  PriorPlacement running_placement() const;
  void record_placement(const NodeConfig& config);
  // Starts, restarts or stops the metrics endpoint to match the config.
  void apply_metrics();
  bool prepare_run_dir();
  bool lock_run_dir();
  void check_run_dir_is_shared();
  bool lock_pid_file();
  void apply(const NodeConfig& config);
  // Every open ledger's policy for `config`, committed at once: each tenant's
  // copy not in force is written, then one store into <run_dir>/node makes
  // them all current (ledger_layout.h). Nothing is written if no tenant's
  // committed table would change.
  void commit_policies(const NodeConfig& config);
  bool open_node_file();
  // <tenant dir>/node must be the run dir's node file itself (a hard link).
  bool link_node(const std::string& tenant, const OpenLedger& open);
  OpenLedger* adopt(const std::string& name, bool create);
  void reap(const std::string& name, OpenLedger& open);
  // Every pass, before reap: the usage file is still the one mapped and of
  // the layout's size (grown: cut back; shrunk or replaced: corrupt), or, if
  // corrupt, valid again. True if it may be touched now.
  bool usage_usable(const std::string& name, OpenLedger& open);
  void mark_corrupt(const std::string& name, OpenLedger& open, const std::string& why);
  void close_all();

  // ---- The control API (control_ops.cpp) ----
  ControlAccess control_access() const;
  // The config's tenants and api_tenants_ as one book, in config_.
  void merge_api_tenants();
  // Writes api_tenants_ as `next` would make them, whole; only then are they
  // taken. False (nothing changed) when the file cannot be written.
  bool save_api_tenants(const ApiTenants& next, std::string* error);
  // Processes alive in a tenant's ledger; -1 when that cannot be told (its
  // usage file is unreadable); 0 when it has no open ledger.
  int live_processes(const std::string& name) const;
  // A draining API tenant with no process left: dropped from the book, its
  // ledger directory removed. False if it stays (for now).
  bool finish_delete(const std::string& name);
  void remove_drained();
  nlohmann::json tenant_state(const Tenant& tenant) const;
  nlohmann::json unplaced_state(const std::string& name) const;  // an API tenant in unplaced_
  nlohmann::json node_state();
  nlohmann::json create_tenant(const nlohmann::json& request, bool resize, const ControlPeer& peer);
  nlohmann::json delete_tenant(const nlohmann::json& request, const ControlPeer& peer);
  // Applies the book once for every create and resize of a pass of the
  // control server, after the pass and before its replies are sent
  // (ControlServer::Commit): one commit, not one per request.
  void commit_control_changes();
  bool control_changes_pending_ = false;

  // GPU time (docs/sm-time.md): one arbiter per managed GPU, its tenant
  // table kept in step with the config, linked into each tenant directory.
  struct GpuArbiter {
    std::string path;
    gputime::Arbiter arbiter;
    // The arbiter's only writer, on a thread of its own (gpu_scheduler.h).
    std::unique_ptr<GpuScheduler> scheduler;
    // NVML's compute capability major of the GPU: 6 and later time-slice
    // contexts (side by side needs it); 0: not known.
    int compute_major = 0;
  };
  void apply_gpu_time(const NodeConfig& config);
  // Stops a GPU's scheduler (its tenants told at once) and closes its arbiter.
  static void stop_and_close(GpuArbiter& arbiter);
  // Gives each arbiter's scheduler an NVML meter, where NVML measures
  // per-process utilization (measured mode, docs/sm-time.md).
  void attach_meters();
  // Tells each scheduler whether its tenants may hold the GPU side by side
  // (the config, and the GPU's compute capability from NVML).
  void configure_side_by_side();
  GpuArbiter* open_arbiter(const ManagedGpu& gpu);
  void link_arbiter(const std::string& tenant, const OpenLedger& open, const GpuArbiter& arbiter, int entry);
  void tick_gpu_time(uint64_t now);

  // GPU health and bypass audit through NVML (docs/operations.md).
  void start_gpu_checks();
  void check_gpus(uint64_t now);
  // Host PID -> tenant of every verified tenant process (OpenLedger::host_pids).
  std::map<int32_t, std::string> tenant_processes() const;
  // Processes on a GPU that no ledger slot names (a process without the
  // interposer), as NVML's process list showed them (watch_gpu_processes)
  // or the GPU-time meters named them, and whose container they are in
  // (empty: none known; asked again after a second). Kept for a while after
  // the process left the GPU: the driver's samples that name it come later,
  // and are still its tenant's.
  struct OutsideGate {
    uint64_t start_time = 0;  // /proc/<pid>/stat field 22: with the PID, names one process
    uint64_t from_ns = 0;     // its start on CLOCK_MONOTONIC, less a margin: earlier samples are not its
    uint64_t checked_ns = 0;  // when it was last found alive (or attributed)
    uint64_t listed_ns = 0;   // the last watch pass that found it on a GPU; 0: none did
    uint64_t gone_ns = 0;     // when it was found off the GPUs or dead; 0: not yet
    bool logged = false;  // the log named its tenants (found by the meters, not on NVML's lists)
    struct OnGpu {
      uint64_t listed_ns = 0;  // the last watch pass that listed it on the GPU
      // Whose its turns there are: the tenant of its container, or the
      // container's claims that share that GPU (all of them; empty: nobody's).
      std::set<std::string> tenants;
      bool logged = false;  // the log named them
    };
    // The GPUs (UUIDs) NVML's lists show it on; a GPU it has left drops out
    // at the next pass that read every GPU's list.
    std::map<std::string, OnGpu> gpus;
    // Whose GPU time it is: every tenant it was attributed to, on any GPU
    // (each GPU's scheduler charges those with a share of it).
    std::set<std::string> tenants;
  };
  std::map<uint32_t, OutsideGate> outside_gate_;
  // How often NVML's list of the processes with a context on each GPU is
  // read, so that a process without the interposer is attributed while it
  // lives, however short its life (a process that dies before anyone asks
  // whose it is would otherwise use the GPU for free).
  static constexpr uint64_t kWatchIntervalNs = 50'000'000;
  // How long a process's record outlives its stay on the GPU: the samples
  // naming it come up to a sampling period later (at most 1 s), and wait
  // for the next tick (reap_interval_ms, at most 1 s).
  static constexpr uint64_t kOutsideGoneKeepNs = 3'000'000'000;
  static constexpr size_t kOutsideGateMax = 4096;
  static constexpr int kWatchAttributionsPerPass = 16;  // /proc reads a pass may cost
  uint64_t next_watch_ns_ = 0;
  void watch_gpu_processes(uint64_t now);
  // Says that process `pid` runs on `where` ("GPU <uuid>") outside the
  // gate, and whose its GPU time there is.
  void log_outside_gate(uint32_t pid, const std::string& where, const std::set<std::string>& tenants) const;
  // A sample's instant is put on CLOCK_MONOTONIC from NVML's CPU clock stamp:
  // the margin the lifetime of an outside process allows it.
  static constexpr uint64_t kLifetimeMarginNs = 20'000'000;
  // Every grant's memory quota, by tenant and GPU, each raised to what the
  // tenant may still hold there after a shrink (shrunk_).
  std::vector<TenantQuota> memory_quotas() const;
  // Host PID -> every tenant whose slot it holds (a process of a container
  // with several claims holds one in each).
  ProcessOwners memory_owners() const;

  // An operator's resize that lowers a tenant's quota on a GPU, or drops the
  // GPU, must neither kill the memory its processes hold nor free capacity
  // they still use (docs/security.md). So the old quota stays what the tenant
  // may hold there, and stays booked, until the driver's count falls: each
  // memory audit lowers it to what is held, and it goes once that fits the
  // new quota. Only new charges see the new quota at once. What is held is
  // the driver's count (held_now), so memory held by processes without the
  // interposer is kept like memory charged in the ledger.
  // (tenant, GPU uuid) -> bytes the tenant may still hold there.
  using TenantGpu = std::pair<std::string, std::string>;
  std::map<TenantGpu, uint64_t> shrunk_;
  // Each tenant's quota per GPU as last applied, to see a shrink coming.
  std::map<TenantGpu, uint64_t> applied_quotas_;
  bool quotas_in_force_read_ = false;
  // applied_quotas_ from the ledgers' tables in force (at start).
  void note_quotas_in_force(const NodeConfig& config);
  void note_shrinks(const NodeConfig& config);
  void settle_shrinks();
  // What the tenant holds on the GPU now: by the driver's count where the
  // last memory audit read that GPU (all its processes, with or without the
  // interposer), else by its ledger (its processes' own charges; 0 with no
  // process). nullopt when it cannot be told.
  std::optional<uint64_t> held_now(const TenantGpu& key) const;
  // shrunk_ survives a restart in <run_dir>/shrunk-quotas.json (the run
  // dir's, never a tenant's), read at start: a restart must not turn an
  // allowance into a kill, nor hand back one that was lowered (its capacity
  // may be another tenant's by then). So the file follows every change,
  // written durably, and a lowering takes effect only once it is written.
  bool save_shrinks(const std::map<TenantGpu, uint64_t>& shrunk);
  void load_shrinks();
  bool shrinks_unsaved_ = false;  // the last write failed (logged once as a warning)
  // book_of(), plus what shrunk tenants still hold past their quota.
  std::vector<GpuBook> capacity_book(std::string_view except = {}) const;
  // Writes GpuPolicy::unavailable of every ledger entry from the health
  // probe's and the audit's findings (deny), so new processes see them.
  void apply_unavailable();

  DaemonOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  Discovery discovery_;
  std::optional<NodeConfig> config_;
  std::map<std::string, OpenLedger> ledgers_;  // by tenant name
  std::map<std::string, GpuArbiter> arbiters_; // by GPU UUID text
  RunDirLock run_dir_lock_;  // held from before the first write to the run dir until the daemon ends
  DaemonRunDir run_;         // opened and checked by prepare_run_dir()
  int pid_fd_ = -1;
  ledger::NodeSegment* node_ = nullptr;  // <run_dir>/node: the committed generation of policy
  int node_fd_ = -1;
  MetricsServer metrics_;
  std::unique_ptr<Nvml> nvml_;
  std::unique_ptr<HealthMonitor> health_;
  std::unique_ptr<Auditor> auditor_;
  std::unique_ptr<MemoryAuditor> memory_auditor_;
  ApiTenants api_tenants_;  // the control API's tenants, as persisted
  // API tenants kept but not placed (load_placing_what_fits): name -> why.
  std::map<std::string, std::string> unplaced_;
  ControlServer control_;
  // `node` replies: its generation moves whenever the reply would differ.
  uint64_t node_generation_ = 0;
  std::string node_last_;
  uint64_t next_health_ns_ = 0;
  uint64_t next_audit_ns_ = 0;
  uint64_t next_memory_audit_ns_ = 0;
  // Whether the GPU checks have set the ledgers' availability marks since
  // the checks (re)started: the first pass always does, clearing what an
  // earlier daemon left.
  bool marks_applied_ = false;
};

}  // namespace fracgpu::controller

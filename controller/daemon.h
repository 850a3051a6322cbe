// fracgpud's engine: turns a validated NodeConfig into the tenants' ledgers and
// keeps them healthy (reclaims dead processes, heartbeats). fracgpud.cpp is
// only argument parsing around this, so tests can drive the same code.
//
// Life of the daemon:
//   start()  discover GPUs, load + validate the config (nothing is touched
//            if it is invalid), lock the pid file, create or re-adopt every
//            tenant's ledger and write its policy;
//            and each GPU's time arbiter, whose scheduler thread then
//            grants the GPU's time (gpu_scheduler.h);
//   run()    every reap_interval: reclaim dead slots, compute achieved
//            GPU-time shares, heartbeat; SIGHUP
//            reloads, SIGTERM/SIGINT return 0. Signals arrive on a signalfd:
//            no work ever runs in a signal handler.
// Everything the daemon writes is a single atomic store into a mapped file,
// so a SIGKILL at any point leaves valid ledgers; the next start re-adopts them.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include <spdlog/logger.h>

#include "config.h"
#include "gpu_discovery.h"
#include "gpu_scheduler.h"
#include "gputime.h"
#include "health.h"
#include "ledger.h"
#include "metrics.h"

namespace fracgpu::controller {

// fracgpud's exit codes (documented in docs/configuration.md).
inline constexpr int kExitOk = 0;           // clean stop, or --check found the config valid
inline constexpr int kExitCheckFailed = 1;  // --check found the config invalid
inline constexpr int kExitBadConfig = 2;    // start refused: invalid config, nothing changed
inline constexpr int kExitCannotStart = 3;  // run dir, pid file (another fracgpud?) or signals failed
inline constexpr int kExitUsage = 64;       // bad command line
inline constexpr int kExitInternal = 70;    // a bug: an unexpected exception

inline constexpr const char* kPidFileName = "fracgpud.pid";
inline constexpr const char* kTenantsDirName = "tenants";
// <tenant dir>/gputime-<entry>: the hard link to the arbiter of the GPU in
// that entry of the tenant's policy.
inline constexpr const char* kGpuTimeLinkPrefix = "gputime-";

struct DaemonOptions {
  std::string config_path;
  std::optional<LogLevel> log_level;  // --log-level: wins over [daemon] log_level
  std::string cuda_library = "libcuda.so.1";
  std::string nvml_library = "libnvidia-ml.so.1";  // absent: discovery by CUDA alone, no health or audit
};

// A stderr logger with fracgpud's format.
std::shared_ptr<spdlog::logger> make_daemon_logger();
void set_log_level(spdlog::logger& log, LogLevel level);

// Writes `tenant`'s grants into a mapped policy: binds each GPU, stores its
// limits, marks it granted; every other granted entry becomes revoked
// (`tenant` == nullptr revokes all). Quotas change in place, one atomic store
// each; usage is never touched, so a quota below current use only refuses new
// charges. Bumps the generation iff something changed. Returns false (with
// *error) if the policy has no free GPU entry left for a grant; the other
// grants are still written.
bool write_policy(ledger::PolicySegment& policy, const Tenant* tenant, const NodeConfig& config, spdlog::logger& log,
                  std::string* error);

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

 private:
  struct OpenLedger {
    std::string dir;
    ledger::TenantLedger ledger;
    bool configured = false;  // in the current config (else all its GPUs are revoked)
  };

  // The config at options_.config_path, placed keeping running tenants where
  // they are (placement.h): their current placement is read from the run dir.
  ConfigResult load_placed_config() const;
  PriorPlacement running_placement() const;
  void record_placement(const NodeConfig& config);
  // Starts, restarts or stops the metrics endpoint to match the config.
  void apply_metrics();
  bool prepare_run_dir();
  bool lock_pid_file();
  void apply(const NodeConfig& config);
  OpenLedger* adopt(const std::string& name, bool create);
  void reap(const std::string& name, OpenLedger& open);
  void close_all();

  // GPU time (docs/sm-time.md): one arbiter per managed GPU, its tenant
  // table kept in step with the config, linked into each tenant directory.
  struct GpuArbiter {
    std::string path;
    gputime::Arbiter arbiter;
    // The arbiter's only writer, on a thread of its own (gpu_scheduler.h).
    std::unique_ptr<GpuScheduler> scheduler;
  };
  void apply_gpu_time(const NodeConfig& config);
  GpuArbiter* open_arbiter(const ManagedGpu& gpu);
  void link_arbiter(const std::string& tenant, const OpenLedger& open, const GpuArbiter& arbiter, int entry);
  void tick_gpu_time(uint64_t now);

  // GPU health and bypass audit through NVML (docs/operations.md).
  void start_gpu_checks();
  void check_gpus(uint64_t now);
  // Writes GpuPolicy::unavailable of every ledger entry from the health
  // probe's and the audit's findings (deny), so new processes see them.
  void apply_unavailable();

  DaemonOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  Discovery discovery_;
  std::optional<NodeConfig> config_;
  std::map<std::string, OpenLedger> ledgers_;  // by tenant name
  std::map<std::string, GpuArbiter> arbiters_; // by GPU UUID text
  int pid_fd_ = -1;
  MetricsServer metrics_;
  std::unique_ptr<Nvml> nvml_;
  std::unique_ptr<HealthMonitor> health_;
  std::unique_ptr<Auditor> auditor_;
  uint64_t next_health_ns_ = 0;
  uint64_t next_audit_ns_ = 0;
};

}  // namespace fracgpu::controller

#include "daemon/daemon.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/sinks/stdout_sinks.h>

#include "config/placement.h"
#include "control/protocol.h"
#include "config/tenant_rules.h"
#include "daemon/log_limit.h"
#include "safe_file.h"
#include "sigbus_guard.h"
#include "state/status.h"
#include "common/text_escape.h"
#include "common/units.h"

namespace fracgpu::controller {
namespace {

namespace fs = std::filesystem;
using ledger::GpuPolicy;
using ledger::kMaxGpus;
using ledger::kMaxSlots;
using ledger::monotonic_ns;

// Where a process's start time (/proc/<pid>/stat field 22: clock ticks
// after boot, counting suspended time) lies on CLOCK_MONOTONIC (which stops
// while suspended), the clock of the meters' sample instants.
uint64_t start_on_monotonic_ns(uint64_t start_ticks) {
  static const long hz = sysconf(_SC_CLK_TCK);
  const uint64_t since_boot = start_ticks * (1'000'000'000ull / static_cast<uint64_t>(hz > 0 ? hz : 100));
  struct timespec boot {};
  clock_gettime(CLOCK_BOOTTIME, &boot);
  const uint64_t boot_ns = static_cast<uint64_t>(boot.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(boot.tv_nsec);
  const uint64_t now = monotonic_ns();
  const uint64_t suspended = boot_ns > now ? boot_ns - now : 0;
  return since_boot > suspended ? since_boot - suspended : 0;
}

// Whether two spellings of a run dir name the same path ("/run/fracgpu/"
// and "/run/fracgpu" do), without asking the file system: the new one need
// not exist.
bool same_directory(const std::string& a, const std::string& b) {
  const auto normal = [](const std::string& path) {
    std::string p = fs::path(path).lexically_normal().string();
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    return p;
  };
  return normal(a) == normal(b);
}

// Stores and reports whether the value changed, so untouched arbiters keep
// their generation (the pacer re-reads shares when it moves).
template <typename T>
bool store_if_changed(std::atomic<T>& field, T value) {
  if (field.load(std::memory_order_relaxed) == value) return false;
  field.store(value, std::memory_order_release);
  return true;
}

std::string describe_grant(const NodeConfig& config, const Grant& grant) {
  const ManagedGpu& gpu = config.gpus[grant.gpu];
  return fmt::format("GPU {} ({}): share {}, limit {}, memory quota {}", gpu.index, gpu.uuid,
                     grant.share_ppm == 0 ? std::string("none") : format_gpus(grant.share_ppm),
                     format_gpus(grant.limit_ppm), format_size(grant.memory_quota));
}

void print_errors(const ConfigResult& result, const Discovery& discovery) {
  for (const ConfigError& e : result.errors) fmt::print(stderr, "{}\n", e.to_string());
  if (!discovery.problem.empty()) fmt::print(stderr, "note: GPU discovery: {}\n", discovery.problem);
  fmt::print(stderr, "{} error(s); nothing was changed\n", result.errors.size());
}

// The policy's tenant name, for checking a directory holds the ledger of the
// tenant it is named after. Empty when the segment is fresh (all zero).
std::string stamped_name(const ledger::PolicySegment& policy) {
  return std::string(policy.tenant, strnlen(policy.tenant, sizeof policy.tenant));
}

// SIGHUP: reload; SIGTERM, SIGINT: stop. Read from a signalfd, never handled.
sigset_t daemon_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

}  // namespace

std::shared_ptr<spdlog::logger> make_daemon_logger() {
  auto limited = std::make_shared<RateLimitedSink>(std::make_shared<spdlog::sinks::stderr_sink_st>(), kLogBurst,
                                                   kLogLinesPerSecond);
  auto log = std::make_shared<spdlog::logger>("fracgpud", std::move(limited));
  log->set_pattern("%Y-%m-%d %H:%M:%S.%e %l: %v");
  log->flush_on(spdlog::level::trace);  // stderr may be a file or a pipe to journald
  return log;
}

void set_log_level(spdlog::logger& log, LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: log.set_level(spdlog::level::trace); break;
    case LogLevel::kDebug: log.set_level(spdlog::level::debug); break;
    case LogLevel::kInfo: log.set_level(spdlog::level::info); break;
    case LogLevel::kWarn: log.set_level(spdlog::level::warn); break;
    case LogLevel::kError: log.set_level(spdlog::level::err); break;
  }
}

bool plan_policy(const ledger::GpuTable& current, const Tenant* tenant, const NodeConfig& config,
                 ledger::GpuTable* out, std::string* error) {
  *out = current;
  bool ok = true;
  bool keep[kMaxGpus] = {};
  static const std::vector<Grant> kNoGrants;
  for (const Grant& grant : tenant != nullptr ? tenant->grants : kNoGrants) {
    const ManagedGpu& gpu = config.gpus[grant.gpu];
    int entry = ledger::find_gpu(*out, gpu.uuid_bytes.data());
    for (uint32_t g = 0; entry < 0 && g < kMaxGpus; ++g)
      if (out->gpus[g].state == ledger::kGpuUnused) entry = static_cast<int>(g);  // appended: bound from now on
    if (entry < 0) {
      *error = fmt::format("tenant \"{}\": cannot grant GPU {} ({}): all {} GPU entries of its ledger are bound to "
                           "other GPUs",
                           tenant->name, gpu.index, gpu.uuid, kMaxGpus);
      ok = false;
      continue;
    }
    keep[entry] = true;
    ledger::GpuEntry& e = out->gpus[entry];
    memcpy(e.uuid, gpu.uuid_bytes.data(), sizeof e.uuid);
    e.memory_quota = grant.memory_quota;
    e.context_memory = gpu.context_memory;
    e.flags = (tenant->count_managed ? uint32_t{ledger::kCountManagedMemory} : 0u) |
              (tenant->draining ? uint32_t{ledger::kTenantDraining} : 0u);
    e.share_ppm = grant.share_ppm;
    e.limit_ppm = grant.limit_ppm;
    e.state = ledger::kGpuGranted;
  }
  for (uint32_t g = 0; g < kMaxGpus; ++g)
    if (!keep[g] && out->gpus[g].state == ledger::kGpuGranted) out->gpus[g].state = ledger::kGpuRevoked;
  return ok;
}

// The API tenants <run_dir>/api-tenants.json holds: none if it is absent
// (no tenant was ever created there); false and *error if it is there but
// cannot be read or is not such a file.
bool read_api_tenants(const std::string& run_dir, ApiTenants* out, std::string* error) {
  out->clear();
  std::string why;
  const std::optional<RunDirView> view = open_run_dir_view(run_dir, &why);
  if (!view) return true;  // no run dir yet: nothing was ever created
  bool missing = false;
  const std::optional<std::string> text =
      read_file_at(view->root.get(), run_dir, kApiTenantsFileName, view->owner, kMaxRunFileBytes, &why, &missing);
  if (!text) {
    if (missing) return true;
    *error = why;
    return false;
  }
  std::optional<ApiTenants> parsed = parse_api_tenants_file(*text, &why);
  if (!parsed) {
    *error = fmt::format("{}/{}: {}", run_dir, kApiTenantsFileName, why);
    return false;
  }
  *out = std::move(*parsed);
  return true;
}

// Settings that are valid but work against each other: said at every load
// (fracgpud --check prints them, the daemon logs them), appended to *out.
void policy_warnings(const NodeConfig& config, std::vector<std::string>* out) {
  if (!config.daemon.gpu_time_measured) return;
  // Measured charging acts on NVML's samples: one every ~1/6 s to 1 s on a
  // real GPU, each charging the process it caught for the whole period. A
  // latency tenant's charges then come in lumps, and fairness and its
  // priority act on them (on the realistic stand-in, beside a training
  // tenant: p99 0.36 s, against 4.2 ms with held charging).
  for (const Tenant& tenant : config.tenants)
    if (tenant.priority == Priority::kLatency)
      out->push_back(fmt::format(
          "tenant \"{}\" has priority = \"latency\" under gpu_time_charging = \"measured\": NVML samples GPU "
          "time about every 1/6 s, so its charges come in lumps and it stalls for hundreds of milliseconds at a "
          "time; held charging (the default) is the one latency tenants are built for (docs/sm-time.md, "
          "\"Latency tenants\")",
          tenant.name));
}

// Loads the config placing running tenants where they run: `running` if
// given; else read from the run dir as `fracgpu status` reads it, which
// opens and closes every ledger and the pid file. Closing them drops every
// record lock this process holds on them, so that is only for a process that
// holds none yet (--check, start before the pid-file lock); see metrics.h.
// Idle tenants are kept where <run_dir>/placement.json says they were.
// API tenants: `api` if given, else read from the run dir (into *api_loaded).
// Parses twice when there is a prior placement or an API tenant: the first
// pass only finds run_dir. *moved: a warning per running tenant that the
// result moves, and policy_warnings' about the settings.
ConfigResult load_placed(const std::string& path, const Discovery& discovery, const PriorPlacement* running,
                         const ApiTenants* api, ApiTenants* api_loaded, std::vector<std::string>* moved) {
  ConfigResult result = load_config(path, discovery.gpus);
  if (!result.ok()) return result;
  const std::string run_dir = result.config->daemon.run_dir;
  ApiTenants from_disk;
  if (api == nullptr) {
    std::string error;
    if (!read_api_tenants(run_dir, &from_disk, &error)) {
      result.config.reset();
      result.errors.push_back({fmt::format("{}/{}", run_dir, kApiTenantsFileName), 0,
                               fmt::format("the control API's tenants cannot be read back: {} (move the file away "
                                           "to start without them)",
                                           error)});
      return result;
    }
    api = &from_disk;
    if (api_loaded != nullptr) *api_loaded = from_disk;
  }
  PriorPlacement prior;
  if (running != nullptr) {
    prior = *running;
  } else {
    std::string error;
    // No run dir yet: nothing runs.
    if (const auto report = collect_status(run_dir, &error)) prior = prior_placement_from(*report);
  }
  add_recorded_placement(run_dir, &prior);
  if (prior.empty() && api->empty()) {
    policy_warnings(*result.config, moved);
    return result;
  }
  result = load_config(path, discovery.gpus, prior.empty() ? nullptr : &prior, api);
  if (result.ok()) {
    std::map<std::string, std::vector<std::string>> now;
    for (const Tenant& tenant : result.config->tenants)
      for (const Grant& grant : tenant.grants)
        if (grant.share_ppm > 0) now[tenant.name].push_back(result.config->gpus[grant.gpu].uuid);
    *moved = running_tenants_moved(prior, now);
    policy_warnings(*result.config, moved);
  }
  return result;
}

void block_daemon_signals() {
  const sigset_t set = daemon_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

namespace {

// The config with every API tenant in `api` that fits beside it: `load`
// places the config with a given set of API tenants. Those in `placed` are
// kept placed whatever happens (a reload never unplaces a running tenant: it
// is refused instead); the others are tried one at a time, in name order,
// each placed if it fits beside the config and those before it. *unplaced:
// the rest, with why. The result is the config with all of them when that
// fits, else with what fits, else (not the API tenants' fault) the errors
// of the config with all of them.
ConfigResult place_what_fits(const ApiTenants& api, const std::set<std::string>& placed,
                             const std::function<ConfigResult(const ApiTenants*)>& load,
                             std::map<std::string, std::string>* unplaced) {
  unplaced->clear();
  ConfigResult all = load(&api);
  if (all.ok()) return all;
  ApiTenants fits, candidates;
  for (const auto& [name, tenant] : api) (placed.contains(name) ? fits : candidates)[name] = tenant;
  if (candidates.empty()) return all;
  ConfigResult best = load(&fits);
  if (!best.ok()) return all;  // not the candidates' fault: every error
  for (const auto& [name, tenant] : candidates) {
    ApiTenants trial = fits;
    trial[name] = tenant;
    ConfigResult tried = load(&trial);
    if (tried.ok()) {
      fits = std::move(trial);
      best = std::move(tried);
      continue;
    }
    std::string why;
    for (const ConfigError& e : tried.errors) why += (why.empty() ? "" : "; ") + e.to_string();
    unplaced->emplace(name, std::move(why));
  }
  return best;
}

}  // namespace

int check_config(const DaemonOptions& options) {
  const Discovery discovery = discover_gpus(options.cuda_library.c_str(), options.nvml_library.c_str());
  std::vector<std::string> moved;
  ConfigResult result = load_placed(options.config_path, discovery, nullptr, nullptr, nullptr, &moved);
  // As a start does: the control API's tenants that no longer fit beside
  // the config are kept unplaced, which does not stop the daemon (it is the
  // daemon's API that repairs them), so it does not fail the check either.
  std::map<std::string, std::string> unplaced;
  ApiTenants api;
  std::string api_error;
  if (!result.ok()) {
    const ConfigResult bare = load_config(options.config_path, discovery.gpus);
    if (bare.ok() && read_api_tenants(bare.config->daemon.run_dir, &api, &api_error) && !api.empty()) {
      moved.clear();
      result = place_what_fits(
          api, {},
          [&](const ApiTenants* with) {
            return load_placed(options.config_path, discovery, nullptr, with, nullptr, &moved);
          },
          &unplaced);
    }
  }
  if (!result.ok()) {
    print_errors(result, discovery);
    return kExitCheckFailed;
  }
  for (const std::string& warning : moved) fmt::print(stderr, "warning: {}\n", warning);
  for (const auto& [name, why] : unplaced)
    fmt::print(stderr, "warning: API tenant \"{}\" cannot be placed beside this config: {}; a start keeps it "
                       "unplaced (its processes get no GPU) until `fracgpu tenant resize` or `delete` repairs it\n",
               name, why);
  const NodeConfig& config = *result.config;
  fmt::print("{}: valid ({} GPU(s), {} tenant(s))\nplacement policy: {} (each grant says why: devices, kept, "
             "unchanged, policy, memory, or api: a tenant of the control API)\n",
             options.config_path, config.gpus.size(), config.tenants.size(),
             placement_policy_name(config.daemon.placement));
  for (const Tenant& tenant : config.tenants) {
    // Only a priority other than normal stands out.
    const std::string priority =
        tenant.priority == Priority::kNormal ? "" : fmt::format(" ({})", priority_name(tenant.priority));
    for (const Grant& grant : tenant.grants)
      fmt::print("  tenant \"{}\"{}: {} [{}]\n", tenant.name, priority, describe_grant(config, grant),
                 placement_reason_name(tenant.placement));
  }
  return kExitOk;
}

Daemon::Daemon(DaemonOptions options, std::shared_ptr<spdlog::logger> log)
    : options_(std::move(options)), log_(std::move(log)) {}

Daemon::~Daemon() {
  control_.stop();
  metrics_.stop();
  close_all();
  if (pid_fd_ >= 0) {
    // Emptied rather than removed: unlinking a locked file races with a
    // starting daemon, which could then lock a file nobody else can see.
    if (ftruncate(pid_fd_, 0) != 0) log_->debug("cannot empty the pid file: {}", strerror(errno));
    ::close(pid_fd_);
  }
  if (run_.private_dir.valid()) shm::set_private_dir(-1);
  ledger::close_node(node_, node_fd_);
}

int Daemon::start() {
  if (options_.log_level) set_log_level(*log_, *options_.log_level);
  discovery_ = discover_gpus(options_.cuda_library.c_str(), options_.nvml_library.c_str());
  ConfigResult result = load_placed_config(&api_tenants_);
  // API tenants that no longer fit (a GPU gone, a name taken) must not keep
  // the whole node down: the daemon comes up without them, and says so.
  if (!result.ok() && !api_tenants_.empty()) result = load_placing_what_fits(api_tenants_, /*placed_stay=*/false);
  if (!result.ok()) {
    print_errors(result, discovery_);
    return kExitBadConfig;
  }
  config_ = std::move(result.config);
  if (!options_.log_level) set_log_level(*log_, config_->daemon.log_level);
  if (!discovery_.problem.empty()) log_->warn("GPU discovery: {}", discovery_.problem);
  for (const DiscoveredGpu& gpu : discovery_.gpus)
    log_->info("found GPU {} {} ({}, {}, {} SMs)", gpu.index, gpu.uuid, gpu.name, format_size(gpu.memory_bytes),
               gpu.sm_count);
  if (discovery_.nvml && discovery_.gpus.empty())
    log_->info("NVML: no GPU on this node{}", discovery_.nvml_problem.empty() ? "" : "; " + discovery_.nvml_problem);
  else if (discovery_.nvml)
    log_->info("NVML: GPUs listed by NVML{}", discovery_.nvml_problem.empty() ? "" : "; " + discovery_.nvml_problem);
  else
    log_->warn("{}; GPUs found through the CUDA driver alone, GPU health, the bypass audit and the memory audit are off",
               discovery_.nvml_problem);
  if (!lock_run_dir() || !prepare_run_dir() || !open_node_file() || !lock_pid_file()) return kExitCannotStart;
  check_run_dir_is_shared();
  log_->info("fracgpud {} started: config {}, run dir {}", getpid(), options_.config_path, config_->daemon.run_dir);
  load_shrinks();
  apply(*config_);
  if (!api_tenants_.empty()) log_->info("{} tenant(s) of the control API re-created", api_tenants_.size());
  apply_metrics();
  start_gpu_checks();
  std::string error;
  if (!control_.start(run_, control_access(), &error)) {
    log_->error("{}", error);
    return kExitCannotStart;
  }
  log_->info("control API: listening on {}/{} ({})", config_->daemon.run_dir, control::kSocketName,
             config_->daemon.control_group.empty() ? std::string("root and uid ") + std::to_string(geteuid())
                                                   : "root, uid " + std::to_string(geteuid()) + " and group " +
                                                         config_->daemon.control_group);
  tick();  // heartbeat at once: `fracgpu status` should not report a fresh daemon as dead
  return kExitOk;
}

ConfigResult Daemon::load_placed_config(ApiTenants* api_loaded) const {
  return load_placed_config_with(api_loaded != nullptr ? nullptr : &api_tenants_, api_loaded);
}

ConfigResult Daemon::load_placed_config_with(const ApiTenants* api, ApiTenants* api_loaded) const {
  std::vector<std::string> moved;
  ConfigResult result;
  if (pid_fd_ < 0) {
    // start: no lock held yet
    result = load_placed(options_.config_path, discovery_, nullptr, api, api_loaded, &moved);
  } else {
    const PriorPlacement running = running_placement();
    result = load_placed(options_.config_path, discovery_, &running, api, api_loaded, &moved);
  }
  for (const std::string& warning : moved) log_->warn("{}", warning);
  return result;
}

ConfigResult Daemon::load_placing_what_fits(const ApiTenants& api, bool placed_stay) {
  std::set<std::string> placed;
  if (placed_stay)
    for (const auto& [name, tenant] : api)
      if (!unplaced_.contains(name)) placed.insert(name);
  std::map<std::string, std::string> unplaced;
  ConfigResult result = place_what_fits(
      api, placed, [this](const ApiTenants* with) { return load_placed_config_with(with, nullptr); }, &unplaced);
  if (!result.ok()) return result;  // the errors of the config with all of them; nothing unplaced changes
  for (const auto& [name, why] : unplaced)
    if (!unplaced_.contains(name) || unplaced_.at(name) != why)
      log_->error("API tenant \"{}\" cannot be placed: {}. It is kept, not placed: its processes get no GPU. "
                  "`fracgpu tenant resize` to a spec that fits, or `fracgpu tenant delete`, repairs it",
                  name, why);
  unplaced_ = std::move(unplaced);
  return result;
}

// From the ledgers held open, never by re-opening them (see load_placed).
PriorPlacement Daemon::running_placement() const {
  PriorPlacement prior;
  for (const auto& [name, open] : ledgers_) {
    if (live_processes(name) <= 0) continue;  // none, or corrupt (see usage_usable)
    std::vector<PriorGrant> grants;
    ledger::GpuTable table;
    ledger::read_gpu_table(open.ledger, &table);
    for (const ledger::GpuEntry& e : table.gpus) {
      if (e.state != ledger::kGpuGranted || e.share_ppm == 0) continue;
      PriorGrant g;
      memcpy(g.uuid.data(), e.uuid, g.uuid.size());
      g.share_ppm = e.share_ppm;
      grants.push_back(g);
    }
    if (!grants.empty()) prior.emplace(name, std::move(grants));
  }
  return prior;
}

void Daemon::record_placement(const NodeConfig& config) {
  PlacementRecord record;
  record.policy = placement_policy_name(config.daemon.placement);
  for (const Tenant& tenant : config.tenants) {
    record.why.emplace(tenant.name, placement_reason_name(tenant.placement));
    for (const Grant& grant : tenant.grants)
      if (grant.share_ppm > 0) record.grants[tenant.name].emplace_back(config.gpus[grant.gpu].uuid, grant.share_ppm);
  }
  std::string error;
  if (!write_placement_record(config.daemon.run_dir, record, &error))
    log_->warn("{}; `fracgpu status` will not explain placement", error);
}

void Daemon::apply_metrics() {
  metrics_.set_liveness_timeout(static_cast<uint64_t>(config_->daemon.liveness_timeout.count()) * 1000);
  const std::string& wanted = config_->daemon.metrics_address;
  if (wanted.empty()) {
    if (metrics_.running()) log_->info("metrics: endpoint {} stopped", metrics_.address());
    metrics_.stop();
    return;
  }
  std::string why;
  const std::optional<HostPort> address = parse_host_port(wanted, &why);
  if (!address) return;  // the config check refused it already
  if (metrics_.running() && metrics_.address() == format_host_port(*address)) return;
  std::string error;
  // Metrics are an aid: a taken port must not stop quotas from being enforced.
  if (!metrics_.start(*address, config_->daemon.run_dir, log_, &error)) {
    log_->error("{}; running without metrics", error);
    return;
  }
  log_->info("metrics: serving http://{}/metrics", format_host_port({address->host, metrics_.port()}));
}

// The run dir is where every tenant's policy lives: the daemon runs only on
// one that is its own and that no one else may write (run_dir.h).
bool Daemon::prepare_run_dir() {
  std::string error, notes;
  std::optional<DaemonRunDir> run = open_daemon_run_dir(config_->daemon.run_dir, &error, &notes);
  if (!run) {
    log_->error("run dir refused: {}", error);
    return false;
  }
  if (!notes.empty()) log_->warn("run dir: {}", notes);
  run_ = std::move(*run);
  shm::set_private_dir(run_.private_dir.get());
  return true;
}

// One daemon per run dir, before anything is written in it (run_dir_lock.h).
// Only the run dir itself may be created first: the lock is taken on it.
bool Daemon::lock_run_dir() {
  std::error_code ec;
  fs::create_directories(config_->daemon.run_dir, ec);
  std::string error;
  if (ec) {
    log_->error("cannot create {}: {}", config_->daemon.run_dir, ec.message());
    return false;
  }
  if (!run_dir_lock_.acquire(config_->daemon.run_dir, &error)) {
    log_->error("{}", error);
    return false;
  }
  return true;
}

// The run dir is for the tenants' processes too: on the host, and in the
// containers given its tenant directories by their host paths. A daemon in a
// mount namespace of its own may see a directory there that nobody else does
// (systemd's PrivateTmp with a run_dir under /tmp; a tmpfs mounted for the
// daemon alone); it then works, and every tenant process finds no ledger.
// PID 1 sees the node's mounts (or, in a container without the host's PIDs,
// the container's, which are the daemon's): where the directory at the same
// path through its root is another one, or none, say so. Unreadable (not
// root, /proc mounted with hidepid): nothing is known, nothing said.
void Daemon::check_run_dir_is_shared() {
  const std::string& dir = config_->daemon.run_dir;
  struct stat ours {}, init {};
  if (stat(dir.c_str(), &ours) != 0) return;
  const std::string through_init = "/proc/1/root" + dir;
  std::string found;
  if (stat(through_init.c_str(), &init) == 0) {
    if (init.st_dev == ours.st_dev && init.st_ino == ours.st_ino) return;
    found = "another directory is there";
  } else if (errno == ENOENT || errno == ENOTDIR) {
    found = "nothing is there";
  } else {
    return;
  }
  log_->error("run dir {} is this daemon's alone: outside its mount namespace ({}), {}; tenant processes there "
              "cannot reach its ledgers. Keep run_dir where the node's processes see it (under the shipped "
              "systemd unit, which gives the daemon a /tmp of its own and a read-only file system: under "
              "/run/fracgpu)",
              dir, through_init, found);
}

// The pid file's lock is what the CLI probes to tell whether a daemon runs
// (and which); the kernel drops it when the daemon dies, however it dies.
// The run dir's lock, taken before, is what keeps a second daemon out even
// when this file has been removed. So a read lock on the pid file is not
// another daemon's: the file is 0644, and any user may hold one. We then put
// a new file in its place, once; the old inode and its stray lock stay with
// whoever holds them, and nobody can lock the new file against us once we
// hold its write lock.
bool Daemon::lock_pid_file() {
  const std::string path = (fs::path(config_->daemon.run_dir) / kPidFileName).string();
  const char* dir = config_->daemon.run_dir.c_str();
  for (int attempt = 0; attempt < 2; ++attempt) {
    char err[512] = {};
    const shm::FileStatus created =
        shm::create_file_at(run_.root.get(), kPidFileName, 0644, 0, nullptr, nullptr, dir, nullptr, err, sizeof err);
    shm::Opened pid_file{};
    if (created == shm::FileStatus::kOk || created == shm::FileStatus::kExists)
      pid_file = shm::open_file_at(run_.root.get(), kPidFileName, O_RDWR, geteuid(), -1, dir, err, sizeof err);
    else
      pid_file.status = created;
    if (!pid_file.ok()) {
      log_->error("cannot open the pid file: {}", err);
      return false;
    }
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(pid_file.fd, F_SETLK, &fl) == 0) {
      pid_fd_ = pid_file.fd;
      const std::string pid = fmt::format("{}\n", getpid());
      if (ftruncate(pid_fd_, 0) != 0 || pwrite(pid_fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size()))
        log_->warn("cannot write {}: {}", path, strerror(errno));
      return true;
    }
    const int e = errno;
    struct flock probe {};
    probe.l_type = F_WRLCK;
    probe.l_whence = SEEK_SET;
    const bool held = (e == EAGAIN || e == EACCES) && fcntl(pid_file.fd, F_GETLK, &probe) == 0 && probe.l_type != F_UNLCK;
    ::close(pid_file.fd);  // not locked: nothing of ours to empty
    if (!held) {
      log_->error("cannot lock {}: {}", path, strerror(e));
      return false;
    }
    if (probe.l_type == F_WRLCK) {
      // A write lock needs the file open for writing, which only its owner
      // can do: a daemon of an older release that locked the run dir
      // itself, not this one's lock directory.
      log_->error("another fracgpud (pid {}) already manages {}", probe.l_pid, config_->daemon.run_dir);
      return false;
    }
    if (attempt == 0) {
      log_->warn("process {} holds a lock on {}, which is not a daemon's (this daemon holds the run dir's lock); "
                 "putting a new pid file in its place",
                 probe.l_pid, path);
      if (unlinkat(run_.root.get(), kPidFileName, 0) != 0 && errno != ENOENT) {
        log_->error("cannot replace {}: {}", path, strerror(errno));
        return false;
      }
    } else {
      log_->error("process {} holds a lock on the new {} too; giving up", probe.l_pid, path);
    }
  }
  return false;
}

// The generation of policy in force, for the whole node (ledger_layout.h).
// A node file of another layout, or another program's, is not ours to fix.
// A missing one is created at generation 0; the first commit then goes above
// every stamp the policies hold (ledger::next_generation). It is never taken
// from a tenant directory: a container may be able to write there.
bool Daemon::open_node_file() {
  char err[512] = {};
  const ledger::LedgerError rc = ledger::open_node(config_->daemon.run_dir.c_str(), &node_, &node_fd_, err, sizeof err);
  if (rc != ledger::LedgerError::kOk) {
    log_->error("cannot use the node file ({}): {}", ledger::ledger_error_name(rc), err);
    return false;
  }
  log_->debug("node file {}/{}: generation {} in force", config_->daemon.run_dir, ledger::kNodeFileName,
              node_->committed.load(std::memory_order_acquire));
  return true;
}

namespace {

bool same_inode(const struct stat& a, const struct stat& b) { return a.st_ino == b.st_ino && a.st_dev == b.st_dev; }

// True if `name` in the directory `dir` is, itself (never through a link),
// the file open at `fd`.
bool names_file(int dir, const char* name, int fd) {
  struct stat by_name {}, open_file {};
  return fstatat(dir, name, &by_name, AT_SYMLINK_NOFOLLOW) == 0 && fstat(fd, &open_file) == 0 &&
         same_inode(by_name, open_file);
}

}  // namespace

bool Daemon::link_node(const std::string& tenant, const OpenLedger& open) {
  if (names_file(open.dir_fd.get(), ledger::kNodeFileName, node_fd_)) return true;
  const std::string target = (fs::path(config_->daemon.run_dir) / ledger::kNodeFileName).string();
  // Whatever has the name is replaced by a rename, never written through or followed.
  std::string error;
  if (link_replacing(AT_FDCWD, target.c_str(), open.dir_fd.get(), ledger::kNodeFileName, run_.private_dir.get(),
                     &error))
    return true;
  log_->error("tenant \"{}\": cannot link {}/{} to {}: {}; tenant skipped (its processes are denied GPU access)",
              tenant, open.dir, ledger::kNodeFileName, target, error);
  return false;
}

Daemon::OpenLedger* Daemon::adopt(const std::string& name, bool create) {
  if (auto it = ledgers_.find(name); it != ledgers_.end()) {
    // Still the same files? Someone may have removed the directory; then a
    // fresh ledger is made (or, for a tenant no longer configured, dropped).
    const OpenLedger& known = it->second;
    struct stat dir_by_path {}, dir_open {};
    const std::string policy_path = known.dir + "/" + ledger::kPolicyFileName;
    const std::string node_path = known.dir + "/" + ledger::kNodeFileName;
    if (fstatat(run_.tenants.get(), name.c_str(), &dir_by_path, AT_SYMLINK_NOFOLLOW) == 0 &&
        fstat(known.dir_fd.get(), &dir_open) == 0 && same_inode(dir_by_path, dir_open) &&
        names_file(known.dir_fd.get(), ledger::kPolicyFileName, known.ledger.policy_fd) &&
        names_file(known.dir_fd.get(), ledger::kNodeFileName, node_fd_) && known.ledger.node_fd >= 0 &&
        names_file(known.dir_fd.get(), ledger::kNodeFileName, known.ledger.node_fd))
      return &it->second;
    log_->warn("tenant \"{}\": {} or {} was replaced or removed; re-opening", name, policy_path, node_path);
    ledger::close_ledger(&it->second.ledger);
    ledgers_.erase(it);
  }
  const std::string dir = (fs::path(config_->daemon.run_dir) / kTenantsDirName / name).string();
  const std::string tenants = (fs::path(config_->daemon.run_dir) / kTenantsDirName).string();
  OpenLedger open;
  open.dir = dir;
  char err[512] = {};
  // The tenant's directory is the daemon's, 0755: its containers mount it
  // read-only (docs/containers.md), so none of its names can be planted or
  // replaced from inside; and its files are opened by name, never followed.
  bool mode_fixed = false;
  const shm::Opened dir_fd =
      create ? shm::make_dir_at(run_.tenants.get(), name.c_str(), 0755, geteuid(), tenants.c_str(), &mode_fixed, err,
                                sizeof err)
             : shm::open_dir_at(run_.tenants.get(), name.c_str(), geteuid(), false, tenants.c_str(), err, sizeof err);
  if (!dir_fd.ok()) {
    log_->error("tenant \"{}\": directory refused and tenant skipped: {}", name, err);
    return nullptr;
  }
  open.dir_fd.reset(dir_fd.fd);
  if (mode_fixed) log_->warn("tenant \"{}\": {} was writable by others: its mode is 0755 again", name, dir);
  struct stat policy_stat {};
  if (!create && fstatat(open.dir_fd.get(), ledger::kPolicyFileName, &policy_stat, AT_SYMLINK_NOFOLLOW) != 0)
    return nullptr;
  // The node file goes in first: a process finding the policy finds it too.
  if (!link_node(name, open)) return nullptr;
  const ledger::LedgerError rc = ledger::open_ledger_at(open.dir_fd.get(), dir.c_str(), ledger::AccessMode::kDaemon,
                                                        geteuid(), name.c_str(), &open.ledger, err, sizeof err);
  if (rc != ledger::LedgerError::kOk) {
    // Foreign, corrupt, of another version, or not a regular file of ours
    // (a link or FIFO where a file should be): not ours to repair or delete
    // (it may hold state someone needs). The tenant stays without service
    // until an operator fixes it and sends SIGHUP.
    log_->error("tenant \"{}\": ledger left alone and tenant skipped ({}): {}", name,
                ledger::ledger_error_name(rc), err);
    return nullptr;
  }
  ledger::PolicySegment& policy = *open.ledger.policy;
  const std::string stamped = stamped_name(policy);
  if (stamped.empty() && name.size() < sizeof policy.tenant) {
    memcpy(policy.tenant, name.c_str(), name.size() + 1);  // a zero-filled (fresh) policy: name it
  } else if (stamped != name) {
    log_->error("tenant \"{}\": ledger left alone and tenant skipped: {} belongs to tenant \"{}\"", name, dir, stamped);
    ledger::close_ledger(&open.ledger);
    return nullptr;
  }
  log_->debug("tenant \"{}\": ledger {} open", name, dir);
  return &ledgers_.emplace(name, std::move(open)).first->second;
}

void Daemon::apply(const NodeConfig& config) {
  std::set<std::string> wanted;
  for (const Tenant& tenant : config.tenants) {
    wanted.insert(tenant.name);
    OpenLedger* open = adopt(tenant.name, /*create=*/true);
    if (open != nullptr) open->configured = true;
  }
  // Ledgers of tenants not (or no longer) in the config, including those left
  // by an earlier run: revoke their GPUs but keep the directory and keep
  // reaping, since their processes may still run.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(config.daemon.run_dir) / kTenantsDirName, ec)) {
    const std::string name = entry.path().filename().string();
    if (!wanted.contains(name) && entry.is_directory(ec)) adopt(name, /*create=*/false);
  }
  if (ec) log_->warn("cannot list {}/{}: {}", config.daemon.run_dir, kTenantsDirName, ec.message());
  // At start, the quotas in force are those the previous daemon applied, in
  // the ledgers it left: a config that lowers one is a shrink as a reload's
  // is, and what the tenant's processes hold stays theirs.
  if (!quotas_in_force_read_) {
    note_quotas_in_force(config);
    quotas_in_force_read_ = true;
  }
  note_shrinks(config);
  for (auto& [name, open] : ledgers_) {
    if (wanted.contains(name)) continue;
    if (open.configured) log_->info("tenant \"{}\" is no longer configured: revoking its GPUs, keeping {}", name, open.dir);
    open.configured = false;
  }
  // The record first: whoever sees a new grant in a ledger (`fracgpu status`,
  // a test) then finds the reason for it, never the last placement's.
  record_placement(config);
  commit_policies(config);
  apply_gpu_time(config);
  apply_unavailable();
}

void Daemon::commit_policies(const NodeConfig& config) {
  struct Plan {
    const std::string* name;
    OpenLedger* open;
    ledger::GpuTable before;  // its latest table (the one in force, if readable)
    ledger::GpuTable after;
  };
  std::vector<Plan> plans;
  bool changed = false;
  for (auto& [name, open] : ledgers_) {
    Plan plan{&name, &open, {}, {}};
    ledger::GpuTable in_force;
    const bool readable = ledger::read_gpu_table(open.ledger, &in_force);
    ledger::latest_gpu_table(open.ledger, &plan.before);
    std::string error;
    if (!plan_policy(plan.before, open.configured ? config.find_tenant(name) : nullptr, config, &plan.after, &error))
      log_->error("{}", error);
    // A tenant whose readers see no copy of the generation in force (a new
    // one, or after the node file was recreated) needs one as well.
    changed |= !readable || !std::equal(std::begin(in_force.gpus), std::end(in_force.gpus), std::begin(plan.after.gpus));
    plans.push_back(std::move(plan));
  }
  if (!changed) return;
  const uint64_t previous = node_->committed.load(std::memory_order_acquire);
  uint64_t next = previous + 1;
  for (const Plan& plan : plans) next = ledger::next_generation(next, plan.open->ledger);
  for (Plan& plan : plans) {
    GpuPolicy* gpus = ledger::begin_policy_copy(plan.open->ledger, next);
    for (uint32_t g = 0; g < kMaxGpus; ++g) ledger::store_gpu_entry(gpus[g], plan.after.gpus[g]);
    ledger::end_policy_copy(plan.open->ledger, next);
  }
  // The commit point: before this store every tenant reads the old copies,
  // after it every tenant the new ones.
  ledger::commit_generation(*node_, next);
  for (Plan& plan : plans) ledger::retire_policy_copy(plan.open->ledger, previous);
  for (const Plan& plan : plans) {
    const Tenant* tenant = plan.open->configured ? config.find_tenant(*plan.name) : nullptr;
    for (uint32_t g = 0; g < kMaxGpus; ++g) {
      const ledger::GpuEntry& before = plan.before.gpus[g];
      const ledger::GpuEntry& after = plan.after.gpus[g];
      if (before == after) continue;
      if (after.state == ledger::kGpuRevoked && before.state == ledger::kGpuGranted) {
        log_->info("tenant \"{}\": revoked GPU {}", *plan.name, format_gpu_uuid(after.uuid));
        continue;
      }
      for (const Grant& grant : tenant != nullptr ? tenant->grants : std::vector<Grant>{})
        if (memcmp(config.gpus[grant.gpu].uuid_bytes.data(), after.uuid, sizeof after.uuid) == 0)
          log_->info("tenant \"{}\": granted {}", *plan.name, describe_grant(config, grant));
    }
  }
  log_->info("policy generation {} committed on {} tenant ledger(s)", next, plans.size());
}

Daemon::GpuArbiter* Daemon::open_arbiter(const ManagedGpu& gpu) {
  if (auto it = arbiters_.find(gpu.uuid); it != arbiters_.end()) return &it->second;
  const fs::path dir = fs::path(config_->daemon.run_dir) / gputime::kGpusDirName / gpu.uuid;
  // Made and checked one level at a time (run_dir.h): the daemon's own.
  std::string why;
  const UniqueFd gpus = make_daemon_dir(run_.root.get(), config_->daemon.run_dir, gputime::kGpusDirName, &why);
  const UniqueFd own = gpus.valid() ? make_daemon_dir(gpus.get(), dir.parent_path().string(), gpu.uuid.c_str(), &why)
                                    : UniqueFd();
  if (!own.valid()) {
    log_->error("GPU {}: {}; its time is not shared", gpu.index, why);
    return nullptr;
  }
  GpuArbiter entry;
  entry.path = (dir / gputime::kGpuTimeFileName).string();
  char err[512] = {};
  const ledger::LedgerError rc =
      gputime::open_arbiter(entry.path.c_str(), true, false, gpu.uuid_bytes.data(), &entry.arbiter, err, sizeof err);
  if (rc != ledger::LedgerError::kOk) {
    // Not ours to repair: processes may be using it. Time on this GPU is
    // not shared until an operator moves it away and sends SIGHUP.
    log_->error("GPU {}: GPU-time arbiter left alone ({}): {}; its time is not shared", gpu.index,
                ledger::ledger_error_name(rc), err);
    return nullptr;
  }
  log_->debug("GPU {}: GPU-time arbiter {} open", gpu.index, entry.path);
  entry.scheduler = std::make_unique<GpuScheduler>(*entry.arbiter.seg, gpu.uuid_bytes.data(),
                                                   fmt::format("GPU {}", gpu.index));
  entry.scheduler->adopt(monotonic_ns());
  return &arbiters_.emplace(gpu.uuid, std::move(entry)).first->second;
}

// <tenant dir>/gputime-<entry> must be the arbiter itself (same inode): the
// tenant's processes reach it only through their own directory.
void Daemon::link_arbiter(const std::string& tenant, const OpenLedger& open, const GpuArbiter& arbiter, int entry) {
  const std::string name = fmt::format("{}{}", kGpuTimeLinkPrefix, entry);
  const std::string link = fmt::format("{}/{}", open.dir, name);
  if (names_file(open.dir_fd.get(), name.c_str(), arbiter.arbiter.fd)) return;
  // Whatever has the name (a link or FIFO planted there, an old arbiter's
  // link) is replaced by a rename, never written through or followed.
  std::string error;
  if (!link_replacing(AT_FDCWD, arbiter.path.c_str(), open.dir_fd.get(), name.c_str(), run_.private_dir.get(),
                      &error)) {
    log_->error("tenant \"{}\": cannot link {} to {}: {}; its GPU time there is not shared", tenant, link,
                arbiter.path, error);
    return;
  }
  log_->debug("tenant \"{}\": {} -> {}", tenant, link, arbiter.path);
}

void Daemon::apply_gpu_time(const NodeConfig& config) {
  const uint64_t slice_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(config.daemon.time_slice).count());
  // Tenants with live processes: their GPU-time rows stay theirs even where
  // they are no longer configured (their processes keep the row they were
  // given; another tenant bound to it would share its grants). For those not
  // configured, the record locks are probed: at start nothing has been
  // reaped yet, so the daemon's own count (tenant_processes) is still empty.
  std::set<std::string> in_use;
  for (const auto& [pid, name] : tenant_processes()) in_use.insert(name);
  std::set<std::string> configured;
  for (const Tenant& tenant : config.tenants) configured.insert(tenant.name);
  for (const auto& [name, open] : ledgers_)
    if (!configured.contains(name) && !in_use.contains(name) && live_processes(name) != 0) in_use.insert(name);
  for (const ManagedGpu& gpu : config.gpus) {
    GpuArbiter* arbiter = open_arbiter(gpu);
    if (arbiter == nullptr) continue;
    // Who shares this GPU, and where the scheduler reads what each asks:
    // the tenant's usage file, at this GPU's entry of its policy.
    std::vector<SchedulerTenant> tenants;
    for (const Tenant& tenant : config.tenants) {
      for (const Grant& grant : tenant.grants) {
        if (config.gpus[grant.gpu].uuid != gpu.uuid) continue;
        SchedulerTenant t{tenant.name, grant.share_ppm, grant.limit_ppm};
        t.priority = static_cast<uint32_t>(tenant.priority);
        if (auto it = ledgers_.find(tenant.name); it != ledgers_.end()) {
          t.entry = ledger::find_gpu(it->second.ledger, gpu.uuid_bytes.data());
          t.usage_fd = it->second.ledger.usage_fd;
          if (t.entry >= 0) link_arbiter(tenant.name, it->second, *arbiter, t.entry);
        }
        tenants.push_back(std::move(t));
      }
    }
    arbiter->scheduler->configure(tenants, slice_ns, in_use);
    arbiter->scheduler->set_measured_charging(config.daemon.gpu_time_measured);
    arbiter->scheduler->start();
  }
  // A GPU no longer configured is no longer shared: its scheduler stops
  // (its processes, told at once, run unshared), as after a restart with
  // this config, which would not open its arbiter at all.
  for (auto it = arbiters_.begin(); it != arbiters_.end();) {
    const bool configured_gpu = std::any_of(config.gpus.begin(), config.gpus.end(),
                                            [&](const ManagedGpu& gpu) { return gpu.uuid == it->first; });
    if (configured_gpu) {
      ++it;
      continue;
    }
    log_->info("GPU {}: no longer configured; its time is no longer shared", it->first);
    stop_and_close(it->second);
    it = arbiters_.erase(it);
  }
  attach_meters();
  configure_side_by_side();
}

void Daemon::configure_side_by_side() {
  // Side by side needs a driver that time-slices contexts: compute
  // preemption, compute capability 6.0 and later (docs/sm-time.md). Asked
  // once per GPU; without NVML it is not known, and tenants take turns.
  for (auto& [uuid, arbiter] : arbiters_) {
    if (arbiter.compute_major == 0 && nvml_ != nullptr && nvml_->api().get_compute_capability != nullptr) {
      nvmlDevice_t device = nullptr;
      int major = 0, minor = 0;
      if (nvml_->api().get_handle_by_uuid(uuid.c_str(), &device) == NVML_SUCCESS &&
          nvml_->api().get_compute_capability(device, &major, &minor) == NVML_SUCCESS && major > 0) {
        arbiter.compute_major = major;
        if (config_.has_value() && config_->daemon.side_by_side && !config_->daemon.gpu_time_measured)
          log_->info("GPU {}: compute capability {}.{}: {}", uuid, major, minor,
                     major >= 6 ? "the driver time-slices contexts, so light tenants of equal shares hold it side "
                                  "by side (side_by_side)"
                                : "no compute preemption, so tenants always take turns on it");
      }
    }
    const bool allowed = config_.has_value() && config_->daemon.side_by_side && !config_->daemon.gpu_time_measured;
    arbiter.scheduler->set_side_by_side(allowed, arbiter.compute_major >= 6);
  }
}

void Daemon::attach_meters() {
  if (nvml_ == nullptr) return;
  if (nvml_->api().get_process_utilization == nullptr) {
    if (!arbiters_.empty())
      log_->warn("NVML lacks nvmlDeviceGetProcessUtilization: GPU time is charged as held, one tenant at a time");
    return;
  }
  for (auto& [uuid, arbiter] : arbiters_) {
    if (arbiter.scheduler->has_meter()) continue;
    nvmlDevice_t device = nullptr;
    if (nvmlReturn_t rc = nvml_->api().get_handle_by_uuid(uuid.c_str(), &device); rc != NVML_SUCCESS) {
      log_->warn("GPU {}: NVML has no handle for it ({}): its time is charged as held", uuid, nvml_->describe(rc));
      continue;
    }
    arbiter.scheduler->set_meter(std::make_unique<NvmlMeter>(*nvml_, device));
    if (config_.has_value() && config_->daemon.gpu_time_measured)
      log_->info("GPU {}: GPU time charged as NVML measures it (per-process utilization; gpu_time_charging = "
                 "\"measured\")", uuid);
    else
      log_->info("GPU {}: GPU time charged as held, audited by NVML's per-process samples", uuid);
  }
}

void Daemon::log_outside_gate(uint32_t pid, const std::string& where, const std::set<std::string>& tenants) const {
  if (tenants.size() == 1)
    log_->warn("GPU time: process {} runs on {} outside fracgpu's gate (no interposer): charged to tenant \"{}\", "
               "whose container it is in", pid, where, *tenants.begin());
  else
    log_->warn("GPU time: process {} runs on {} outside fracgpu's gate (no interposer): charged to tenants \"{}\" in "
               "equal parts, the claims of its container on that GPU", pid, where, fmt::join(tenants, "\", \""));
}

void Daemon::watch_gpu_processes(uint64_t now) {
  // Every process with a context on a GPU fracgpu schedules is in NVML's
  // list for as long as it has one, whatever its timing; the driver's
  // samples name only the process on the GPU at an instant, and are read
  // after it. A process outside the gate is attributed here, while it lives
  // (its container, by the kernel's account), and its record outlives it
  // (tick_gpu_time), so that the samples naming it are charged to its tenant
  // even when it is gone by the time they are read.
  if (nvml_ == nullptr || arbiters_.empty()) return;
  const std::map<int32_t, std::string> owners = tenant_processes();
  const auto self = static_cast<uint32_t>(getpid());
  // Where the tenants' verified processes run: read once a pass, and only
  // when a process needs attributing (most passes find none new).
  const ProcReader proc(config_->daemon.run_dir);
  std::optional<TenantContainers> containers;
  int attributed = 0;
  bool all_read = true;
  for (auto& [uuid, arbiter] : arbiters_) {
    // The process `pid` is listed on this GPU: stamped, and attributed there
    // if the GPU is new to its record (a container with claims on several
    // GPUs is a different tenant's on each). With no attribution left in
    // this pass, the GPU is left out until the next.
    const auto listed_here = [&](OutsideGate& o, uint32_t pid) {
      if (const auto on = o.gpus.find(uuid); on != o.gpus.end()) {
        on->second.listed_ns = now;
        return;
      }
      if (attributed >= kWatchAttributionsPerPass) return;
      ++attributed;
      if (!containers) containers.emplace(owners, proc);
      OutsideGate::OnGpu on{now, attribute_process_on_gpu(static_cast<int32_t>(pid), *containers,
                                                          config_->daemon.run_dir, uuid)};
      o.tenants.insert(on.tenants.begin(), on.tenants.end());
      o.gpus.emplace(uuid, std::move(on));
    };
    nvmlDevice_t handle = nullptr;
    std::vector<Nvml::Process> processes;
    if (nvml_->api().get_handle_by_uuid(uuid.c_str(), &handle) != NVML_SUCCESS ||
        nvml_->compute_processes(handle, &processes) != NVML_SUCCESS) {
      all_read = false;  // health reports it; nothing is found gone this pass
      continue;
    }
    for (const Nvml::Process& p : processes) {
      if (p.pid <= 1 || p.pid == self || owners.contains(static_cast<int32_t>(p.pid))) continue;
      const auto known = outside_gate_.find(p.pid);
      if (known != outside_gate_.end() && known->second.listed_ns == now) {
        listed_here(known->second, p.pid);  // on another GPU too
        continue;
      }
      const uint64_t start_time = process_start_time(static_cast<int32_t>(p.pid));
      if (start_time == 0) continue;  // gone already, or not visible here (the bypass audit says so)
      if (known != outside_gate_.end() && known->second.start_time == start_time) {
        known->second.listed_ns = now;
        known->second.gone_ns = 0;  // back on a GPU
        listed_here(known->second, p.pid);
        continue;
      }
      // New, or a new process behind a reused PID: attributed now. Bounded:
      // a tenant that starts processes faster waits for later passes.
      if (attributed >= kWatchAttributionsPerPass) continue;
      if (known == outside_gate_.end() && outside_gate_.size() >= kOutsideGateMax) continue;
      OutsideGate o;
      o.start_time = start_time;
      o.from_ns = start_on_monotonic_ns(start_time);
      o.from_ns = o.from_ns > kLifetimeMarginNs ? o.from_ns - kLifetimeMarginNs : 0;
      o.checked_ns = o.listed_ns = now;
      listed_here(o, p.pid);
      outside_gate_[p.pid] = std::move(o);
    }
  }
  // Off every GPU since the last pass (exited, or its context destroyed):
  // no later sample is of it. Off some of them (its context there
  // destroyed): the holders there no longer share their turns with it.
  if (all_read)
    for (auto& [pid, o] : outside_gate_) {
      if (o.listed_ns != 0 && o.listed_ns != now && o.gone_ns == 0) o.gone_ns = now;
      if (o.listed_ns == now) std::erase_if(o.gpus, [&](const auto& gpu) { return gpu.second.listed_ns != now; });
    }
}

void Daemon::tick_gpu_time(uint64_t now) {
  // Whose processes are whose, as this daemon verified them (host_pids,
  // never the tenant-writable copy): the meter's figures are charged by it.
  // Built once per tick, for every GPU's scheduler.
  std::map<std::string, std::vector<uint32_t>> pids_by_tenant;
  std::set<std::string> outside_tenants;  // with a process outside the gate
  // GPU (UUID) -> tenant -> its processes outside the gate that NVML lists
  // on that GPU now, in thousandths (a process several tenants are named
  // for counts a part to each).
  std::map<std::string, std::map<std::string, uint32_t>> listed_outside;
  std::map<uint32_t, GpuScheduler::PidLifetime> lifetimes;  // of those processes
  if (!arbiters_.empty()) {
    for (const auto& [name, open] : ledgers_) {
      std::vector<uint32_t>& pids = pids_by_tenant[name];
      for (const int32_t pid : open.host_pids)
        if (pid > 0) pids.push_back(static_cast<uint32_t>(pid));
    }
    // Processes the meters saw on a GPU that no ledger slot names, and
    // that the watch of NVML's process lists (watch_gpu_processes) did not
    // find: a process without the interposer. Whose it is, the kernel says
    // (the tenant directory mounted in its container: attribute_process, as
    // the audits use), never what it claims; its GPU time is its tenant's.
    // PID -> a GPU it was seen on: in a container with several claims, the
    // process is the tenant's whose policy holds that GPU.
    std::map<uint32_t, std::string> unknown;
    for (auto& [uuid, arbiter] : arbiters_)
      for (const uint32_t pid : arbiter.scheduler->unattributed_pids()) unknown.emplace(pid, uuid);
    std::set<uint32_t> verified;  // processes with a ledger slot: gated, whatever a record says
    for (const auto& [name, pids] : pids_by_tenant) verified.insert(pids.begin(), pids.end());
    // Each live entry is checked again once a second: unattributed then, it
    // is forgotten (and asked again when seen again); gone (or its PID
    // reused), it is kept kOutsideGoneKeepNs for the samples still to come.
    for (auto it = outside_gate_.begin(); it != outside_gate_.end();) {
      OutsideGate& o = it->second;
      if (verified.contains(it->first)) {
        it = outside_gate_.erase(it);
        continue;
      }
      if (o.gone_ns != 0) {
        it = now - o.gone_ns > kOutsideGoneKeepNs || o.tenants.empty() ? outside_gate_.erase(it) : std::next(it);
        continue;
      }
      if (now - o.checked_ns < 1'000'000'000ull) {
        ++it;
        continue;
      }
      o.checked_ns = now;
      if (process_start_time(static_cast<int32_t>(it->first)) != o.start_time) o.gone_ns = now;
      it = o.tenants.empty() ? outside_gate_.erase(it) : std::next(it);
    }
    std::map<int32_t, std::string> owners;
    for (const auto& [pid, seen_on] : unknown) {
      if (verified.contains(pid)) continue;
      const uint64_t start_time = process_start_time(static_cast<int32_t>(pid));
      if (start_time == 0) continue;
      const auto known = outside_gate_.find(pid);
      if (known != outside_gate_.end() && known->second.start_time == start_time) continue;
      if (known == outside_gate_.end() && outside_gate_.size() >= kOutsideGateMax) continue;
      if (owners.empty()) owners = tenant_processes();
      OutsideGate o;
      o.start_time = start_time;
      o.from_ns = start_on_monotonic_ns(start_time);
      o.from_ns = o.from_ns > kLifetimeMarginNs ? o.from_ns - kLifetimeMarginNs : 0;
      o.checked_ns = now;
      o.tenants = attribute_process_on_gpu(static_cast<int32_t>(pid), owners, config_->daemon.run_dir, seen_on);
      outside_gate_[pid] = std::move(o);
    }
    // A process several tenants are named for is in each one's list: the
    // scheduler splits its GPU time between them. Each one's samples count
    // within its lifetime only: a later process behind the same PID is not it.
    for (auto& [pid, o] : outside_gate_) {
      if (o.tenants.empty()) continue;
      if (o.gone_ns == 0) {
        // Said once for each GPU NVML lists it on (once, where only the
        // meters found it), of a process found alive at a tick (one that was
        // gone by then may have been a gated process between its start and
        // its slot's attach: it is charged alike, but not called a bypass).
        for (auto& [uuid, on] : o.gpus)
          if (!on.tenants.empty() && !std::exchange(on.logged, true)) log_outside_gate(pid, "GPU " + uuid, on.tenants);
        if (o.gpus.empty() && !std::exchange(o.logged, true)) log_outside_gate(pid, "a GPU", o.tenants);
      }
      lifetimes[pid] = {o.from_ns, o.gone_ns == 0 ? 0 : o.gone_ns + kLifetimeMarginNs};
      for (const std::string& t : o.tenants)
        if (ledgers_.contains(t)) {
          pids_by_tenant[t].push_back(pid);
          outside_tenants.insert(t);
        }
      if (o.listed_ns != 0 && o.gone_ns == 0)
        for (const auto& [uuid, on] : o.gpus)
          for (const std::string& t : on.tenants)
            if (ledgers_.contains(t)) listed_outside[uuid][t] += static_cast<uint32_t>(1000 / on.tenants.size());
    }
  }
  for (auto& [uuid, arbiter] : arbiters_) {
    arbiter.scheduler->attribute(pids_by_tenant, lifetimes);
    arbiter.scheduler->set_outside_tenants(outside_tenants);
    arbiter.scheduler->set_listed_outside(listed_outside[uuid]);
    arbiter.scheduler->sample_achieved(now);
    for (const SchedulerMessage& m : arbiter.scheduler->take_messages()) {
      if (m.warning)
        log_->warn("{}", m.text);
      else
        log_->info("{}", m.text);
    }
  }
}

void Daemon::reap(const std::string& name, OpenLedger& open) {
  ledger::UsageSegment& usage = *open.ledger.usage;
  // What each slot holds before reclaiming, to name what was reclaimed: the
  // ledger reports only totals.
  struct Held {
    int32_t pid;
    char comm[16];
    uint64_t bytes;
    bool candidate;
    bool freed;  // free after the reclaim
  };
  // The tenant can shrink its usage file under us: every access to it runs
  // guarded, and nothing in the guard may allocate (a fault jumps out of it).
  std::array<Held, kMaxSlots> held;
  uint32_t high = 0;
  ledger::ReclaimResult result;
  const bool ok = shm::sigbus_guarded([&] {
    high = std::min(usage.slot_high_water.load(std::memory_order_acquire), kMaxSlots);
    for (uint32_t s = 0; s < high; ++s) {
      Held& h = held[s];
      h.bytes = 0;
      for (uint32_t g = 0; g < kMaxGpus; ++g) h.bytes += usage.charges[g][s].load(std::memory_order_relaxed);
      h.candidate = h.bytes != 0 || usage.slots[s].state.load(std::memory_order_acquire) != ledger::kSlotFree;
      h.pid = usage.slots[s].pid.load(std::memory_order_relaxed);
      memcpy(h.comm, usage.slots[s].comm, sizeof h.comm);
      h.comm[sizeof h.comm - 1] = '\0';
    }
    result = ledger::reclaim_dead_slots(open.ledger, -1);
    for (uint32_t s = 0; s < high; ++s)
      held[s].freed = usage.slots[s].state.load(std::memory_order_acquire) == ledger::kSlotFree;
    ledger::record_host_pids(open.ledger, open.host_pids.data(), &open.owners_checked);
  });
  if (!ok) {
    // Closing the file also drops any slot lock the fault left us holding.
    mark_corrupt(name, open, "shrank while the daemon was reading it (its mappings fault)");
    return;
  }
  const int reclaimed = result.reclaimed;
  const uint64_t bytes = result.bytes;
  if (reclaimed <= 0) return;
  int named = 0;
  for (uint32_t s = 0; s < high; ++s) {
    if (!held[s].candidate || !held[s].freed) continue;
    log_->info("tenant \"{}\": reclaimed slot {} of dead process {} ({}): {} released", name, s, held[s].pid,
               escape_terminal(held[s].comm), format_size(held[s].bytes));
    ++named;
  }
  if (named != reclaimed)
    log_->info("tenant \"{}\": reclaimed {} dead process slot(s), {} released", name, reclaimed, format_size(bytes));
}

bool Daemon::usage_usable(const std::string& name, OpenLedger& open) {
  const std::string usage_path = open.dir + "/" + ledger::kUsageFileName;
  if (!open.corrupt.empty()) {
    // Valid again (restored, or removed: then made afresh)? Checked as at
    // adoption; on failure it stays as it is, logged once already.
    ledger::TenantLedger fresh;
    char err[512] = {};
    if (ledger::open_ledger_at(open.dir_fd.get(), open.dir.c_str(), ledger::AccessMode::kDaemon, geteuid(),
                               name.c_str(), &fresh, err, sizeof err) != ledger::LedgerError::kOk)
      return false;
    ledger::close_ledger(&open.ledger);
    open.ledger = fresh;
    open.corrupt.clear();
    open.corrupt_locks = UniqueFd();
    log_->log(open.corrupt_logged ? spdlog::level::info : spdlog::level::debug,
              "tenant \"{}\": {} is valid again; reclaiming resumes", name, usage_path);
  }
  // Still the file we map? Removed or replaced: re-opened next pass (a
  // missing one is made afresh).
  struct stat by_name {}, mapped {};
  if (fstatat(open.dir_fd.get(), ledger::kUsageFileName, &by_name, AT_SYMLINK_NOFOLLOW) != 0 ||
      fstat(open.ledger.usage_fd, &mapped) != 0 || by_name.st_ino != mapped.st_ino ||
      by_name.st_dev != mapped.st_dev) {
    mark_corrupt(name, open, "was removed or replaced");
    return false;
  }
  // The file is the tenant's to write, and its owner (root) is the tenant's
  // root where the container has no user namespace of its own, who can also
  // change its mode: a setuid or executable bit would make it a program the
  // tenant wrote, for the node's users to run. Put back the daemon's mode,
  // through the descriptor, never the name.
  if ((mapped.st_mode & 07777) != 0666 && fchmod(open.ledger.usage_fd, 0666) == 0)
    log_->warn("tenant \"{}\": {} had mode {:04o}: set back to 0666", name, usage_path, mapped.st_mode & 07777);
  uint64_t bytes = 0;
  switch (ledger::enforce_usage_size(open.ledger, &bytes)) {
    case ledger::UsageSize::kOk: return true;
    case ledger::UsageSize::kTruncated:
      log_->warn("tenant \"{}\": {} had grown to {} bytes (written past its end): cut back to its {} bytes", name,
                 usage_path, bytes, sizeof(ledger::UsageSegment));
      return true;
    case ledger::UsageSize::kShrunk:
      mark_corrupt(name, open,
                   fmt::format("shrank to {} bytes (the layout has {})", bytes, sizeof(ledger::UsageSegment)));
      return false;
    case ledger::UsageSize::kError: break;
  }
  mark_corrupt(name, open, fmt::format("cannot be checked: {}", strerror(errno)));
  return false;
}

void Daemon::mark_corrupt(const std::string& name, OpenLedger& open, const std::string& why) {
  constexpr uint64_t kMinute = 60'000'000'000ull;
  const uint64_t now = monotonic_ns();
  open.corrupt_logged = open.corrupt_logged_ns == 0 || now - open.corrupt_logged_ns >= kMinute;
  if (open.corrupt_logged) open.corrupt_logged_ns = now;
  log_->log(open.corrupt_logged ? spdlog::level::err : spdlog::level::debug,
            "tenant \"{}\": {}/{} {}: its ledger is corrupt; nothing is reclaimed there until it is valid again "
            "(checked every pass)",
            name, open.dir, ledger::kUsageFileName, why);
  if (open.ledger.usage_fd >= 0 && open.corrupt_locks.get() < 0)
    open.corrupt_locks = UniqueFd(fcntl(open.ledger.usage_fd, F_DUPFD_CLOEXEC, 0));
  ledger::close_usage(&open.ledger);
  open.corrupt = why;
}

void Daemon::tick() {
  const uint64_t now = monotonic_ns();
  // First: if anything below hangs (an NVML call), /healthz sees this go stale.
  metrics_.heartbeat(now);
  for (auto& [name, open] : ledgers_) {
    if (usage_usable(name, open))
      reap(name, open);
    else
      open.host_pids.fill(0);  // unreadable: its processes count as uncharged until it is valid again
    open.ledger.policy->daemon_heartbeat_ns.store(now, std::memory_order_release);
    open.ledger.policy->daemon_pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  }
  tick_gpu_time(now);
  check_gpus(now);
  // With NVML, after each memory audit (check_gpus), by the driver's count;
  // without, every pass, by the tenants' charges.
  if (nvml_ == nullptr) settle_shrinks();
  remove_drained();
  if (std::string why; metrics_.died(&why))
    log_->error("metrics: the endpoint's process {}; metrics are off until the next reload", why);
}

void Daemon::start_gpu_checks() {
  if (discovery_.nvml) {
    std::string problem;
    nvml_ = Nvml::open(options_.nvml_library.c_str(), &problem);
    if (nvml_ == nullptr) log_->warn("{}; GPU health, the bypass audit and the memory audit are off", problem);
  }
  health_ = std::make_unique<HealthMonitor>(nvml_.get(), discovery_.gpus, *log_, config_->daemon.run_dir);
  auditor_ = std::make_unique<Auditor>(nvml_.get(), discovery_.gpus, *log_);
  memory_auditor_ = std::make_unique<MemoryAuditor>(nvml_.get(), discovery_.gpus, *log_);
  if (nvml_ != nullptr) {
    // A default that stops processes: said at every start (docs/configuration.md).
    const MemoryAuditSettings& m = config_->daemon.memory_audit;
    log_->info("memory audit: processes no tenant owns (by cgroup, PID namespace, parent or mounts) may hold {} "
               "together on each managed GPU (unowned_memory_allowance); beyond it for {} ms: {} "
               "(memory_audit_action); node agents exempt by cgroup (node_agent_cgroups): {}",
               format_size(m.unowned_allowance), m.grace.count() / 1000, memory_audit_action_name(m.action),
               m.node_agent_cgroups.empty() ? std::string("none") : fmt::format("{}", fmt::join(m.node_agent_cgroups, ", ")));
  }
  attach_meters();
  configure_side_by_side();
  next_health_ns_ = next_audit_ns_ = next_memory_audit_ns_ = 0;  // all at the first tick
  marks_applied_ = false;
  if (nvml_ == nullptr) {
    // Written once, so `fracgpu status` says why there is no health data.
    std::string error;
    if (!write_node_checks(config_->daemon.run_dir, node_checks(), &error)) log_->warn("{}", error);
  }
}

NodeChecks Daemon::node_checks() const {
  NodeChecks checks;
  checks.nvml = nvml_ != nullptr;
  checks.nvml_problem = discovery_.nvml_problem;
  if (health_ != nullptr) checks.gpus = health_->gpus();
  if (config_) checks.audit_action = config_->daemon.audit_action;
  if (auditor_ != nullptr) checks.findings = auditor_->findings();
  if (config_) checks.memory_action = config_->daemon.memory_audit.action;
  if (memory_auditor_ != nullptr) checks.overuses = memory_auditor_->overuses();
  return checks;
}

void Daemon::check_gpus(uint64_t now) {
  if (health_ == nullptr) return;
  const auto ns = [](std::chrono::microseconds d) { return static_cast<uint64_t>(d.count()) * 1000; };
  const auto next_due = [&](uint64_t due, std::chrono::microseconds interval) {
    return next_check_ns(due, now, ns(interval));
  };
  if (nvml_ == nullptr) {
    // Nothing to probe or audit; but a GPU an earlier daemon fenced stays
    // fenced, and is let go when the operator clears the fence.
    if (now >= next_health_ns_) {
      // The first pass too: marks an earlier daemon left (an audit's deny,
      // a GPU it found lost) are not this one's, and nothing here would
      // ever change them.
      if (health_->probe() || !marks_applied_) {
        marks_applied_ = true;
        apply_unavailable();
        std::string error;
        if (!write_node_checks(config_->daemon.run_dir, node_checks(), &error)) log_->warn("{}", error);
      }
      next_health_ns_ = next_due(next_health_ns_, config_->daemon.health_interval);
    }
    return;
  }
  bool ran = false;
  if (now >= next_health_ns_) {
    health_->probe();
    next_health_ns_ = next_due(next_health_ns_, config_->daemon.health_interval);
    ran = true;
  }
  const bool audit = now >= next_audit_ns_, memory_audit = now >= next_memory_audit_ns_;
  const std::map<int32_t, std::string> owners = audit || memory_audit ? tenant_processes() : std::map<int32_t, std::string>{};
  if (audit) {
    auditor_->audit(owners, config_->daemon.audit_action, config_->daemon.run_dir);
    next_audit_ns_ = next_due(next_audit_ns_, config_->daemon.audit_interval);
    ran = true;
  }
  if (memory_audit) {
    std::set<std::string> managed;
    for (const ManagedGpu& gpu : config_->gpus) managed.insert(gpu.uuid);
    ran |= memory_auditor_->check(memory_owners(), memory_quotas(), config_->daemon.memory_audit,
                                  config_->daemon.run_dir, managed);
    settle_shrinks();
    next_memory_audit_ns_ = next_due(next_memory_audit_ns_, config_->daemon.memory_audit.interval);
  }
  if (ran) {
    // Every pass, not only on a change: the first pass after a start also
    // clears marks a previous daemon left for GPUs that are fine now.
    apply_unavailable();
    std::string error;
    if (!write_node_checks(config_->daemon.run_dir, node_checks(), &error)) log_->warn("{}", error);
  }
}

std::map<int32_t, std::string> Daemon::tenant_processes() const {
  // As tick() just found them (ledger::record_host_pids), whatever PID
  // namespace each process runs in.
  std::map<int32_t, std::string> owners;
  for (const auto& [name, open] : ledgers_)
    for (const int32_t pid : open.host_pids)
      if (pid > 0) owners.emplace(pid, name);
  return owners;
}

std::vector<TenantQuota> Daemon::memory_quotas() const {
  std::vector<TenantQuota> quotas;
  if (!config_) return quotas;
  std::set<std::pair<std::string, std::string>> listed;
  for (const Tenant& tenant : config_->tenants)
    for (const Grant& grant : tenant.grants) {
      const std::string& uuid = config_->gpus[grant.gpu].uuid;
      uint64_t quota = grant.memory_quota;
      if (const auto s = shrunk_.find({tenant.name, uuid}); s != shrunk_.end()) quota = std::max(quota, s->second);
      quotas.push_back({tenant.name, uuid, quota});
      listed.emplace(tenant.name, uuid);
    }
  // A GPU a resize dropped: what is still held there.
  for (const auto& [key, bytes] : shrunk_)
    if (!listed.contains(key)) quotas.push_back({key.first, key.second, bytes});
  return quotas;
}

ProcessOwners Daemon::memory_owners() const {
  ProcessOwners owners;
  for (const auto& [name, open] : ledgers_)
    for (const int32_t pid : open.host_pids)
      if (pid > 0) owners[pid].insert(name);
  return owners;
}

namespace {
// What a grant books of its GPU's memory: an unlimited quota, all of it.
uint64_t booked_memory(const Grant& grant, const ManagedGpu& gpu) {
  return grant.memory_quota == ledger::kUnlimited ? gpu.memory_bytes : grant.memory_quota;
}
}  // namespace

void Daemon::note_quotas_in_force(const NodeConfig& config) {
  for (auto& [name, open] : ledgers_) {
    ledger::GpuTable table;
    if (!ledger::read_gpu_table(open.ledger, &table)) continue;
    for (const ledger::GpuEntry& e : table.gpus) {
      if (e.state != ledger::kGpuGranted) continue;
      GpuUuid uuid{};
      memcpy(uuid.data(), e.uuid, uuid.size());
      const ManagedGpu* gpu = config.find_gpu(uuid);
      if (e.memory_quota == ledger::kUnlimited && gpu == nullptr) continue;
      applied_quotas_[{name, format_gpu_uuid(e.uuid)}] =
          e.memory_quota == ledger::kUnlimited ? gpu->memory_bytes : e.memory_quota;
    }
  }
}

void Daemon::note_shrinks(const NodeConfig& config) {
  std::map<std::pair<std::string, std::string>, uint64_t> next;
  for (const Tenant& tenant : config.tenants)
    for (const Grant& grant : tenant.grants)
      next[{tenant.name, config.gpus[grant.gpu].uuid}] = booked_memory(grant, config.gpus[grant.gpu]);
  bool changed = false;
  for (const auto& [key, before] : applied_quotas_) {
    const auto now = next.find(key);
    const uint64_t after = now == next.end() ? 0 : now->second;
    if (after >= before) continue;
    // Nothing can be held there: no process in the tenant's ledger, and none
    // the driver counts as the tenant's (a process without the interposer
    // holds memory too). Either cannot be told: kept.
    if (live_processes(key.first) == 0 && held_now(key) == uint64_t{0}) continue;
    uint64_t& may_hold = shrunk_[key];
    if (may_hold >= before) continue;
    may_hold = before;
    changed = true;
    log_->info("tenant \"{}\": memory on GPU {} {} {}; what its processes hold there stays theirs, and booked, "
               "until they free it (new charges see the new quota now)",
               key.first, key.second, now == next.end() ? "no longer granted, was" : "quota lowered from",
               now == next.end() ? format_size(before) : format_size(before) + " to " + format_size(after));
  }
  applied_quotas_ = std::move(next);
  // Raised in memory whether or not it is written: a failed write costs the
  // allowance at a restart, never capacity booked twice.
  if (changed) save_shrinks(shrunk_);
}

std::optional<uint64_t> Daemon::held_now(const TenantGpu& key) const {
  // The driver's count: every process the memory audit attributed to the
  // tenant (its verified slots, and processes of its container without the
  // interposer), whatever the tenant's own files say.
  if (memory_auditor_ != nullptr && memory_auditor_->held_read(key.second)) {
    const auto h = memory_auditor_->held().find(key);
    return h == memory_auditor_->held().end() ? 0 : h->second;
  }
  // No NVML, or that GPU unread: the tenant's own charges are all there is
  // to go by, read guarded (the tenant may shrink its usage file under us).
  const int live = live_processes(key.first);
  if (live == 0) return 0;
  const auto open = ledgers_.find(key.first);
  if (live < 0 || open == ledgers_.end() || open->second.ledger.usage == nullptr) return std::nullopt;
  uint8_t bytes[16];
  const int entry = ledger::parse_gpu_uuid_text(key.second, bytes) ? ledger::find_gpu(open->second.ledger, bytes) : -1;
  if (entry < 0) return 0;
  uint64_t held = 0;
  const ledger::UsageSegment& usage = *open->second.ledger.usage;
  if (!shm::sigbus_guarded([&] { held = ledger::tenant_used(usage, static_cast<uint32_t>(entry)); }))
    return std::nullopt;  // the next pass finds it corrupt (usage_usable)
  return held;
}

void Daemon::settle_shrinks() {
  if (shrunk_.empty()) return;
  std::map<TenantGpu, uint64_t> next = shrunk_;
  std::vector<TenantGpu> settled;
  for (auto it = next.begin(); it != next.end();) {
    const std::optional<uint64_t> held = held_now(it->first);
    if (!held) {
      ++it;  // cannot be told now
      continue;
    }
    const auto quota = applied_quotas_.find(it->first);
    const uint64_t now_allowed = quota == applied_quotas_.end() ? 0 : quota->second;
    it->second = std::min(it->second, *held);
    if (it->second > now_allowed) {
      ++it;
      continue;
    }
    settled.push_back(it->first);
    it = next.erase(it);
  }
  if (next == shrunk_) return;
  // On disk first: what this frees may be booked by the next request, and a
  // daemon killed after that must not come back with the old allowance.
  // Not written: nothing is lowered; the next pass tries again.
  if (!save_shrinks(next)) return;
  for (const auto& [tenant, uuid] : settled)
    log_->info("tenant \"{}\": what it holds on GPU {} fits its quota again; the rest is free", tenant, uuid);
  shrunk_ = std::move(next);
}

namespace {
constexpr const char* kShrunkFileName = "shrunk-quotas.json";
}  // namespace

bool Daemon::save_shrinks(const std::map<TenantGpu, uint64_t>& shrunk) {
  nlohmann::json held = nlohmann::json::array();
  for (const auto& [key, bytes] : shrunk) held.push_back({{"tenant", key.first}, {"gpu", key.second}, {"bytes", bytes}});
  const std::string text = nlohmann::json{{"version", 1}, {"held", std::move(held)}}.dump(2) + "\n";
  std::string error;
  if (!write_run_file(config_->daemon.run_dir, "", kShrunkFileName, text, &error, RunFileWrite::kDurable)) {
    // Once as a warning: a full disk fails every pass.
    log_->log(shrinks_unsaved_ ? spdlog::level::debug : spdlog::level::warn,
              "{}; until it can be written, shrunk quotas are lowered no further (nothing they hold is freed) and a "
              "restart would forget those raised since",
              error);
    shrinks_unsaved_ = true;
    return false;
  }
  if (shrinks_unsaved_) log_->info("{}/{} written again", config_->daemon.run_dir, kShrunkFileName);
  shrinks_unsaved_ = false;
  return true;
}

void Daemon::load_shrinks() {
  std::string why;
  bool missing = false;
  const std::optional<std::string> text = read_file_at(run_.root.get(), config_->daemon.run_dir, kShrunkFileName,
                                                       geteuid(), kMaxRunFileBytes, &why, &missing);
  if (!text) {
    if (!missing) log_->warn("{}; shrunk quotas are enforced as they are now", why);
    return;
  }
  const nlohmann::json doc = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  const auto held = doc.is_object() ? doc.find("held") : doc.end();
  const auto version = doc.is_object() ? doc.find("version") : doc.end();  // of any type: compared, never converted
  if (held == doc.end() || !held->is_array() || version == doc.end() || *version != 1) {
    log_->warn("{}/{}: not a file of shrunk quotas; ignored", config_->daemon.run_dir, kShrunkFileName);
    return;
  }
  for (const nlohmann::json& e : *held) {
    uint8_t uuid[16];
    if (!e.is_object() || !e.value("tenant", nlohmann::json()).is_string() ||
        !valid_tenant_name(e["tenant"].get<std::string>()) || !e.value("gpu", nlohmann::json()).is_string() ||
        !ledger::parse_gpu_uuid_text(e["gpu"].get<std::string>(), uuid) ||
        !e.value("bytes", nlohmann::json()).is_number_unsigned())
      continue;
    shrunk_[{e["tenant"].get<std::string>(), e["gpu"].get<std::string>()}] = e["bytes"].get<uint64_t>();
  }
  if (!shrunk_.empty()) log_->info("{} shrunk quota(s) read back: what those tenants hold stays theirs", shrunk_.size());
}

std::vector<GpuBook> Daemon::capacity_book(std::string_view except) const {
  std::vector<GpuBook> book = book_of(*config_, except);
  for (const auto& [key, may_hold] : shrunk_) {
    if (key.first == except) continue;
    for (size_t g = 0; g < config_->gpus.size(); ++g) {
      if (config_->gpus[g].uuid != key.second) continue;
      const auto quota = applied_quotas_.find(key);
      const uint64_t booked = quota == applied_quotas_.end() ? 0 : quota->second;
      if (may_hold > booked) book[g].shrunk_memory += may_hold - booked;
    }
  }
  return book;
}

void Daemon::apply_unavailable() {
  if (health_ == nullptr || !config_) return;
  const bool deny = config_->daemon.audit_action == AuditAction::kDeny;
  // Marks change outside reloads: both copies get them, so whichever is in
  // force now or after the next commit carries them. Logged for the copy in
  // force only.
  const uint64_t in_force = node_->committed.load(std::memory_order_acquire) & 1;
  for (auto& [name, open] : ledgers_) {
    for (uint32_t c = 0; c < 2; ++c) {
      for (GpuPolicy& e : open.ledger.policy->copies[c].gpus) {
        if (e.state.load(std::memory_order_acquire) == ledger::kGpuUnused) continue;
        const std::string uuid = format_gpu_uuid(e.uuid);
        uint32_t reason = ledger::kGpuAvailable, detail = 0;
        if (const GpuHealth* h = health_->find(uuid); h != nullptr && !h->healthy) {
          reason = h->reason;
          detail = h->detail;
        } else if (deny && auditor_ != nullptr) {
          for (const AuditFinding& f : auditor_->findings()) {
            if (f.tenant != name || f.gpu_uuid != uuid) continue;
            reason = ledger::kGpuBypassDenied;
            detail = static_cast<uint32_t>(f.pid);
          }
        }
        const uint32_t before = e.unavailable.load(std::memory_order_relaxed);
        if (before == reason && e.unavailable_detail.load(std::memory_order_relaxed) == detail) continue;
        // Detail first, reason last (release): a reader that sees the reason sees its detail.
        e.unavailable_detail.store(detail, std::memory_order_relaxed);
        e.unavailable.store(reason, std::memory_order_release);
        // Health changes are logged once per GPU by the probe; a denial is per tenant.
        if (c != in_force) continue;
        if (reason == ledger::kGpuBypassDenied)
          log_->warn("audit: tenant \"{}\": new processes on GPU {} are refused (process {} uses it uncharged)", name,
                     uuid, detail);
        else if (before == ledger::kGpuBypassDenied)
          log_->info("audit: tenant \"{}\": GPU {} accepts new processes again", name, uuid);
      }
    }
  }
}

bool Daemon::reload() {
  log_->info("SIGHUP: reloading {}", options_.config_path);
  // Which API tenants are placed goes with the config in force: a reload
  // refused below keeps both as they were.
  const std::map<std::string, std::string> unplaced_before = unplaced_;
  ConfigResult result = load_placing_what_fits(api_tenants_, /*placed_stay=*/true);
  if (result.ok() && !same_directory(result.config->daemon.run_dir, config_->daemon.run_dir))
    result.errors.push_back({options_.config_path, result.config->daemon.run_dir_line,
                             fmt::format("run_dir changed from {} to {}: restart fracgpud to move it",
                                         config_->daemon.run_dir, result.config->daemon.run_dir)});
  if (!result.errors.empty()) {
    unplaced_ = unplaced_before;
    for (const ConfigError& e : result.errors) log_->error("{}", e.to_string());
    log_->error("reload rejected ({} error(s)): the previous policy stays in force", result.errors.size());
    return false;
  }
  result.config->daemon.run_dir = config_->daemon.run_dir;  // the same directory, spelt as at start
  const std::string old_group = config_->daemon.control_group;
  config_ = std::move(result.config);
  if (std::string error; !control_.set_access(control_access(), &error))
    log_->error("control API: {}; the socket keeps its previous group and mode", error);
  else if (old_group != config_->daemon.control_group)
    log_->info("control API: group {}", config_->daemon.control_group.empty() ? "none (root and the daemon's user only)"
                                                                                : config_->daemon.control_group);
  if (!options_.log_level) set_log_level(*log_, config_->daemon.log_level);
  // A shorter health or audit interval takes effect now, not after the old one.
  const uint64_t now = monotonic_ns();
  const auto ns = [](std::chrono::microseconds d) { return static_cast<uint64_t>(d.count()) * 1000; };
  next_health_ns_ = std::min(next_health_ns_, now + ns(config_->daemon.health_interval));
  next_audit_ns_ = std::min(next_audit_ns_, now + ns(config_->daemon.audit_interval));
  next_memory_audit_ns_ = std::min(next_memory_audit_ns_, now + ns(config_->daemon.memory_audit.interval));
  apply(*config_);
  apply_metrics();
  log_->info("reload applied: {} tenant(s)", config_->tenants.size());
  return true;
}

int Daemon::run() {
  const sigset_t set = daemon_signals();
  const int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) {
    log_->error("signalfd: {}", strerror(errno));
    return kExitCannotStart;
  }
  uint64_t next_tick = monotonic_ns();
  const ControlServer::Handler handler = [this](const std::string& line, const ControlPeer& peer) {
    return handle_control(line, peer);
  };
  const ControlServer::Commit commit = [this] { commit_control_changes(); };
  std::vector<struct pollfd> fds;
  for (;;) {
    const uint64_t now = monotonic_ns();
    if (now >= next_tick) {
      tick();
      const auto interval = static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(config_->daemon.reap_interval).count());
      next_tick += interval;
      if (next_tick <= now) next_tick = now + interval;  // fell behind (suspend, slow disk): do not burst
      continue;
    }
    // The watch of the GPUs' process lists, between ticks: a process may
    // live shorter than a tick.
    const bool watching = nvml_ != nullptr && !arbiters_.empty();
    if (watching && now >= next_watch_ns_) {
      watch_gpu_processes(now);
      next_watch_ns_ = now + kWatchIntervalNs;
      continue;
    }
    const uint64_t next_due = watching ? std::min(next_tick, next_watch_ns_) : next_tick;
    // Woken by a signal, a control client, a client's deadline, the next tick or watch.
    const uint64_t wake = std::min(next_due, control_.next_deadline());
    const int timeout_ms = wake <= now ? 0 : static_cast<int>((wake - now + 999'999) / 1'000'000);
    fds.assign(1, {sfd, POLLIN, 0});
    control_.add_poll_fds(&fds);
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      log_->error("poll: {}", strerror(errno));
      ::close(sfd);
      return kExitCannotStart;
    }
    struct signalfd_siginfo info {};
    while (read(sfd, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
      if (info.ssi_signo == SIGHUP) {
        reload();
        continue;
      }
      log_->info("{}: stopping; ledgers stay in place for the next start", strsignal(static_cast<int>(info.ssi_signo)));
      ::close(sfd);
      control_.stop();
      close_all();
      return kExitOk;
    }
    // Never past the next tick or watch: the audits and reaping keep their period.
    control_.serve(monotonic_ns(), next_due, handler, commit);
  }
}

void Daemon::close_all() {
  for (auto& [name, open] : ledgers_) {
    // A clean stop says so: the CLI reports "stopped" rather than "hung".
    open.ledger.policy->daemon_pid.store(0, std::memory_order_release);
    ledger::close_ledger(&open.ledger);
  }
  ledgers_.clear();
  for (auto& [uuid, arbiter] : arbiters_) stop_and_close(arbiter);
  arbiters_.clear();
}

void Daemon::stop_and_close(GpuArbiter& arbiter) {
  arbiter.scheduler->stop();  // tells tenants at once that nobody schedules
  arbiter.scheduler.reset();
  gputime::close_arbiter(&arbiter.arbiter);
}

}  // namespace fracgpu::controller

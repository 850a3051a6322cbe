#include "state/status.h"

#include "config/api_tenant.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>


#include "daemon/health.h"
#include "gputime.h"
#include "ledger.h"
#include "state/run_dir.h"
#include "safe_file.h"
#include "sigbus_guard.h"
#include "common/text_escape.h"
#include "common/units.h"
#include "common/uuid.h"

namespace fracgpu::controller {
namespace {

using ledger::kMaxGpus;
using ledger::kMaxSlots;
using ledger::monotonic_ns;

std::string bounded(const char* text, size_t size) { return std::string(text, strnlen(text, size)); }

// What a GPU's arbiter says about the grant now, to read the tenant's
// processes' requests (in its usage file) against.
struct ArbiterView {
  bool present = false;
  std::string uuid;
  uint64_t seq = 0;       // the current grant's number
  bool tenant_holds = false;
};

// "wrong size: <path>: size is ..."; a refusal's message says what it is
// already ("<path>: refused: not a regular file (a FIFO)").
std::string describe(ledger::LedgerError rc, const char* err) {
  return rc == ledger::LedgerError::kRefused ? std::string(err)
                                             : fmt::format("{}: {}", ledger::ledger_error_name(rc), err);
}

// A copy of a shared segment, taken under shm::sigbus_guarded(): a file
// another party can shrink must not kill the CLI or the metrics child, and
// what is read from a copy cannot change (or fault) half way through.
template <typename Segment>
std::unique_ptr<Segment> guarded_copy(const Segment* mapped) {
  auto copy = std::make_unique<Segment>();  // before the guard: nothing inside may allocate
  const bool ok = shm::sigbus_guarded(
      [&] { memcpy(static_cast<void*>(copy.get()), static_cast<const void*>(mapped), sizeof(Segment)); });
  if (!ok) copy.reset();
  return copy;
}

// The tenant's standing in the GPU-time arbiter the daemon linked into its
// dir as gputime-<entry>. No link: gpu_time stays nullopt and there is no error.
ArbiterView read_gpu_time(const std::string& dir, const ledger::PolicySegment& policy, uint32_t entry,
                          const uint8_t uuid[16], GpuEntryStatus* out) {
  ArbiterView view;
  const std::string path = fmt::format("{}/{}{}", dir, kGpuTimeLinkPrefix, entry);
  gputime::Arbiter mapped;
  char err[512] = {};
  // With the entry's UUID: a link to another GPU's arbiter is refused. The
  // file is opened by name from the tenant's directory, never through a
  // link, never a FIFO (shm/safe_file.h): status must not hang on what a
  // tenant may have planted there.
  ledger::LedgerError rc = ledger::LedgerError::kOk;
  // open_arbiter validates the header through the mapping: guarded too (a
  // fault there leaves its descriptor and mapping behind, in a process that
  // reads status once, or a metrics child under attack: a leak, not a death).
  if (!shm::sigbus_guarded([&] {
        rc = gputime::open_arbiter(path.c_str(), false, true, uuid, &mapped, err, sizeof err);
      })) {
    out->gpu_time_error = fmt::format("corrupt: {}: shrank while being opened", path);
    return view;
  }
  if (rc == ledger::LedgerError::kMissing) return view;  // memory only, or a daemon without GPU-time arbiters
  if (rc != ledger::LedgerError::kOk) {
    out->gpu_time_error = describe(rc, err);
    return view;
  }
  // Read from a copy: what is read cannot change (or fault) half way through.
  const std::unique_ptr<gputime::GpuTimeSegment> copy = guarded_copy(mapped.seg);
  const auto done = [&] { gputime::close_arbiter(&mapped); };
  if (copy == nullptr) {
    out->gpu_time_error = fmt::format("corrupt: {}: shrank while being read", path);
    done();
    return view;
  }
  const gputime::GpuTimeSegment& seg = *copy;
  const int row = gputime::find_tenant(seg, policy.tenant);
  if (row < 0) {
    out->gpu_time_error =
        fmt::format("{}: tenant \"{}\" not listed", path, bounded(policy.tenant, sizeof policy.tenant));
    done();
    return view;
  }
  // All of it is the daemon's (the file is 0644, the tenants' mappings
  // read-only): shown as it stands.
  const gputime::TenantTime& t = seg.tenants[row];
  GpuTimeStatus g;
  g.achieved_1s_ppm = t.achieved_1s_ppm.load(std::memory_order_relaxed);
  g.achieved_10s_ppm = t.achieved_10s_ppm.load(std::memory_order_relaxed);
  g.used_ns = t.used_ns.load(std::memory_order_relaxed);
  g.measured = seg.daemon.charging.load(std::memory_order_relaxed) == gputime::kChargeMeasured;
  g.measured_ns = t.measured_ns.load(std::memory_order_relaxed);
  g.sample_period_ns = seg.daemon.sample_period_ns.load(std::memory_order_relaxed);
  g.out_of_grant_ns = t.out_of_grant_ns.load(std::memory_order_relaxed);
  g.out_of_grant_samples = t.out_of_grant_samples.load(std::memory_order_relaxed);
  g.held_ns = t.held_ns.load(std::memory_order_relaxed);
  g.throttled_ns = t.throttled_ns.load(std::memory_order_relaxed);
  g.slices = t.slices.load(std::memory_order_relaxed);
  g.tenants_sharing = seg.daemon.active_tenants.load(std::memory_order_relaxed);
  g.gated = gputime::gated(g.tenants_sharing, t.limit_ppm.load(std::memory_order_relaxed));
  g.waiting_processes = t.waiting_processes.load(std::memory_order_relaxed);
  g.missed_deadlines = t.missed_deadlines.load(std::memory_order_relaxed);
  g.blocked = (t.flags.load(std::memory_order_relaxed) & gputime::kTenantBlocked) != 0;
  g.side_by_side = (t.flags.load(std::memory_order_relaxed) & gputime::kTenantSideBySide) != 0;
  g.yields = (t.flags.load(std::memory_order_relaxed) & gputime::kTenantYields) != 0;
  g.takes_turns = (t.flags.load(std::memory_order_relaxed) & gputime::kTenantTakesTurns) != 0;
  const Priority priority = priority_of_stored(t.priority.load(std::memory_order_relaxed));
  g.priority = std::string(priority_name(priority));
  if (priority == Priority::kLatency) {
    g.wait_p50_ns = t.wait_p50_ns.load(std::memory_order_relaxed);
    g.wait_p99_ns = t.wait_p99_ns.load(std::memory_order_relaxed);
    g.wait_p999_ns = t.wait_p999_ns.load(std::memory_order_relaxed);
    g.waits = t.waits.load(std::memory_order_relaxed);
  }
  const uint64_t word = t.grant.load(std::memory_order_acquire);  // the tenant's own grant
  g.holding = gputime::grant_valid(word) && gputime::grant_state(word) != gputime::kGrantIdle &&
              gputime::grant_row(word) == static_cast<uint32_t>(row);
  out->gpu_time = g;
  view.present = true;
  view.uuid = out->uuid;
  view.seq = gputime::grant_seq(word);
  view.tenant_holds = g.holding;
  done();
  return view;
}

// One tenant's ledger, read from `tenants` (the run dir's tenants/, every
// entry of which must belong to `owner`, the daemon's user).
TenantStatus read_tenant(int tenants, const std::string& name, const std::string& tenants_shown, uid_t owner) {
  TenantStatus t;
  t.name = name;
  t.dir = tenants_shown + "/" + name;
  const std::string& dir = t.dir;
  char err[512] = {};
  const shm::Opened dir_fd = shm::open_dir_at(tenants, name.c_str(), owner, false, tenants_shown.c_str(), err, sizeof err);
  if (!dir_fd.ok()) {
    t.error = err;
    return t;
  }
  const UniqueFd dir_closer(dir_fd.fd);
  ledger::TenantLedger l;
  const ledger::LedgerError rc =
      ledger::open_ledger_at(dir_fd.fd, dir.c_str(), ledger::AccessMode::kReadOnly, owner, nullptr, &l, err, sizeof err);
  if (rc != ledger::LedgerError::kOk) {
    t.error = describe(rc, err);
    return t;
  }
  // The tenant can write (and shrink) its usage file: read it from a copy.
  const std::unique_ptr<ledger::PolicySegment> policy_copy = guarded_copy(l.policy);
  const std::unique_ptr<ledger::UsageSegment> usage_copy = guarded_copy(l.usage);
  if (policy_copy == nullptr || usage_copy == nullptr) {
    t.error = fmt::format("corrupt: {}/{}: shrank while being read", dir,
                          policy_copy == nullptr ? ledger::kPolicyFileName : ledger::kUsageFileName);
    ledger::close_ledger(&l);
    return t;
  }
  if (usage_copy->slot_high_water.load(std::memory_order_relaxed) > kMaxSlots) {
    t.error = fmt::format("corrupt: {}/{}: slot high-water mark out of range", dir, ledger::kUsageFileName);
    ledger::close_ledger(&l);
    return t;
  }
  const ledger::PolicySegment& policy = *policy_copy;
  const ledger::UsageSegment& usage = *usage_copy;
  t.heartbeat_ns = policy.daemon_heartbeat_ns.load(std::memory_order_acquire);
  t.daemon_pid = policy.daemon_pid.load(std::memory_order_acquire);
  // The table in force, read whole: never half of a reload in progress.
  ledger::GpuTable table;
  ledger::read_gpu_table(l, &table);
  t.generation = table.generation;
  std::string uuids[kMaxGpus];
  ArbiterView views[kMaxGpus];
  for (uint32_t g = 0; g < kMaxGpus; ++g) {
    const ledger::GpuEntry& e = table.gpus[g];
    if (e.state == ledger::kGpuUnused) continue;
    uuids[g] = format_gpu_uuid(e.uuid);
    GpuEntryStatus s;
    s.entry = g;
    s.uuid = uuids[g];
    s.state = e.state == ledger::kGpuGranted ? "granted" : "revoked";
    if (e.memory_quota != ledger::kUnlimited) s.memory_quota = e.memory_quota;
    s.memory_used = ledger::tenant_used(usage, g);
    s.context_memory = e.context_memory;
    s.share_ppm = e.share_ppm;
    s.limit_ppm = e.limit_ppm;
    s.count_managed = (e.flags & ledger::kCountManagedMemory) != 0;
    if (e.unavailable != ledger::kGpuAvailable)
      s.unavailable = unavailable_reason_name(static_cast<ledger::GpuUnavailableReason>(e.unavailable));
    views[g] = read_gpu_time(dir, policy, g, e.uuid, &s);
    t.gpus.push_back(std::move(s));
  }
  const uint32_t high = std::min(usage.slot_high_water.load(std::memory_order_acquire), kMaxSlots);
  for (uint32_t s = 0; s < high; ++s) {
    const ledger::ProcessSlot& slot = usage.slots[s];
    ProcessStatus p;
    p.slot = s;
    for (uint32_t g = 0; g < kMaxGpus; ++g) {
      const uint64_t bytes = usage.charges[g][s].load(std::memory_order_relaxed);
      if (bytes == 0) continue;
      p.charges.push_back({uuids[g].empty() ? format_gpu_uuid(table.gpus[g].uuid) : uuids[g], bytes});
      p.total_bytes += bytes;
    }
    if (slot.state.load(std::memory_order_acquire) == ledger::kSlotFree && p.total_bytes == 0) continue;
    const int32_t owner = ledger::slot_owner_pid(l, s);
    p.running = owner != 0;
    if (owner > 0) p.host_pid = owner;
    p.pid = slot.pid.load(std::memory_order_relaxed);
    p.comm = bounded(slot.comm, sizeof slot.comm);  // the tenant's bytes: escaped where shown (text_escape.h)
    // Its GPU-time requests: the process's own figures (display only; a
    // tenant can write anything there, and only about itself), from the copy.
    for (uint32_t g = 0; g < kMaxGpus; ++g) {
      if (!views[g].present) continue;
      const ledger::GpuTimeRequest& r = usage.gputime[g][s];
      const uint64_t entered = r.entered_grant.load(std::memory_order_relaxed);
      const uint64_t used = r.used_ns.load(std::memory_order_relaxed), waited = r.waited_ns.load(std::memory_order_relaxed);
      const bool waiting = p.running && r.want_since_ns.load(std::memory_order_relaxed) != 0;
      const bool holding = p.running && views[g].tenant_holds && entered == views[g].seq &&
                           r.drained_grant.load(std::memory_order_relaxed) != entered;
      if (used == 0 && waited == 0 && !waiting && !holding) continue;
      p.gpu_time.push_back({views[g].uuid, used, waited, waiting, holding});
    }
    t.processes.push_back(std::move(p));
  }
  ledger::close_ledger(&l);
  return t;
}

// The pid holding fracgpud's pid-file lock, if any: a daemon that runs but
// has no tenant to heartbeat in is still seen.
std::optional<int32_t> pid_file_holder(const RunDirView& run_dir) {
  const shm::Opened file =
      shm::open_file_at(run_dir.root.get(), kPidFileName, O_RDONLY, run_dir.owner, -1, "", nullptr, 0);
  if (!file.ok()) return std::nullopt;
  const int fd = file.fd;
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  const bool held = fcntl(fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
  ::close(fd);
  if (!held) return std::nullopt;
  return fl.l_pid;
}

DaemonStatus daemon_status(const StatusReport& report, const std::optional<int32_t>& holder) {
  DaemonStatus d;
  const TenantStatus* freshest = nullptr;
  for (const TenantStatus& t : report.tenants)
    if (t.error.empty() && t.heartbeat_ns != 0 && (freshest == nullptr || t.heartbeat_ns > freshest->heartbeat_ns))
      freshest = &t;
  if (freshest != nullptr) {
    const uint64_t now = monotonic_ns();
    d.heartbeat_age_ms = now > freshest->heartbeat_ns ? (now - freshest->heartbeat_ns) / 1'000'000 : 0;
    d.alive = *d.heartbeat_age_ms < kHeartbeatFreshMs && freshest->daemon_pid != 0;
    if (freshest->daemon_pid != 0) d.pid = freshest->daemon_pid;
  } else {
    d.alive = holder.has_value();
  }
  if (holder && *holder > 0) d.pid = holder;  // in our PID namespace, unlike the ledger's
  return d;
}

// A wait for the GPU: microseconds to milliseconds, where format_duration_ns
// would say "0.0 s".
std::string format_wait_ns(uint64_t ns) {
  if (ns < 1'000'000) return fmt::format("{:.0f} us", static_cast<double>(ns) / 1e3);
  if (ns < 1'000'000'000) return fmt::format("{:.2f} ms", static_cast<double>(ns) / 1e6);
  return format_duration_ns(ns);
}

// The health.json section: one row per GPU, then the bypass audit's findings.
std::string gpu_health_text(const nlohmann::json& h) {
  if (!h.value("nvml", false))
    return fmt::format("\nGPU health: off (no NVML: {})\n", escape_terminal(h.value("nvml_problem", std::string())));
  std::vector<std::vector<std::string>> rows{{"  GPU", "UUID", "HEALTH", "TEMP", "POWER", "ECC", "XIDS", "WHY"}};
  for (const auto& g : h.value("gpus", nlohmann::json::array())) {
    const int64_t temp = g.value("temperature_c", int64_t{-1}), mw = g.value("power_mw", int64_t{-1});
    const int64_t ecc = g.value("ecc_uncorrected", int64_t{-1});
    rows.push_back({fmt::format("  {}", g.value("index", 0)), g.value("uuid", std::string()),
                    g.value("healthy", true) ? "ok" : "UNHEALTHY", temp < 0 ? "-" : fmt::format("{}C", temp),
                    mw < 0 ? "-" : fmt::format("{}W", mw / 1000), ecc < 0 ? "-" : std::to_string(ecc),
                    std::to_string(g.value("xid_events", uint64_t{0})), g.value("why", std::string())});
  }
  std::string out = "\nGPU health (NVML):\n" + render_table(rows);
  const auto& audit = h.value("audit", nlohmann::json::object());
  const auto& findings = audit.value("findings", nlohmann::json::array());
  out += fmt::format("\nbypass audit (action {}): {}\n", escape_terminal(audit.value("action", std::string("report"))),
                     findings.empty() ? "no process uses a GPU uncharged" : "processes using a GPU uncharged:");
  if (!findings.empty()) {
    std::vector<std::vector<std::string>> frows{{"  PID", "COMMAND", "TENANT", "GPU", "MEMORY", "ACTION"}};
    for (const auto& f : findings)
      frows.push_back({fmt::format("  {}", f.value("pid", 0)), f.value("comm", std::string()),
                       f.value("tenant", std::string()).empty() ? "?" : f.value("tenant", std::string()),
                       std::to_string(f.value("gpu_index", 0)), format_size(f.value("bytes", uint64_t{0})),
                       f.value("action", std::string())});
    out += render_table(frows);
  }
  const auto& memory = h.value("memory_audit", nlohmann::json::object());
  const auto& overuses = memory.value("overuses", nlohmann::json::array());
  out += fmt::format("\nmemory audit (action {}): {}\n", memory.value("action", std::string("terminate")),
                     overuses.empty() ? "every tenant within its quota by the driver's count"
                                      : "tenants over their quota by the driver's count:");
  if (!overuses.empty()) {
    std::vector<std::vector<std::string>> orows{{"  TENANT", "GPU", "HELD", "ALLOWED", "QUOTA", "PROCS", "ACTION"}};
    for (const auto& o : overuses)
      orows.push_back({"  " + o.value("tenant", std::string()), std::to_string(o.value("gpu_index", 0)),
                       format_size(o.value("used", uint64_t{0})), format_size(o.value("allowed", uint64_t{0})),
                       format_size(o.value("quota", uint64_t{0})), std::to_string(o.value("processes", 0)),
                       o.value("action", std::string())});
    out += render_table(orows);
  }
  return out;
}

}  // namespace

// Every cell escaped (text_escape.h): process names, tenant and GPU names,
// error texts may all carry a tenant's bytes.
std::string render_table(std::vector<std::vector<std::string>> rows) {
  for (auto& row : rows)
    for (std::string& cell : row) cell = escape_terminal(cell);
  std::vector<size_t> width;
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], row[c].size());
    }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string format_share(uint32_t ppm) { return ppm == 0 ? "-" : format_gpus(ppm); }

// "0.4 s", "59.9 s", "12.5 min", "3.2 h": heartbeat ages and GPU times.
std::string format_duration_ms(uint64_t ms) {
  const double s = static_cast<double>(ms) / 1000.0;
  if (ms < 59'950) return fmt::format("{:.1f} s", s);
  if (ms < 3'597'000) return fmt::format("{:.1f} min", s / 60.0);
  return fmt::format("{:.1f} h", s / 3600.0);
}

std::string format_duration_ns(uint64_t ns) { return format_duration_ms(ns / 1'000'000); }

// "30.0%": an achieved share, a fraction of the window.
std::string format_ppm_percent(uint32_t ppm) { return fmt::format("{:.1f}%", ppm / 1e4); }

std::string daemon_summary(const DaemonStatus& d) {
  const std::string pid = d.pid ? fmt::format("pid {}", *d.pid) : "pid unknown";
  if (d.alive)
    return fmt::format("alive ({}{})", pid,
                       d.heartbeat_age_ms ? ", heartbeat " + format_duration_ms(*d.heartbeat_age_ms) + " ago" : "");
  if (d.heartbeat_age_ms)
    return fmt::format("NOT RUNNING{} (last heartbeat {} ago)", d.pid ? " or hung, " + pid : "",
                       format_duration_ms(*d.heartbeat_age_ms));
  return "NOT RUNNING";
}

std::vector<GpuRow> gpu_rows(const StatusReport& report) {
  std::vector<GpuRow> rows;
  for (const TenantStatus& t : report.tenants)
    for (const GpuEntryStatus& g : t.gpus) rows.push_back({&t, &g});
  std::stable_sort(rows.begin(), rows.end(),
                   [](const GpuRow& a, const GpuRow& b) { return a.gpu->uuid < b.gpu->uuid; });
  // Readable tenants without any GPU entry still get a row: they exist.
  for (const TenantStatus& t : report.tenants)
    if (t.error.empty() && t.gpus.empty()) rows.push_back({&t, nullptr});
  return rows;
}

bool StatusReport::all_ledgers_read() const {
  return std::all_of(tenants.begin(), tenants.end(), [](const TenantStatus& t) { return t.error.empty(); });
}

std::string default_run_dir() {
  const char* env = std::getenv("FRACGPU_RUN_DIR");
  return env != nullptr && *env != '\0' ? env : "/run/fracgpu";
}

std::optional<StatusReport> collect_status(const std::string& run_dir, std::string* error) {
  std::optional<RunDirView> view = open_run_dir_view(run_dir, error);
  if (!view) {
    *error += " (is fracgpud running? see --run-dir)";
    return std::nullopt;
  }
  StatusReport report;
  report.run_dir = run_dir;
  // Everything below belongs to the run dir's owner, the daemon's user.
  const std::string tenants_shown = run_dir + "/" + kTenantsDirName;
  char err[512] = {};
  const shm::Opened tenants =
      shm::open_dir_at(view->root.get(), kTenantsDirName, view->owner, false, run_dir.c_str(), err, sizeof err);
  if (!tenants.ok() && tenants.status != shm::FileStatus::kMissing) {
    *error = err;
    return std::nullopt;
  }
  if (tenants.ok()) {
    const UniqueFd tenants_fd(tenants.fd);
    DIR* listing = fdopendir(dup(tenants.fd));
    if (listing == nullptr) {
      *error = fmt::format("{}: {}", tenants_shown, strerror(errno));
      return std::nullopt;
    }
    while (const struct dirent* entry = readdir(listing)) {
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      // Directories are tenants; so is anything else that is not a plain
      // file (a link where a tenant should be is reported, not followed).
      if (entry->d_type == DT_REG) continue;
      struct stat st {};
      if (entry->d_type == DT_UNKNOWN && fstatat(tenants.fd, entry->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISREG(st.st_mode))
        continue;
      report.tenants.push_back(read_tenant(tenants.fd, name, tenants_shown, view->owner));
    }
    closedir(listing);
  }
  std::sort(report.tenants.begin(), report.tenants.end(),
            [](const TenantStatus& a, const TenantStatus& b) { return a.name < b.name; });
  report.daemon = daemon_status(report, pid_file_holder(*view));
  report.placement = read_placement_record(run_dir);
  std::string ignored;
  // Which tenants the control API made, and their state: the daemon's
  // record of them (api_tenant.h). Annotations are the API client's text.
  if (const std::optional<std::string> text =
          read_file_at(view->root.get(), run_dir, kApiTenantsFileName, view->owner, kMaxRunFileBytes, &ignored)) {
    if (const std::optional<ApiTenants> api = parse_api_tenants_file(*text, &ignored)) {
      for (TenantStatus& t : report.tenants) {
        const auto it = api->find(t.name);
        if (it == api->end()) continue;
        t.source = "api";
        t.state = it->second.draining ? "draining" : "active";
        t.annotations.insert(it->second.annotations.begin(), it->second.annotations.end());
      }
    }
  }
  if (const std::optional<std::string> text =
          read_file_at(view->root.get(), run_dir, kHealthFileName, view->owner, kMaxRunFileBytes, &ignored)) {
    nlohmann::json health = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (health.is_object()) report.gpu_health = std::move(health);
  }
  return report;
}

namespace {

nlohmann::ordered_json gpu_time_json(const std::optional<GpuTimeStatus>& time) {
  if (!time) return nullptr;
  const GpuTimeStatus& t = *time;
  nlohmann::ordered_json out = {{"achieved_1s_ppm", t.achieved_1s_ppm},
                                {"achieved_10s_ppm", t.achieved_10s_ppm},
                                {"used_ns", t.used_ns},
                                {"charging", t.measured ? "measured" : "held"},
                                {"audited", !t.measured && t.sample_period_ns != 0},
                                {"sample_period_ns", t.sample_period_ns},
                                {"measured_ns", t.measured_ns},
                                {"out_of_grant_ns", t.out_of_grant_ns},
                                {"out_of_grant_samples", t.out_of_grant_samples},
                                {"held_ns", t.held_ns},
                                {"throttled_ns", t.throttled_ns},
                                {"slices", t.slices},
                                {"holding", t.holding},
                                {"waiting_processes", t.waiting_processes},
                                {"tenants_sharing", t.tenants_sharing},
                                {"gated", t.gated},
                                {"missed_deadlines", t.missed_deadlines},
                                {"blocked", t.blocked},
                                {"side_by_side", t.side_by_side},
                                {"yields", t.yields},
                                {"takes_turns", t.takes_turns},
                                {"priority", t.priority}};
  // What a latency tenant is for: how long it waits for the GPU.
  if (t.priority == priority_name(Priority::kLatency)) {
    out["wait_p50_ns"] = t.wait_p50_ns;
    out["wait_p99_ns"] = t.wait_p99_ns;
    out["wait_p999_ns"] = t.wait_p999_ns;
    out["waits"] = t.waits;
  }
  return out;
}

}  // namespace

nlohmann::ordered_json status_to_json(const StatusReport& report) {
  using json = nlohmann::ordered_json;
  auto optional = [](const auto& v) { return v ? json(*v) : json(nullptr); };
  json tenants = json::array();
  for (const TenantStatus& t : report.tenants) {
    json gpus = json::array();
    for (const GpuEntryStatus& g : t.gpus)
      gpus.push_back({{"entry", g.entry},
                      {"uuid", g.uuid},
                      {"state", g.state},
                      {"memory_quota", optional(g.memory_quota)},
                      {"memory_used", g.memory_used},
                      {"context_memory", g.context_memory},
                      {"share_ppm", g.share_ppm},
                      {"limit_ppm", g.limit_ppm},
                      {"count_managed_memory", g.count_managed},
                      {"gpu_time", gpu_time_json(g.gpu_time)},
                      {"gpu_time_error", g.gpu_time_error.empty() ? json(nullptr) : json(g.gpu_time_error)}});
    json processes = json::array();
    for (const ProcessStatus& p : t.processes) {
      json charges = json::array();
      for (const ProcessCharge& c : p.charges) charges.push_back({{"uuid", c.uuid}, {"bytes", c.bytes}});
      json gpu_time = json::array();
      for (const ProcessGpuTime& g : p.gpu_time)
        gpu_time.push_back({{"uuid", g.uuid},
                            {"used_ns", g.used_ns},
                            {"waited_ns", g.waited_ns},
                            {"waiting", g.waiting},
                            {"holding", g.holding}});
      processes.push_back({{"slot", p.slot},
                           {"host_pid", optional(p.host_pid)},
                           {"pid", p.pid},
                           {"comm", p.comm},
                           {"running", p.running},
                           {"charges", charges},
                           {"total_bytes", p.total_bytes},
                           {"gpu_time", gpu_time}});
    }
    json annotations = json::object();
    for (const auto& [k, v] : t.annotations) annotations[k] = v;
    tenants.push_back({{"name", t.name},
                       {"source", t.source},
                       {"state", t.state},
                       {"annotations", std::move(annotations)},
                       {"dir", t.dir},
                       {"error", t.error.empty() ? json(nullptr) : json(t.error)},
                       {"policy_generation", t.generation},
                       {"gpus", gpus},
                       {"processes", processes}});
  }
  return {{"schema_version", kStatusSchemaVersion},
          {"run_dir", report.run_dir},
          {"daemon",
           {{"alive", report.daemon.alive},
            {"pid", optional(report.daemon.pid)},
            {"heartbeat_age_ms", optional(report.daemon.heartbeat_age_ms)}}},
          {"tenants", tenants},
          {"placement", report.placement ? json{{"policy", report.placement->policy}, {"tenants", report.placement->why}}
                                         : json(nullptr)},
          {"gpu_health", report.gpu_health ? json(*report.gpu_health) : json(nullptr)}};
}

std::string status_to_text(const StatusReport& report) {
  std::string out = fmt::format("run dir: {}\n", escape_terminal(report.run_dir));
  const DaemonStatus& d = report.daemon;
  out += fmt::format("daemon:  {}\n", daemon_summary(d));

  // Per GPU, then tenant: who holds what on each device; then the tenants
  // without a GPU.
  const std::vector<GpuRow> all_rows = gpu_rows(report);
  const auto first_without_gpu =
      std::find_if(all_rows.begin(), all_rows.end(), [](const GpuRow& r) { return r.gpu == nullptr; });
  const std::vector<GpuRow> rows(all_rows.begin(), first_without_gpu);
  const std::vector<GpuRow> no_gpu(first_without_gpu, all_rows.end());
  // GPU time: share and limit as configured (fractions of a GPU), achieved
  // shares over 1 s and 10 s, GPU time used and throttled, and whether the
  // tenant holds the GPU now or waits for it.
  std::vector<std::vector<std::string>> gpu_table{{"GPU", "TENANT", "STATE", "SHARE", "LIMIT", "1S", "10S", "GPU TIME",
                                                   "THROTTLED", "DUTY", "NOW", "QUOTA", "USED", "PROCS"}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const GpuRow& r = rows[i];
    // Its processes on this GPU: charged there, or listed by its arbiter.
    const auto on_gpu = [&](const ProcessStatus& p) {
      const auto here = [&](const auto& e) { return e.uuid == r.gpu->uuid; };
      return std::any_of(p.charges.begin(), p.charges.end(), here) ||
             std::any_of(p.gpu_time.begin(), p.gpu_time.end(), here);
    };
    const auto procs = std::count_if(r.tenant->processes.begin(), r.tenant->processes.end(), on_gpu);
    const std::optional<GpuTimeStatus>& time = r.gpu->gpu_time;
    // Duty: of the time it held the GPU, the share its processes used it
    // (measured mode only).
    std::string duty = "-";
    if (time && time->measured && time->held_ns > 0)
      duty = format_ppm_percent(static_cast<uint32_t>(
          std::min<uint64_t>(static_cast<uint64_t>(static_cast<unsigned __int128>(time->measured_ns) * 1'000'000 /
                                                   time->held_ns),
                             1'000'000)));
    std::string now = "-";
    if (time)
      now = time->side_by_side ? "side by side"
            : time->holding    ? "holding"
            : time->blocked    ? "blocked"
            : time->yields     ? "giving way"
            : !time->gated     ? "unshared"
            : time->waiting_processes > 0 ? "waiting" : "idle";
    // Only a priority other than normal stands out.
    std::string tenant = r.tenant->name;
    if (time && time->priority != priority_name(Priority::kNormal)) tenant += fmt::format(" [{}]", time->priority);
    gpu_table.push_back({i > 0 && rows[i - 1].gpu->uuid == r.gpu->uuid ? "" : r.gpu->uuid, tenant, r.gpu->state,
                         format_share(r.gpu->share_ppm), format_share(r.gpu->limit_ppm),
                         time ? format_ppm_percent(time->achieved_1s_ppm) : "-",
                         time ? format_ppm_percent(time->achieved_10s_ppm) : "-",
                         time ? format_duration_ns(time->used_ns) : "-",
                         time ? format_duration_ns(time->throttled_ns) : "-", duty, now,
                         r.gpu->memory_quota ? format_size(*r.gpu->memory_quota) : "unlimited",
                         format_size(r.gpu->memory_used), std::to_string(procs)});
  }
  for (const GpuRow& r : no_gpu) {
    std::vector<std::string> row(gpu_table[0].size(), "-");
    row[1] = r.tenant->name;
    row[2] = "no GPU";
    row.back() = std::to_string(r.tenant->processes.size());
    gpu_table.push_back(std::move(row));
  }
  out += "\n";
  out += gpu_table.size() == 1 ? "no tenant\n" : render_table(gpu_table);
  // How GPU time is charged, per GPU (docs/sm-time.md), and what held
  // mode's audit found outside the tenants' grants.
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::optional<GpuTimeStatus>& time = rows[i].gpu->gpu_time;
    if (!time) continue;
    if (i == 0 || rows[i - 1].gpu->uuid != rows[i].gpu->uuid || !rows[i - 1].gpu->gpu_time) {
      std::string how = time->measured ? "as NVML's samples measure it (gpu_time_charging = \"measured\")"
                        : time->sample_period_ns >= 1'000'000
                            ? fmt::format("as held, audited by NVML's samples (one every {})",
                                          format_duration_ns(time->sample_period_ns))
                        : time->sample_period_ns != 0 ? "as held, audited by NVML's samples (none seen yet)"
                            : "as held (no NVML samples)";
      out += fmt::format("charging on {}: GPU time {}\n", rows[i].gpu->uuid, how);
    }
    if (time->out_of_grant_samples > 0)
      out += fmt::format("  tenant {}: {} of GPU time found outside its grants ({} samples), charged to it\n",
                         rows[i].tenant->name, format_duration_ns(time->out_of_grant_ns), time->out_of_grant_samples);
    if (time->priority == priority_name(Priority::kLatency)) {
      if (time->waits == 0)
        out += fmt::format("  tenant {} [latency]: no wait for the GPU yet\n", escape_terminal(rows[i].tenant->name));
      else
        out += fmt::format("  tenant {} [latency]: waits for the GPU p50 {}, p99 {}, p99.9 {} (last {} of {} waits)\n",
                           escape_terminal(rows[i].tenant->name), format_wait_ns(time->wait_p50_ns),
                           format_wait_ns(time->wait_p99_ns), format_wait_ns(time->wait_p999_ns),
                           std::min<uint64_t>(time->waits, gputime::kWaitWindow), time->waits);
    }
  }
  // Achieved shares are the daemon's figures: without it they stand still.
  const bool any_time =
      std::any_of(rows.begin(), rows.end(), [](const GpuRow& r) { return r.gpu->gpu_time.has_value(); });
  if (!d.alive && any_time)
    out += "1S and 10S are as the daemon last computed them: it is not running, so they are stale.\n";

  // A row per process and GPU it is charged on or has GPU time on.
  std::vector<std::vector<std::string>> proc_table{
      {"TENANT", "HOST PID", "PID", "COMM", "STATUS", "GPU", "CHARGE", "GPU TIME", "WAITED"}};
  for (const TenantStatus& t : report.tenants) {
    for (const ProcessStatus& p : t.processes) {
      // "?": running in a PID namespace this CLI cannot see into.
      const std::string host = p.host_pid ? std::to_string(*p.host_pid) : p.running ? "?" : "-";
      const std::string status = p.running ? "running" : "exited";
      auto add = [&](const std::string& uuid, uint64_t bytes) {
        const auto time = std::find_if(p.gpu_time.begin(), p.gpu_time.end(),
                                       [&](const ProcessGpuTime& g) { return g.uuid == uuid; });
        const bool timed = time != p.gpu_time.end();
        proc_table.push_back({t.name, host, std::to_string(p.pid), p.comm, status, uuid.empty() ? "-" : uuid,
                              format_size(bytes), timed ? format_duration_ns(time->used_ns) : "-",
                              timed ? format_duration_ns(time->waited_ns) : "-"});
      };
      for (const ProcessCharge& c : p.charges) add(c.uuid, c.bytes);
      for (const ProcessGpuTime& g : p.gpu_time)
        if (std::none_of(p.charges.begin(), p.charges.end(), [&](const ProcessCharge& c) { return c.uuid == g.uuid; }))
          add(g.uuid, 0);
      if (p.charges.empty() && p.gpu_time.empty()) add("", 0);
    }
  }
  if (proc_table.size() > 1) out += "\n" + render_table(proc_table);

  if (report.placement && !report.placement->why.empty()) {
    const std::string& policy = report.placement->policy;
    out += fmt::format("\nplacement (policy {}):\n", escape_terminal(policy));
    std::vector<std::vector<std::string>> why_table;
    for (const auto& [name, why] : report.placement->why) {
      const std::string text = why == "devices" ? "pinned by devices"
                               : why == "kept"  ? "kept from before (it has running processes there)"
                               : why == "unchanged" ? "kept from before (unchanged since the last placement)"
                               : why == "memory" ? "named by its memory table"
                               : why == "api" ? "named by its control API request"
                                                 : "chosen by " + policy;
      why_table.push_back({"  " + name, text});
    }
    out += render_table(why_table);
  }

  // Tenants of the control API: whence, in what state, and the client's notes.
  std::vector<std::vector<std::string>> api_table{{"  TENANT", "STATE", "ANNOTATIONS"}};
  for (const TenantStatus& t : report.tenants) {
    if (t.source != "api") continue;
    std::string notes;
    for (const auto& [k, v] : t.annotations) notes += fmt::format("{}{}={}", notes.empty() ? "" : " ", k, v);
    api_table.push_back({"  " + t.name, t.state, notes.empty() ? "-" : notes});
  }
  if (api_table.size() > 1) out += "\ntenants of the control API (fracgpu tenant):\n" + render_table(api_table);

  if (report.gpu_health) out += gpu_health_text(*report.gpu_health);

  std::string arbiter_errors;
  for (const TenantStatus& t : report.tenants)
    for (const GpuEntryStatus& g : t.gpus)
      if (!g.gpu_time_error.empty())
        arbiter_errors += fmt::format("  {} on {}: {}\n", escape_terminal(t.name), escape_terminal(g.uuid),
                                      escape_terminal(g.gpu_time_error));
  if (!arbiter_errors.empty()) out += "\nunreadable GPU-time arbiters (GPU time not shown):\n" + arbiter_errors;

  std::string errors;
  for (const TenantStatus& t : report.tenants)
    if (!t.error.empty()) errors += fmt::format("  {}: {}\n", escape_terminal(t.name), escape_terminal(t.error));
  if (!errors.empty())
    out += "\nunreadable ledgers:\n" + errors +
           "  (their processes are not shown; the daemon reclaims nothing in them until they are valid again)\n";
  return out;
}

}  // namespace fracgpu::controller

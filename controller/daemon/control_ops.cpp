// fracgpud's control API requests (docs/configuration.md, "The control API"):
// tenants created, resized, listed and deleted at run time. Each request runs
// on the main loop's thread (control_server.h), so it sees and changes the
// book exactly as a reload or a tick would, never at the same time.
//
// A change is made in this order, so that a crash anywhere leaves nothing a
// client was told about undone: the new set of API tenants is written to
// <run_dir>/api-tenants.json (whole or not at all); then it is merged into
// the config and applied like a reload (one policy commit for the node, for
// all the creates and resizes the control server handled in one pass:
// commit_control_changes); then the client hears of it.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "common/text_escape.h"
#include "config/tenant_rules.h"
#include "control/protocol.h"
#include "daemon/daemon.h"
#include "sigbus_guard.h"

namespace fracgpu::controller {
namespace {

using nlohmann::json;
namespace proto = fracgpu::control;

json failure(const std::string& code, const std::string& field, const std::string& message) {
  json reply = {{"ok", false}, {"code", code}};
  if (!field.empty()) reply["field"] = field;
  reply["error"] = message;
  return reply;
}

json failure(const SpecError& e) { return failure(e.code, e.field, e.message); }

// The "name" of a get or delete, checked as a tenant name.
std::optional<std::string> requested_name(const json& request, json* error) {
  const auto name = request.find("name");
  if (name == request.end() || !name->is_string()) {
    *error = failure(proto::code::kInvalid, "name", "name: missing, or not a string (the tenant's name)");
    return std::nullopt;
  }
  const std::string text = name->get<std::string>();
  if (!valid_tenant_name(text)) {
    *error = failure(proto::code::kInvalid, "name",
                     fmt::format("name: \"{}\" {}", escape_terminal(text.substr(0, 64)), kTenantNameRule));
    return std::nullopt;
  }
  return text;
}

double fraction(uint32_t ppm) { return static_cast<double>(ppm) / kPpmPerGpu; }

// Descriptors: what a new tenant costs the daemon (measured: its ledger's
// directory, policy and usage files, and per granted GPU the scheduler's
// mapping of its usage file and its arbiter link; the test
// ATenantCostsTheDaemonNoMoreDescriptorsThanItsBudget keeps these true), and
// what stays free for everything else (control connections, NVML, logs,
// the metrics endpoint, a reload's reads).
constexpr size_t kDescriptorsPerTenant = 4;
constexpr size_t kDescriptorsPerGrant = 2;
constexpr size_t kDescriptorsKeptFree = 256;

size_t open_descriptors() {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec))
    ++n;
  return n;
}

// Why the daemon cannot take one more tenant with `grants` GPUs without
// running short of descriptors; nullopt when it can.
std::optional<std::string> descriptor_problem(size_t grants) {
  struct rlimit nofile {};
  if (getrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_cur == RLIM_INFINITY) return std::nullopt;
  const size_t open = open_descriptors();
  const size_t needed = open + kDescriptorsPerTenant + kDescriptorsPerGrant * grants + kDescriptorsKeptFree;
  if (needed <= nofile.rlim_cur) return std::nullopt;
  return fmt::format("fracgpud has {} of its {} descriptors open; a tenant takes {} more, and {} are kept for the "
                     "daemon's own work: no more tenants on this node until some are deleted or the limit is raised "
                     "(LimitNOFILE, docs/operations.md)",
                     open, nofile.rlim_cur, kDescriptorsPerTenant + kDescriptorsPerGrant * grants, kDescriptorsKeptFree);
}

std::string who(const ControlPeer& peer) { return fmt::format("uid {} (pid {})", peer.uid, peer.pid); }

}  // namespace

ControlAccess Daemon::control_access() const {
  ControlAccess access;
  access.daemon_uid = geteuid();
  if (config_ && !config_->daemon.control_group.empty()) {
    access.group = config_->daemon.control_gid;
    access.members = config_->daemon.control_members;
  }
  return access;
}

void Daemon::merge_api_tenants() {
  std::erase_if(config_->tenants, [](const Tenant& t) { return t.source == TenantSource::kApi; });
  for (const auto& [name, tenant] : api_tenants_)
    if (!unplaced_.contains(name)) config_->tenants.push_back(tenant_of(tenant, *config_));
}

bool Daemon::save_api_tenants(const ApiTenants& next, std::string* error) {
  if (!write_run_file(config_->daemon.run_dir, "", kApiTenantsFileName, api_tenants_file_text(next), error))
    return false;
  api_tenants_ = next;
  merge_api_tenants();
  return true;
}

int Daemon::live_processes(const std::string& name) const {
  const auto it = ledgers_.find(name);
  if (it == ledgers_.end()) return 0;  // no ledger this daemon could open: nobody attached through it
  // The kernel's word, not the tenant's: a live process holds its slot's
  // record lock, whatever the usage file (the tenant's to write, truncate or
  // scramble) now says; when the last one is gone, every lock is. So every
  // slot's lock is probed, not the slots the file lists, on the file the
  // processes locked (kept open while the ledger is corrupt).
  ledger::TenantLedger probe;
  probe.usage_fd = it->second.ledger.usage_fd >= 0 ? it->second.ledger.usage_fd : it->second.corrupt_locks.get();
  if (probe.usage_fd < 0) return -1;
  int live = 0;
  for (uint32_t s = 0; s < ledger::kMaxSlots; ++s)
    if (ledger::slot_owner_pid(probe, s) != 0) ++live;
  return live;
}

bool Daemon::finish_delete(const std::string& name) {
  if (live_processes(name) != 0) return false;
  ApiTenants next = api_tenants_;
  next.erase(name);
  std::string error;
  if (!save_api_tenants(next, &error)) {
    log_->error("tenant \"{}\": drained, but {}; it stays draining (retried every pass)", name, error);
    return false;
  }
  // Applied without it first: its GPUs are revoked and no scheduler reads
  // its usage file any more; only then is the ledger closed and removed.
  apply(*config_);
  const auto it = ledgers_.find(name);
  if (it == ledgers_.end()) {
    unplaced_.erase(name);
    // Its directory was refused at adoption (logged then): not ours to remove.
    log_->info("tenant \"{}\" deleted; its ledger directory was left alone", name);
    return true;
  }
  unplaced_.erase(name);
  ledger::close_ledger(&it->second.ledger);
  ledgers_.erase(it);
  if (!remove_tenant_dir(run_.tenants.get(), config_->daemon.run_dir + "/" + kTenantsDirName, name, &error)) {
    log_->error("tenant \"{}\" deleted, but its ledger directory stays: {}", name, error);
    return true;
  }
  log_->info("tenant \"{}\" deleted: no process left, ledger directory removed", name);
  return true;
}

void Daemon::remove_drained() {
  std::vector<std::string> draining;
  for (const auto& [name, tenant] : api_tenants_)
    if (tenant.draining) draining.push_back(name);
  for (const std::string& name : draining) finish_delete(name);
}

json Daemon::tenant_state(const Tenant& tenant) const {
  json gpus = json::array();
  for (const Grant& grant : tenant.grants) {
    const ManagedGpu& gpu = config_->gpus[grant.gpu];
    json entry = {{"uuid", gpu.uuid},
                  {"index", gpu.index},
                  {"share", fraction(grant.share_ppm)},
                  {"limit", fraction(grant.limit_ppm)}};
    entry["memory"] = grant.memory_quota == ledger::kUnlimited ? json(nullptr) : json(grant.memory_quota);
    gpus.push_back(std::move(entry));
  }
  json annotations = json::object();
  for (const auto& [k, v] : tenant.annotations) annotations[k] = v;
  return {{"name", tenant.name},
          {"source", tenant.source == TenantSource::kApi ? proto::kSourceApi : proto::kSourceConfig},
          {"state", tenant.draining ? proto::kStateDraining : proto::kStateActive},
          {"gpus", std::move(gpus)},
          {"count_managed", tenant.count_managed},
          {"processes", std::max(live_processes(tenant.name), 0)},
          {"annotations", std::move(annotations)},
          {"priority", priority_name(tenant.priority)}};
}

json Daemon::unplaced_state(const std::string& name) const {
  const ApiTenant& tenant = api_tenants_.at(name);
  json gpus = json::array();
  for (const ApiGrant& grant : tenant.gpus)
    gpus.push_back({{"uuid", format_gpu_uuid(grant.uuid)},
                    {"share", fraction(grant.share_ppm)},
                    {"limit", fraction(grant.limit_ppm)},
                    {"memory", grant.memory}});
  json annotations = json::object();
  for (const auto& [k, v] : tenant.annotations) annotations[k] = v;
  return {{"name", name},
          {"source", proto::kSourceApi},
          {"state", tenant.draining ? proto::kStateDraining : proto::kStateUnplaced},
          {"unplaced_reason", unplaced_.at(name)},
          {"gpus", std::move(gpus)},
          {"count_managed", tenant.count_managed},
          {"processes", std::max(live_processes(name), 0)},
          {"annotations", std::move(annotations)},
          {"priority", priority_name(tenant.priority)}};
}

json Daemon::node_state() {
  const std::vector<GpuBook> book = capacity_book();
  json gpus = json::array();
  for (size_t g = 0; g < config_->gpus.size(); ++g) {
    const ManagedGpu& gpu = config_->gpus[g];
    std::string compute_capability;
    for (const DiscoveredGpu& found : discovery_.gpus)
      if (found.uuid == gpu.uuid && found.cc_major > 0)
        compute_capability = fmt::format("{}.{}", found.cc_major, found.cc_minor);
    const GpuHealth* health = health_ != nullptr ? health_->find(gpu.uuid) : nullptr;
    const bool fenced = health != nullptr && !health->healthy;
    const GpuBook& b = book[g];
    gpus.push_back({{"uuid", gpu.uuid},
                    {"index", gpu.index},
                    {"name", gpu.name},
                    {"memory", gpu.memory_bytes},
                    {"compute_capability", compute_capability},
                    {"fenced", fenced},
                    {"fence_reason", fenced ? health->why : std::string()},
                    {"config_memory", b.config_memory},
                    {"config_share", fraction(b.config_ppm)},
                    {"api_memory", b.api_memory},
                    {"api_share", fraction(b.api_ppm)},
                    {"free_memory", b.free_memory(gpu.memory_bytes)},
                    {"free_share", fraction(b.free_ppm())}});
  }
  json node = {{"driver_version", discovery_.driver_version},
               {"cuda_driver_version", discovery_.cuda_driver_version},
               {"allow_overcommit", config_->daemon.allow_overcommit},
               {"gpus", std::move(gpus)}};
  // Clients poll this: the generation tells them whether anything changed.
  // It starts from the wall clock, so it keeps growing across restarts.
  const std::string text = node.dump();
  if (node_generation_ == 0) node_generation_ = static_cast<uint64_t>(time(nullptr)) * 1000;
  if (text != node_last_) {
    ++node_generation_;
    node_last_ = text;
  }
  node["generation"] = node_generation_;
  return node;
}

json Daemon::create_tenant(const json& request, bool resize, const ControlPeer& peer) {
  const auto spec = request.find("tenant");
  if (spec == request.end()) return failure(proto::code::kInvalid, "tenant", "tenant: missing (the tenant's spec)");
  SpecError error;
  std::optional<ApiTenant> tenant = parse_api_spec(*spec, &error);
  if (!tenant) return failure(error);
  const std::string& name = tenant->name;
  if (const Tenant* existing = config_->find_tenant(name); existing != nullptr && existing->source == TenantSource::kConfig)
    return failure(proto::code::kConflict, "name",
                   fmt::format("name: \"{}\" is a tenant of the config file {}; config tenants change only there",
                               name, config_->source));
  const auto held = api_tenants_.find(name);
  if (resize && held == api_tenants_.end())
    return failure(proto::code::kNotFound, "name", fmt::format("name: no tenant \"{}\" to resize", name));
  if (held != api_tenants_.end() && held->second.draining)
    return failure(proto::code::kConflict, "name",
                   fmt::format("name: tenant \"{}\" is draining (deleted while processes were alive); it can be "
                               "created again once they are gone",
                               name));
  const auto unplaced = unplaced_.find(name);
  if (!resize && unplaced != unplaced_.end())
    return failure(proto::code::kConflict, "name",
                   fmt::format("name: tenant \"{}\" exists but is not placed ({}); resize it to a spec that fits, or "
                               "delete it",
                               name, unplaced->second));
  if (!resolve_api_tenant(&*tenant, *config_, &error)) return failure(error);

  // An API tenant is placed (in the config in force) or unplaced, never
  // neither; should that ever break, the request fails, the daemon stays.
  const Tenant* placed = config_->find_tenant(name);
  const auto lost = [&] {
    log_->error("control: API tenant \"{}\" is neither placed nor unplaced; restart fracgpud to place it again", name);
    return failure(proto::code::kInternal, "", fmt::format("tenant \"{}\" is in no state the daemon knows", name));
  };
  if (!resize && held != api_tenants_.end()) {
    const std::string difference = spec_difference(*tenant, held->second);
    if (!difference.empty())
      return failure(proto::code::kExists, "name",
                     fmt::format("name: tenant \"{}\" exists with another spec: {}", name, difference));
    if (placed == nullptr) return lost();
    return {{"ok", true}, {"created", false}, {"tenant", tenant_state(*placed)}};
  }
  if (resize && unplaced == unplaced_.end() && spec_difference(*tenant, held->second).empty()) {
    if (placed == nullptr) return lost();
    return {{"ok", true}, {"tenant", tenant_state(*placed)}};
  }
  if (!resize && health_ != nullptr) {
    for (size_t i = 0; i < tenant->gpus.size(); ++i) {
      const std::string uuid = format_gpu_uuid(tenant->gpus[i].uuid);
      if (const GpuHealth* h = health_->find(uuid); h != nullptr && !h->healthy)
        return failure(proto::code::kUnavailable, fmt::format("gpus[{}].uuid", i),
                       fmt::format("gpus[{}].uuid: {} is fenced by the health probe: {}", i, uuid, h->why));
    }
  }
  // Beside every other tenant (itself too, for a resize, but as it was).
  if (const auto problem = capacity_problem(*tenant, *config_, capacity_book(name)))
    return failure(proto::code::kNoCapacity, "", *problem);
  // Refused clearly here rather than made a tenant whose ledger cannot be opened.
  const size_t more = tenant->gpus.size() - (resize ? std::min(held->second.gpus.size(), tenant->gpus.size()) : 0);
  if (const auto why = !resize || more > 0 ? descriptor_problem(more) : std::nullopt) {
    log_->warn("control: {} tenant \"{}\" for {} refused: {}", resize ? "resize" : "create", name, who(peer), *why);
    return failure(proto::code::kNoCapacity, "", *why);
  }

  ApiTenants next = api_tenants_;
  next[name] = *tenant;
  std::string why;
  // An unplaced tenant that now fits is placed by this resize.
  std::optional<std::string> was_unplaced;
  if (unplaced != unplaced_.end()) {
    was_unplaced = unplaced->second;
    unplaced_.erase(unplaced);
  }
  if (!save_api_tenants(next, &why)) {
    if (was_unplaced) unplaced_[name] = *was_unplaced;
    log_->error("control: {} tenant \"{}\" for {} refused: {}", resize ? "resize" : "create", name, who(peer), why);
    return failure(proto::code::kInternal, "", fmt::format("cannot record the tenant: {}", why));
  }
  // The node is applied once for all the changes of a pass
  // (commit_control_changes), but a new tenant's ledger is made now: one
  // that cannot be made is refused here, never answered ok.
  if (!resize && adopt(name, /*create=*/true) == nullptr) {
    // A tenant on paper only, whose processes would find nothing (adopt
    // logged why). Undone; the client is told.
    ApiTenants back = api_tenants_;
    back.erase(name);
    if (std::string undo; !save_api_tenants(back, &undo))
      log_->error("tenant \"{}\": cannot undo its record either: {}", name, undo);
    log_->error("control: create tenant \"{}\" for {} failed: its ledger cannot be made (above)", name, who(peer));
    return failure(proto::code::kInternal, "",
                   fmt::format("tenant \"{}\": its ledger cannot be made (see fracgpud's log); not created", name));
  }
  // What a shrunk tenant still holds stays booked from now, not from the
  // commit: the next request of this pass books against it.
  if (resize) note_shrinks(*config_);
  control_changes_pending_ = true;
  log_->info("control: tenant \"{}\" {} for {}", name, resize ? "resized" : "created", who(peer));
  json reply = {{"ok", true}};
  if (!resize) reply["created"] = true;
  reply["tenant"] = tenant_state(*config_->find_tenant(name));
  return reply;
}

json Daemon::delete_tenant(const json& request, const ControlPeer& peer) {
  json error;
  const std::optional<std::string> name = requested_name(request, &error);
  if (!name) return error;
  const Tenant* tenant = config_->find_tenant(*name);
  if (tenant != nullptr && tenant->source == TenantSource::kConfig && !unplaced_.contains(*name))
    return failure(proto::code::kConflict, "name",
                   fmt::format("name: \"{}\" is a tenant of the config file {}; remove it there", *name,
                               config_->source));
  const auto held = api_tenants_.find(*name);
  if (held == api_tenants_.end()) return {{"ok", true}, {"state", proto::delete_state::kAbsent}};
  if (unplaced_.contains(*name)) {
    // Never placed by this daemon: only the record goes. A ledger directory
    // of that name (its own from before, or a config tenant's that took the
    // name) is left as it is.
    ApiTenants next = api_tenants_;
    next.erase(*name);
    std::string why;
    if (!save_api_tenants(next, &why)) {
      log_->error("control: delete tenant \"{}\" for {} refused: {}", *name, who(peer), why);
      return failure(proto::code::kInternal, "", fmt::format("cannot record the deletion: {}", why));
    }
    unplaced_.erase(*name);
    log_->info("control: unplaced tenant \"{}\" deleted for {}", *name, who(peer));
    return {{"ok", true}, {"state", proto::delete_state::kDeleted}};
  }
  if (!held->second.draining) {
    // Draining is committed before processes are counted: a process that
    // attaches after the count sees the mark and is refused, so none can
    // slip in between the count and the removal.
    ApiTenants next = api_tenants_;
    next[*name].draining = true;
    std::string why;
    if (!save_api_tenants(next, &why)) {
      log_->error("control: delete tenant \"{}\" for {} refused: {}", *name, who(peer), why);
      return failure(proto::code::kInternal, "", fmt::format("cannot record the deletion: {}", why));
    }
    apply(*config_);
  }
  if (finish_delete(*name)) {
    log_->info("control: tenant \"{}\" deleted for {}", *name, who(peer));
    return {{"ok", true}, {"state", proto::delete_state::kDeleted}};
  }
  const int live = live_processes(*name);
  log_->info("control: tenant \"{}\" draining for {}: {}; new processes are refused, it is removed when the last "
             "one is gone",
             *name, who(peer),
             live < 0 ? std::string("its processes cannot be counted (usage file unreadable)")
                      : fmt::format("{} process(es) alive", live));
  return {{"ok", true}, {"state", proto::delete_state::kDraining}};
}

void Daemon::commit_control_changes() {
  if (!control_changes_pending_) return;
  control_changes_pending_ = false;
  apply(*config_);
}

std::string Daemon::handle_control(const std::string& line, const ControlPeer& peer) {
  json reply;
  try {
    const json request = json::parse(line, nullptr, /*allow_exceptions=*/false);
    const auto op = request.is_object() ? request.find("op") : request.end();
    if (!request.is_object()) {
      reply = failure(proto::code::kInvalid, "", "the request is not a JSON object ({\"op\": ...})");
    } else if (op == request.end() || !op->is_string()) {
      reply = failure(proto::code::kInvalid, "op", "op: missing, or not a string (create, resize, delete, get, list, node)");
    } else if (*op == proto::op::kCreate || *op == proto::op::kResize) {
      reply = create_tenant(request, *op == proto::op::kResize, peer);
    } else if (*op == proto::op::kDelete) {
      reply = delete_tenant(request, peer);
    } else if (*op == proto::op::kGet) {
      json error;
      const std::optional<std::string> name = requested_name(request, &error);
      const Tenant* tenant = name ? config_->find_tenant(*name) : nullptr;
      if (!name)
        reply = error;
      else if (tenant != nullptr)
        reply = {{"ok", true}, {"tenant", tenant_state(*tenant)}};
      else if (unplaced_.contains(*name))
        reply = {{"ok", true}, {"tenant", unplaced_state(*name)}};
      else
        reply = failure(proto::code::kNotFound, "name", fmt::format("name: no tenant \"{}\"", *name));
    } else if (*op == proto::op::kList) {
      std::vector<const Tenant*> sorted;
      for (const Tenant& t : config_->tenants) sorted.push_back(&t);
      std::sort(sorted.begin(), sorted.end(), [](const Tenant* a, const Tenant* b) { return a->name < b->name; });
      json tenants = json::array();
      for (const Tenant* t : sorted) tenants.push_back(tenant_state(*t));
      for (const auto& [unplaced, why] : unplaced_) tenants.push_back(unplaced_state(unplaced));
      reply = {{"ok", true}, {"tenants", std::move(tenants)}};
    } else if (*op == proto::op::kNode) {
      reply = {{"ok", true}, {"node", node_state()}};
    } else {
      reply = failure(proto::code::kInvalid, "op",
                      fmt::format("op: \"{}\" is not an operation (create, resize, delete, get, list, node)",
                                  escape_terminal(op->get<std::string>().substr(0, 32))));
    }
  } catch (const std::exception& e) {
    log_->error("control: request from {} failed: {}", who(peer), e.what());
    reply = failure(proto::code::kInternal, "", fmt::format("internal error: {}", e.what()));
  }
  return reply.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace fracgpu::controller

#include "config/placement.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "state/run_dir.h"
#include "state/status.h"
#include "common/units.h"

namespace fracgpu::controller {
namespace {

bool is_running(const std::vector<PriorGrant>& grants) {
  return std::any_of(grants.begin(), grants.end(), [](const PriorGrant& g) { return g.running; });
}

// The GPU a piece goes to under `policy`, among usable GPUs with room that
// the tenant does not already hold; nullopt if none. A GPU in `preferred`
// (the tenant had it before) wins over any other. Ties: the first listed.
std::optional<size_t> choose(PlacementPolicy policy, const std::vector<PlacementGpu>& gpus,
                             const std::vector<bool>& held, const std::vector<bool>& preferred, uint32_t piece) {
  std::optional<size_t> best;
  for (size_t g = 0; g < gpus.size(); ++g) {
    if (!gpus[g].usable || held[g] || gpus[g].free_ppm < piece) continue;
    if (!best || (preferred[g] && !preferred[*best])) {
      best = g;
      continue;
    }
    if (preferred[*best] && !preferred[g]) continue;
    const uint32_t here = gpus[g].free_ppm;
    const uint32_t there = gpus[*best].free_ppm;
    // Strictly better only: equal room keeps the earlier GPU.
    if (policy == PlacementPolicy::kBundle ? here < there : here > there) best = g;
  }
  return best;
}

// The prior grants of a tenant as (GPU index, share), if they are exactly
// its pieces now on distinct usable GPUs with room; else nullopt.
std::optional<std::vector<std::pair<size_t, uint32_t>>> keepable(const std::vector<PlacementGpu>& gpus,
                                                                 const std::vector<PriorGrant>& prior,
                                                                 std::vector<uint32_t> pieces) {
  std::vector<uint32_t> shares;
  for (const PriorGrant& p : prior) shares.push_back(p.share_ppm);
  std::sort(shares.begin(), shares.end());
  std::sort(pieces.begin(), pieces.end());
  if (shares != pieces) return std::nullopt;  // `gpus` changed: place afresh
  std::vector<std::pair<size_t, uint32_t>> out;
  std::vector<uint32_t> free;
  for (const PlacementGpu& g : gpus) free.push_back(g.free_ppm);
  for (const PriorGrant& p : prior) {
    const auto it = std::find_if(gpus.begin(), gpus.end(), [&](const PlacementGpu& g) { return g.uuid == p.uuid; });
    if (it == gpus.end() || !it->usable) return std::nullopt;
    const auto g = static_cast<size_t>(it - gpus.begin());
    if (free[g] < p.share_ppm) return std::nullopt;
    free[g] -= p.share_ppm;
    out.emplace_back(g, p.share_ppm);
  }
  return out;
}

}  // namespace

std::optional<PlacementPolicy> parse_placement_policy(std::string_view text) {
  if (text == "bundle") return PlacementPolicy::kBundle;
  if (text == "spread") return PlacementPolicy::kSpread;
  return std::nullopt;
}

std::string_view placement_policy_name(PlacementPolicy policy) {
  return policy == PlacementPolicy::kBundle ? "bundle" : "spread";
}

std::string_view placement_reason_name(PlacementReason reason) {
  switch (reason) {
    case PlacementReason::kMemoryOnly: return "memory";
    case PlacementReason::kPinned: return "devices";
    case PlacementReason::kKept: return "kept";
    case PlacementReason::kPolicy: return "policy";
    case PlacementReason::kUnchanged: return "unchanged";
    case PlacementReason::kApi: return "api";
  }
  return "policy";
}

std::vector<uint32_t> pieces_of(uint64_t gpus_ppm) {
  std::vector<uint32_t> pieces(gpus_ppm / kPpmPerGpu, kPpmPerGpu);
  if (gpus_ppm % kPpmPerGpu != 0) pieces.push_back(static_cast<uint32_t>(gpus_ppm % kPpmPerGpu));
  return pieces;
}

PriorPlacement prior_placement_from(const StatusReport& report) {
  PriorPlacement prior;
  for (const TenantStatus& t : report.tenants) {
    if (!t.error.empty()) continue;
    if (std::none_of(t.processes.begin(), t.processes.end(), [](const ProcessStatus& p) { return p.running; }))
      continue;
    std::vector<PriorGrant> grants;
    for (const GpuEntryStatus& g : t.gpus) {
      if (g.state != "granted" || g.share_ppm == 0) continue;
      if (auto uuid = parse_gpu_uuid(g.uuid)) grants.push_back({*uuid, g.share_ppm});
    }
    if (!grants.empty()) prior.emplace(t.name, std::move(grants));
  }
  return prior;
}

void add_recorded_placement(const std::string& run_dir, PriorPlacement* prior) {
  const std::optional<PlacementRecord> record = read_placement_record(run_dir);
  if (!record) return;
  for (const auto& [name, grants] : record->grants) {
    if (prior->contains(name)) continue;  // running: its ledger is what counts
    std::vector<PriorGrant> idle;
    for (const auto& [uuid_text, share] : grants)
      if (auto uuid = parse_gpu_uuid(uuid_text); uuid && share > 0) idle.push_back({*uuid, share, false});
    if (!idle.empty()) prior->emplace(name, std::move(idle));
  }
}

std::vector<std::string> running_tenants_moved(const PriorPlacement& prior,
                                               const std::map<std::string, std::vector<std::string>>& now) {
  std::vector<std::string> out;
  for (const auto& [name, grants] : prior) {
    if (!is_running(grants)) continue;
    const auto it = now.find(name);
    std::vector<std::string> left;
    for (const PriorGrant& g : grants) {
      const std::string uuid = format_gpu_uuid(g.uuid);
      if (it == now.end() || std::find(it->second.begin(), it->second.end(), uuid) == it->second.end())
        left.push_back(uuid);
    }
    if (left.empty() || it == now.end()) continue;  // not moved, or no longer placed automatically
    std::string to;
    for (const std::string& uuid : it->second) to += (to.empty() ? "" : ", ") + uuid;
    std::string from;
    for (const std::string& uuid : left) from += (from.empty() ? "" : ", ") + uuid;
    out.push_back(fmt::format("placement: tenant \"{}\" has running processes on {} but is now placed on {} (its "
                              "`gpus` changed, or the GPU has no room): allocations made there are no longer under "
                              "its quota; restart its processes",
                              name, from, to));
  }
  return out;
}

namespace {

// One placement attempt; with !keep_idle, idle tenants are not kept (they
// may still land on a GPU they had, by preference).
std::vector<PlacementResult> place_once(PlacementPolicy policy, std::vector<PlacementGpu>& gpus,
                                        const std::vector<PlacementAsk>& asks, const PriorPlacement* prior,
                                        bool keep_idle) {
  std::vector<PlacementResult> results(asks.size());
  const auto prior_of = [&](size_t i) -> const std::vector<PriorGrant>* {
    if (prior == nullptr) return nullptr;
    const auto it = prior->find(asks[i].name);
    return it == prior->end() ? nullptr : &it->second;
  };
  // Kept first, running tenants before idle ones: a tenant listed earlier (or
  // new) must not take the GPU a running tenant, then an idle one, is on.
  for (const bool running : {true, false}) {
    if (!running && !keep_idle) break;
    for (size_t i = 0; i < asks.size(); ++i) {
      const std::vector<PriorGrant>* p = prior_of(i);
      if (p == nullptr || results[i].placed || is_running(*p) != running) continue;
      auto kept = keepable(gpus, *p, pieces_of(asks[i].gpus_ppm));
      if (!kept) continue;
      for (const auto& [g, share] : *kept) gpus[g].free_ppm -= share;
      results[i] = {true, running ? PlacementReason::kKept : PlacementReason::kUnchanged, std::move(*kept), 0};
    }
  }
  // The rest by the policy: running tenants (resized, or their GPU gone)
  // first, then the others, each in config order.
  for (const bool running : {true, false}) {
    for (size_t i = 0; i < asks.size(); ++i) {
      PlacementResult& r = results[i];
      const std::vector<PriorGrant>* p = prior_of(i);
      if (r.placed || r.failed_piece != 0 || (p != nullptr && is_running(*p)) != running) continue;
      std::vector<bool> held(gpus.size(), false), preferred(gpus.size(), false);
      // An idle tenant dropped for room (!keep_idle) gets no preference either.
      if (p != nullptr && (keep_idle || running))
        for (const PriorGrant& grant : *p)
          for (size_t g = 0; g < gpus.size(); ++g) preferred[g] = preferred[g] || gpus[g].uuid == grant.uuid;
      for (uint32_t piece : pieces_of(asks[i].gpus_ppm)) {
        const std::optional<size_t> g = choose(policy, gpus, held, preferred, piece);
        if (!g) {
          r.failed_piece = piece;
          break;
        }
        held[*g] = true;
        gpus[*g].free_ppm -= piece;
        r.grants.emplace_back(*g, piece);
      }
      r.placed = r.failed_piece == 0;
      if (!r.placed) {
        for (const auto& [g, share] : r.grants) gpus[g].free_ppm += share;
        r.grants.clear();
      }
    }
  }
  return results;
}

}  // namespace

std::vector<PlacementResult> place_automatic(PlacementPolicy policy, std::vector<PlacementGpu>& gpus,
                                             const std::vector<PlacementAsk>& asks, const PriorPlacement* prior) {
  const std::vector<PlacementGpu> before = gpus;
  std::vector<PlacementResult> results = place_once(policy, gpus, asks, prior, /*keep_idle=*/true);
  const auto all_placed = [](const std::vector<PlacementResult>& rs) {
    return std::all_of(rs.begin(), rs.end(), [](const PlacementResult& r) { return r.placed; });
  };
  const bool kept_idle = std::any_of(results.begin(), results.end(),
                                     [](const PlacementResult& r) { return r.reason == PlacementReason::kUnchanged; });
  if (all_placed(results) || !kept_idle) return results;
  // Keeping idle tenants in place left someone without room: give stability
  // up for them rather than refuse the config.
  std::vector<PlacementGpu> again = before;
  std::vector<PlacementResult> retry = place_once(policy, again, asks, prior, /*keep_idle=*/false);
  if (!all_placed(retry)) return results;
  gpus = std::move(again);
  return retry;
}

bool write_placement_record(const std::string& run_dir, const PlacementRecord& record, std::string* error) {
  nlohmann::ordered_json j;
  j["policy"] = record.policy;
  j["tenants"] = nlohmann::ordered_json::object();
  for (const auto& [name, why] : record.why) j["tenants"][name] = why;
  j["grants"] = nlohmann::ordered_json::object();
  for (const auto& [name, grants] : record.grants) {
    auto& list = j["grants"][name] = nlohmann::ordered_json::array();
    for (const auto& [uuid, share] : grants) list.push_back({{"uuid", uuid}, {"share_ppm", share}});
  }
  return write_run_file(run_dir, "", kPlacementFileName, j.dump(2) + "\n", error);
}

std::optional<PlacementRecord> read_placement_record(const std::string& run_dir) {
  std::string error;
  const std::optional<RunDirView> view = open_run_dir_view(run_dir, &error);
  if (!view) return std::nullopt;
  const std::optional<std::string> text =
      read_file_at(view->root.get(), run_dir, kPlacementFileName, view->owner, kMaxRunFileBytes, &error);
  if (!text) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("policy") || !j["policy"].is_string()) return std::nullopt;
  PlacementRecord record;
  record.policy = j["policy"].get<std::string>();
  if (j.contains("tenants") && j["tenants"].is_object())
    for (const auto& [name, why] : j["tenants"].items())
      if (why.is_string()) record.why.emplace(name, why.get<std::string>());
  // Older daemons wrote no "grants": their idle tenants are placed afresh once.
  if (j.contains("grants") && j["grants"].is_object())
    for (const auto& [name, list] : j["grants"].items()) {
      if (!list.is_array()) continue;
      auto& grants = record.grants[name];
      for (const auto& g : list)
        if (g.is_object() && g.contains("uuid") && g["uuid"].is_string() && g.contains("share_ppm") &&
            g["share_ppm"].is_number_unsigned() && g["share_ppm"].get<uint64_t>() <= kPpmPerGpu)
          grants.emplace_back(g["uuid"].get<std::string>(), g["share_ppm"].get<uint32_t>());
    }
  return record;
}

}  // namespace fracgpu::controller

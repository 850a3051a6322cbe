#include "placement.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "status.h"
#include "units.h"

namespace fracgpu::controller {
namespace {

// The GPU a piece goes to under `policy`, among usable GPUs with room that
// the tenant does not already hold; nullopt if none. Ties: the first listed.
std::optional<size_t> choose(PlacementPolicy policy, const std::vector<PlacementGpu>& gpus,
                             const std::vector<bool>& held, uint32_t piece) {
  std::optional<size_t> best;
  for (size_t g = 0; g < gpus.size(); ++g) {
    if (!gpus[g].usable || held[g] || gpus[g].free_ppm < piece) continue;
    if (!best) {
      best = g;
      continue;
    }
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

std::vector<PlacementResult> place_automatic(PlacementPolicy policy, std::vector<PlacementGpu>& gpus,
                                             const std::vector<PlacementAsk>& asks, const PriorPlacement* prior) {
  std::vector<PlacementResult> results(asks.size());
  // Kept first: a tenant listed earlier (or new) must not take the GPU a
  // running tenant is on.
  if (prior != nullptr) {
    for (size_t i = 0; i < asks.size(); ++i) {
      const auto it = prior->find(asks[i].name);
      if (it == prior->end()) continue;
      auto kept = keepable(gpus, it->second, pieces_of(asks[i].gpus_ppm));
      if (!kept) continue;
      for (const auto& [g, share] : *kept) gpus[g].free_ppm -= share;
      results[i] = {true, PlacementReason::kKept, std::move(*kept), 0};
    }
  }
  for (size_t i = 0; i < asks.size(); ++i) {
    PlacementResult& r = results[i];
    if (r.placed) continue;
    std::vector<bool> held(gpus.size(), false);
    for (uint32_t piece : pieces_of(asks[i].gpus_ppm)) {
      const std::optional<size_t> g = choose(policy, gpus, held, piece);
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
  return results;
}

bool write_placement_record(const std::string& run_dir, const PlacementRecord& record, std::string* error) {
  nlohmann::ordered_json j;
  j["policy"] = record.policy;
  j["tenants"] = nlohmann::ordered_json::object();
  for (const auto& [name, why] : record.why) j["tenants"][name] = why;
  const std::string path = (std::filesystem::path(run_dir) / kPlacementFileName).string();
  const std::string tmp = path + ".tmp";
  const std::string text = j.dump(2) + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = fmt::format("cannot write {}: {}", tmp, std::strerror(errno));
    return false;
  }
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const int write_errno = errno;
  ::close(fd);
  // Readers see the old file or the new one, never half of one.
  if (!written || std::rename(tmp.c_str(), path.c_str()) != 0) {
    *error = fmt::format("cannot write {}: {}", path, std::strerror(written ? errno : write_errno));
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

std::optional<PlacementRecord> read_placement_record(const std::string& run_dir) {
  std::ifstream in(std::filesystem::path(run_dir) / kPlacementFileName);
  if (!in) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("policy") || !j["policy"].is_string()) return std::nullopt;
  PlacementRecord record;
  record.policy = j["policy"].get<std::string>();
  if (j.contains("tenants") && j["tenants"].is_object())
    for (const auto& [name, why] : j["tenants"].items())
      if (why.is_string()) record.why.emplace(name, why.get<std::string>());
  return record;
}

}  // namespace fracgpu::controller

// Placement of tenants that ask for `gpus` without naming `devices`: which
// GPUs their pieces (2.5 -> 1, 1, 0.5) land on. Pure functions over free
// capacity, so they can be tested without a config file; config.cpp turns
// their results into grants and file:line errors. docs/operations.md
// ("Placement") describes the policies.
//
// Order of placement, and why:
//   1. tenants pinned with `devices` (config.cpp): they asked for those GPUs;
//   2. tenants "kept": they have live processes on GPUs their ledger already
//      binds with the same shares, and those GPUs still have room. Moving a
//      running tenant would strand its allocations on the old GPU (the new
//      quota is elsewhere), so a restart or reload never does that;
//   3. tenants "unchanged": no live process, but the same shares as the last
//      placement (placement.json) and those GPUs still have room. Their pods
//      are pinned to those GPUs (NVIDIA_VISIBLE_DEVICES), so they stay too;
//   4. everyone else, in config order, by the policy (bundle or spread),
//      running tenants first; a piece prefers a GPU the tenant had before.
// If step 3 leaves a tenant that cannot be placed, placement is redone
// without it (idle tenants may then move; running ones still do not).
// Every step is deterministic: ties go to the GPU listed first in the config.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/uuid.h"

namespace fracgpu::controller {

struct StatusReport;

enum class PlacementPolicy {
  // Best fit: each piece goes to the fullest GPU that still has room, so
  // fractions pack together and whole GPUs stay free for large jobs.
  kBundle,
  // Least loaded: each piece goes to the GPU with the most room, so tenants
  // compete with as few neighbours as possible.
  kSpread,
};
inline constexpr std::string_view kPlacementPolicyList = "bundle, spread";

std::optional<PlacementPolicy> parse_placement_policy(std::string_view text);
std::string_view placement_policy_name(PlacementPolicy policy);

// Why a tenant's grants are on the GPUs they are on.
enum class PlacementReason {
  kMemoryOnly,  // no `gpus`: its `memory` table names the GPUs
  kPinned,      // `devices` names them
  kKept,        // kept from before: it has live processes there (see above)
  kPolicy,      // chosen by the placement policy
  kUnchanged,   // kept from the last placement: idle, same shares (see above)
  kApi,         // a tenant of the control API: its request names the GPUs
};
std::string_view placement_reason_name(PlacementReason reason);

// Splits `gpus` (ppm) into pieces of at most one GPU: 2.5 -> 1, 1, 0.5.
std::vector<uint32_t> pieces_of(uint64_t gpus_ppm);

// A tenant's fractional grants as its ledger (running tenants) or the last
// placement record (idle ones) holds them.
struct PriorGrant {
  GpuUuid uuid{};
  uint32_t share_ppm = 0;
  bool running = true;  // the tenant has live processes; the same for all its grants
};
// Prior grants by tenant name.
using PriorPlacement = std::map<std::string, std::vector<PriorGrant>, std::less<>>;

// The prior placement seen in a status snapshot: for each readable tenant
// with at least one running process, its granted entries with a share.
PriorPlacement prior_placement_from(const StatusReport& report);

// Adds the grants <run_dir>/placement.json records for tenants not already in
// `prior`, as idle (running = false). Nothing if the file is absent or older.
void add_recorded_placement(const std::string& run_dir, PriorPlacement* prior);

// Warnings for running tenants in `prior` that `now` (tenant -> GPU UUIDs it
// is granted, "GPU-..." text) no longer places on a GPU they run on.
std::vector<std::string> running_tenants_moved(const PriorPlacement& prior,
                                               const std::map<std::string, std::vector<std::string>>& now);

// One configured GPU as placement sees it.
struct PlacementGpu {
  GpuUuid uuid{};
  bool usable = true;         // false: its [[gpu]] is broken; nothing goes there
  uint32_t free_ppm = 1'000'000;  // what pinned tenants (and earlier pieces) left
};

struct PlacementAsk {
  std::string name;
  uint64_t gpus_ppm = 0;
};

struct PlacementResult {
  bool placed = false;
  PlacementReason reason = PlacementReason::kPolicy;
  std::vector<std::pair<size_t, uint32_t>> grants;  // (GPU index into gpus, share ppm), placement order
  uint32_t failed_piece = 0;                        // !placed: the piece no GPU had room for
};

// Places `asks` (config order) on `gpus`, consuming their free capacity.
// Tenants in `prior` (may be null) whose pieces match their prior shares
// exactly and still fit are kept first (running ones before idle ones); the
// rest follow `policy`, preferring GPUs they had. A tenant that cannot be
// placed whole gets nothing (its partial pieces are given back).
std::vector<PlacementResult> place_automatic(PlacementPolicy policy, std::vector<PlacementGpu>& gpus,
                                             const std::vector<PlacementAsk>& asks, const PriorPlacement* prior);

// ---- What the daemon tells `fracgpu status` ----

inline constexpr const char* kPlacementFileName = "placement.json";

// The placement the daemon applied, as written to <run_dir>/placement.json.
struct PlacementRecord {
  std::string policy;                                    // "bundle" or "spread"
  std::map<std::string, std::string, std::less<>> why;  // tenant -> reason name
  // tenant -> (GPU UUID text, share ppm) of each fractional grant; what the
  // next start or reload keeps for tenants that are idle then.
  std::map<std::string, std::vector<std::pair<std::string, uint32_t>>, std::less<>> grants;
};

// Written whole or not at all (write_run_file in run_dir.h), mode 0644. False
// and *error on failure, the previous record kept.
bool write_placement_record(const std::string& run_dir, const PlacementRecord& record, std::string* error);
// nullopt when absent or unreadable (an older daemon, or none ran yet), or
// refused (not a regular file of the run dir's owner: run_dir.h).
std::optional<PlacementRecord> read_placement_record(const std::string& run_dir);

}  // namespace fracgpu::controller

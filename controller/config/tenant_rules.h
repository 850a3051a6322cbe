// The rules every tenant obeys, wherever it is defined: a [[tenant]] of the
// node config (config.cpp) or a tenant created through the control API
// (api_tenant.h). One set of checks and one wording, so the same mistake
// reads the same from both. Each check returns the reason a value is
// refused, or nullopt; the caller puts the value's location in front
// ("tenant \"a\": limit = 2 ..." in a config, "gpus[0].limit: 2 ..." in a
// request).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/units.h"

namespace fracgpu::controller {

// Tenants with a grant on one GPU, at most: the rows of its GPU-time
// arbiter (gputime::kMaxTenants, which the scheduler asserts equal). A
// create or config past it is refused; rows of tenants gone are reused.
inline constexpr uint32_t kMaxTenantsPerGpu = 64;

struct ManagedGpu;

// 1 to 63 of a-z, 0-9, '_', '.', '-', starting with a letter or digit: the
// name becomes a directory under <run_dir>/tenants and fills
// PolicySegment::tenant (63 + NUL).
bool valid_tenant_name(std::string_view name);
// Completes `name "x" ...` for a name valid_tenant_name refuses.
inline constexpr std::string_view kTenantNameRule =
    "is invalid (1 to 63 of a-z, 0-9, '_', '.', '-', starting with a letter or digit)";

// A fraction of one GPU (a share of its time, or a cap on it) as parts per
// million, rounded to the nearest: fractions are kept to 1e-6.
uint32_t fraction_ppm(double fraction);
// Why `fraction` cannot be a fraction of one GPU (not above 0 and at most 1,
// or below 1e-6 once rounded), completing `<key> = <value> ...`.
std::optional<std::string> fraction_problem(double fraction);

// A GPU-time cap may not undercut the share it caps; `gpu` names the GPU in
// the message ("GPU 0"). Completes `limit = <value> ...`.
std::optional<std::string> limit_problem(uint32_t limit_ppm, uint32_t share_ppm, std::string_view gpu);

// share x the GPU's memory, rounded down to kQuotaGranularity: the memory
// quota of a fraction that names none.
uint64_t fraction_quota(uint32_t share_ppm, uint64_t gpu_memory);

// A memory quota on `gpu` must fit in the GPU and hold at least one CUDA
// context (the interposer charges every context to the quota). A whole
// sentence ("memory quota 20 GiB on GPU 0 is above ...").
std::optional<std::string> memory_quota_problem(uint64_t quota, const ManagedGpu& gpu);

}  // namespace fracgpu::controller

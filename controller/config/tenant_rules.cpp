#include "config/tenant_rules.h"

#include <cmath>

#include <fmt/format.h>

#include "config/config.h"

namespace fracgpu::controller {

bool valid_tenant_name(std::string_view name) {
  auto ok = [](char c, bool first) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || (!first && (c == '_' || c == '.' || c == '-'));
  };
  if (name.empty() || name.size() > 63) return false;  // 63 + NUL fills PolicySegment::tenant
  for (size_t i = 0; i < name.size(); ++i)
    if (!ok(name[i], i == 0)) return false;
  return true;
}

uint32_t fraction_ppm(double fraction) {
  if (!std::isfinite(fraction) || fraction <= 0) return 0;
  if (fraction >= 1.0) return kPpmPerGpu;
  return static_cast<uint32_t>(std::llround(fraction * kPpmPerGpu));
}

std::optional<std::string> fraction_problem(double fraction) {
  if (!std::isfinite(fraction) || fraction <= 0 || fraction > 1.0)
    return std::string("must be above 0 and at most 1.0 (one GPU)");
  if (fraction_ppm(fraction) == 0) return std::string("is below the smallest share (0.000001)");
  return std::nullopt;
}

std::optional<std::string> limit_problem(uint32_t limit_ppm, uint32_t share_ppm, std::string_view gpu) {
  if (limit_ppm >= share_ppm) return std::nullopt;
  return fmt::format("is below the tenant's share {} of {}: a limit caps what the share guarantees, it cannot be lower",
                     format_gpus(share_ppm), gpu);
}

uint64_t fraction_quota(uint32_t share_ppm, uint64_t gpu_memory) {
  const auto bytes = static_cast<unsigned __int128>(gpu_memory) * share_ppm / kPpmPerGpu;
  return static_cast<uint64_t>(bytes) / kQuotaGranularity * kQuotaGranularity;
}

std::optional<std::string> memory_quota_problem(uint64_t quota, const ManagedGpu& gpu) {
  if (quota > gpu.memory_bytes)
    return fmt::format("memory quota {} on GPU {} is above the GPU's memory ({})", format_size(quota), gpu.index,
                       format_size(gpu.memory_bytes));
  if (quota < gpu.context_memory)
    return fmt::format("memory quota {} on GPU {} is below its context_memory ({}): no CUDA context would fit",
                       format_size(quota), gpu.index, format_size(gpu.context_memory));
  return std::nullopt;
}

}  // namespace fracgpu::controller

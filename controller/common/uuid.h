// GPU UUIDs as the driver returns them (CUuuid: 16 bytes) and as NVIDIA's
// tools print them ("GPU-" + 8-4-4-4-12 lower-case hex of those bytes), which
// is how they appear in the config and the CLI.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fracgpu::controller {

using GpuUuid = std::array<uint8_t, 16>;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower-case.
std::string format_gpu_uuid(const uint8_t bytes[16]);
inline std::string format_gpu_uuid(const GpuUuid& uuid) { return format_gpu_uuid(uuid.data()); }

// Parses the form above; hex digits of either case. nullopt if malformed.
std::optional<GpuUuid> parse_gpu_uuid(std::string_view text);

}  // namespace fracgpu::controller

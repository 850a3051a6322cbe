// Byte sizes as people write them in the config ("1.5GiB", "12 GB", 4096) and
// as the CLI prints them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fracgpu::controller {

// The units a size may carry, for error messages.
inline constexpr std::string_view kSizeUnitList = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB";

// Parses "<number>[ ]<unit>": KiB..TiB are 1024-based, KB..TB 1000-based, B
// and no unit mean bytes; the number may have a decimal part ("1.5GiB"), the
// result is rounded down to whole bytes. Zero is accepted (callers decide).
// On failure returns nullopt and sets *why to a phrase that completes
// `memory "12 gb" ...`, e.g. "has an unknown unit "gb" (use B, KiB, ...)".
std::optional<uint64_t> parse_size(std::string_view text, std::string* why);

// "0 B", "512 MiB", "1.50 GiB": 1024-based, exact values without decimals.
std::string format_size(uint64_t bytes);

// Fractions of a GPU as parts per million, the unit of the ledger's shares.
inline constexpr uint32_t kPpmPerGpu = 1'000'000;

// "0.5", "2.5", "0.333333": the shortest decimal that names the ppm value.
std::string format_gpus(uint64_t ppm);

}  // namespace fracgpu::controller

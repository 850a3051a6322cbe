#include "common/units.h"

#include <array>
#include <cctype>

#include <fmt/format.h>

namespace fracgpu::controller {
namespace {

struct Unit {
  std::string_view name;
  uint64_t multiplier;
};

constexpr std::array<Unit, 9> kUnits{{
    {"B", 1},
    {"KiB", 1ull << 10},
    {"MiB", 1ull << 20},
    {"GiB", 1ull << 30},
    {"TiB", 1ull << 40},
    {"KB", 1000ull},
    {"MB", 1000ull * 1000},
    {"GB", 1000ull * 1000 * 1000},
    {"TB", 1000ull * 1000 * 1000 * 1000},
}};

bool is_digit(char c) { return c >= '0' && c <= '9'; }

}  // namespace

std::optional<uint64_t> parse_size(std::string_view text, std::string* why) {
  auto fail = [&](std::string reason) -> std::optional<uint64_t> {
    if (why != nullptr) *why = std::move(reason);
    return std::nullopt;
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (!s.empty() && s.front() == '-') return fail("is negative (sizes must be greater than zero)");
  if (s.empty() || !is_digit(s.front()))
    return fail(fmt::format("is not a size (write a number and a unit, e.g. \"16GiB\"; units: {})", kSizeUnitList));

  // Exact decimal arithmetic: the integer digits and up to 18 fraction digits
  // as integers, so "1.1GB" is exactly 1100000000 bytes, not a float's guess.
  size_t i = 0;
  unsigned __int128 whole = 0;
  constexpr unsigned __int128 kLimit = static_cast<unsigned __int128>(UINT64_MAX);
  for (; i < s.size() && is_digit(s[i]); ++i) {
    whole = whole * 10 + static_cast<unsigned>(s[i] - '0');
    if (whole > kLimit) return fail("is too large");
  }
  uint64_t frac_digits = 0;
  uint64_t frac_scale = 1;
  if (i < s.size() && s[i] == '.') {
    ++i;
    if (i >= s.size() || !is_digit(s[i])) return fail("is not a size (a digit must follow the decimal point)");
    for (; i < s.size() && is_digit(s[i]); ++i) {
      if (frac_scale < 1'000'000'000'000'000'000ull) {  // further digits cannot matter
        frac_digits = frac_digits * 10 + static_cast<unsigned>(s[i] - '0');
        frac_scale *= 10;
      }
    }
  }
  std::string_view unit = s.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  uint64_t multiplier = 1;
  if (!unit.empty()) {
    const Unit* found = nullptr;
    for (const Unit& u : kUnits)
      if (u.name == unit) found = &u;
    if (found == nullptr) return fail(fmt::format("has an unknown unit \"{}\" (use {})", unit, kSizeUnitList));
    multiplier = found->multiplier;
  }
  unsigned __int128 bytes = whole * multiplier;
  bytes += static_cast<unsigned __int128>(frac_digits) * multiplier / frac_scale;
  if (bytes > kLimit) return fail("is too large");
  return static_cast<uint64_t>(bytes);
}

std::string format_size(uint64_t bytes) {
  static constexpr std::array<std::string_view, 5> kNames{"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  size_t unit = 0;
  uint64_t divisor = 1024;
  while (unit + 1 < kNames.size() && bytes / divisor >= 1024) {
    divisor *= 1024;
    ++unit;
  }
  if (bytes % divisor == 0) return fmt::format("{} {}", bytes / divisor, kNames[unit]);
  return fmt::format("{:.2f} {}", static_cast<double>(bytes) / static_cast<double>(divisor), kNames[unit]);
}

std::string format_gpus(uint64_t ppm) {
  std::string s = fmt::format("{}.{:06}", ppm / kPpmPerGpu, ppm % kPpmPerGpu);
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

}  // namespace fracgpu::controller

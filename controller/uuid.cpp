#include "uuid.h"

namespace fracgpu::controller {
namespace {

constexpr std::string_view kPrefix = "GPU-";
// Bytes after which a dash follows, in the 8-4-4-4-12 grouping.
constexpr bool dash_after(size_t byte) { return byte == 3 || byte == 5 || byte == 7 || byte == 9; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string format_gpu_uuid(const uint8_t bytes[16]) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kPrefix);
  for (size_t i = 0; i < 16; ++i) {
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 0xf];
    if (dash_after(i)) out += '-';
  }
  return out;
}

std::optional<GpuUuid> parse_gpu_uuid(std::string_view text) {
  if (text.size() != kPrefix.size() + 36 || text.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  GpuUuid out{};
  size_t pos = kPrefix.size();
  for (size_t i = 0; i < 16; ++i) {
    const int hi = hex_value(text[pos]);
    const int lo = hex_value(text[pos + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
    pos += 2;
    if (dash_after(i)) {
      if (text[pos] != '-') return std::nullopt;
      ++pos;
    }
  }
  return out;
}

}  // namespace fracgpu::controller

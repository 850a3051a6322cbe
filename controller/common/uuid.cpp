#include "common/uuid.h"

#include "ledger.h"

namespace fracgpu::controller {
namespace {

constexpr std::string_view kPrefix = "GPU-";
// Bytes after which a dash follows, in the 8-4-4-4-12 grouping.
constexpr bool dash_after(size_t byte) { return byte == 3 || byte == 5 || byte == 7 || byte == 9; }

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
  GpuUuid out{};
  if (!ledger::parse_gpu_uuid_text(text, out.data())) return std::nullopt;
  return out;
}

}  // namespace fracgpu::controller

#include "common/text_escape.h"

#include <cstdint>

#include <fmt/format.h>

namespace fracgpu::controller {
namespace {

constexpr std::string_view kReplacement = "\xef\xbf\xbd";  // U+FFFD

// Length of the valid UTF-8 sequence starting at text[i] (1 to 4), or 0.
size_t utf8_sequence(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
  size_t n = 0;
  uint32_t cp = 0;
  if ((lead & 0xe0) == 0xc0) {
    n = 2;
    cp = lead & 0x1f;
  } else if ((lead & 0xf0) == 0xe0) {
    n = 3;
    cp = lead & 0x0f;
  } else if ((lead & 0xf8) == 0xf0) {
    n = 4;
    cp = lead & 0x07;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (byte(i + k) & 0x3f);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return 0;
  // C1 controls (U+0080..U+009F) are controls too.
  if (cp >= 0x80 && cp <= 0x9f) return 0;
  return n;
}

}  // namespace

std::string escape_terminal(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto b = static_cast<unsigned char>(c);
    if (b < 0x20 || b >= 0x7f || c == '\\')
      out += fmt::format("\\x{:02x}", b);
    else
      out += c;
  }
  return out;
}

std::string escape_label_value(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else if (const size_t n = utf8_sequence(text, i); n == 0 || (n == 1 && (static_cast<unsigned char>(c) < 0x20 ||
                                                                               c == '\x7f'))) {
      out += kReplacement;
      i += n == 0 ? 1 : n;
      continue;
    } else {
      out.append(text.substr(i, n));
      i += n;
      continue;
    }
    ++i;
  }
  return out;
}

}  // namespace fracgpu::controller

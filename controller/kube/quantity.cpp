#include "kube/quantity.h"

#include <cctype>
#include <limits>

#include <fmt/format.h>

namespace fracgpu::kube {
namespace {

constexpr __int128 kNanoPerUnit = 1'000'000'000;
// |value| < 2^63 units: every quantity a device or claim carries.
constexpr __int128 kMaxNano = static_cast<__int128>(std::numeric_limits<int64_t>::max()) * kNanoPerUnit;
// More significant digits than an int64 quantity at nano precision has (19 + 9).
constexpr int kMaxMantissaDigits = 30;

bool mul_checked(__int128 a, __int128 b, __int128* out) {
  return !__builtin_mul_overflow(a, b, out) && *out <= kMaxNano && *out >= -kMaxNano;
}

// Ceiling of a / b for b > 0 (rounding toward +infinity, as the API server
// rounds a quantity's precision).
__int128 div_ceil(__int128 a, __int128 b) {
  __int128 q = a / b;
  if (a % b != 0 && a > 0) ++q;
  return q;
}

__int128 pow10(int n) {
  __int128 r = 1;
  for (int i = 0; i < n; ++i) r *= 10;
  return r;
}

std::string int128_to_string(__int128 v) {
  if (v == 0) return "0";
  bool negative = v < 0;
  unsigned __int128 u = negative ? -static_cast<unsigned __int128>(v) : static_cast<unsigned __int128>(v);
  std::string digits;
  while (u != 0) {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(u % 10)));
    u /= 10;
  }
  return negative ? "-" + digits : digits;
}

int64_t clamp_to_int64(__int128 q) {
  if (q > std::numeric_limits<int64_t>::max()) return std::numeric_limits<int64_t>::max();
  if (q < std::numeric_limits<int64_t>::min()) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(q);
}

int64_t ceil_to(__int128 nano, __int128 per) { return clamp_to_int64(div_ceil(nano, per)); }

// Negated in 128 bits before the clamp: negating a clamped INT64_MIN would overflow.
int64_t floor_to(__int128 nano, __int128 per) { return clamp_to_int64(-div_ceil(-nano, per)); }

}  // namespace

std::optional<Quantity> Quantity::parse(std::string_view text, std::string* why) {
  auto fail = [&](std::string reason) -> std::optional<Quantity> {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  if (text.empty()) return fail("is empty");
  if (text.size() > 64) return fail("is longer than 64 characters");
  size_t i = 0;
  bool negative = false;
  if (text[i] == '+' || text[i] == '-') negative = text[i++] == '-';

  // Mantissa digits, the decimal point remembered as a count of fraction digits.
  __int128 mantissa = 0;
  int digits = 0, fraction_digits = 0;
  bool any_digit = false, point = false;
  for (; i < text.size(); ++i) {
    char c = text[i];
    if (c == '.') {
      if (point) return fail("has two decimal points");
      point = true;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(c))) break;
    any_digit = true;
    if (digits == 0 && c == '0' && !point) continue;  // leading zeros
    if (digits >= kMaxMantissaDigits) return fail(fmt::format("has more than {} digits", kMaxMantissaDigits));
    mantissa = mantissa * 10 + (c - '0');
    ++digits;
    if (point) ++fraction_digits;
  }
  if (!any_digit) return fail("has no digits");

  // The suffix: binary, decimal SI, or an exponent.
  std::string_view suffix = text.substr(i);
  int exponent10 = 0;
  int exponent2 = 0;
  if (suffix.empty()) {
  } else if (suffix.size() == 2 && suffix[1] == 'i') {
    static constexpr std::string_view kBinary = "KMGTPE";
    size_t at = kBinary.find(suffix[0]);
    if (at == std::string_view::npos) return fail(fmt::format("has an unknown suffix \"{}\"", suffix));
    exponent2 = 10 * static_cast<int>(at + 1);
  } else if ((suffix[0] == 'e' || suffix[0] == 'E') && suffix.size() > 1) {
    size_t j = 1;
    bool exp_negative = false;
    if (suffix[j] == '+' || suffix[j] == '-') exp_negative = suffix[j++] == '-';
    if (j >= suffix.size()) return fail(fmt::format("has an unknown suffix \"{}\"", suffix));
    int e = 0;
    for (; j < suffix.size(); ++j) {
      if (!std::isdigit(static_cast<unsigned char>(suffix[j])))
        return fail(fmt::format("has an unknown suffix \"{}\"", suffix));
      e = e * 10 + (suffix[j] - '0');
      if (e > 100) return fail("is out of range");
    }
    exponent10 = exp_negative ? -e : e;
  } else if (suffix.size() == 1) {
    switch (suffix[0]) {
      case 'n': exponent10 = -9; break;
      case 'u': exponent10 = -6; break;
      case 'm': exponent10 = -3; break;
      case 'k': exponent10 = 3; break;
      case 'M': exponent10 = 6; break;
      case 'G': exponent10 = 9; break;
      case 'T': exponent10 = 12; break;
      case 'P': exponent10 = 15; break;
      case 'E': exponent10 = 18; break;
      default: return fail(fmt::format("has an unknown suffix \"{}\"", suffix));
    }
  } else {
    return fail(fmt::format("has an unknown suffix \"{}\"", suffix));
  }

  // value = mantissa * 2^exponent2 * 10^(exponent10 - fraction_digits), in nano.
  __int128 scaled = mantissa;
  if (exponent2 > 0 && !mul_checked(scaled, static_cast<__int128>(1) << exponent2, &scaled))
    return fail("is out of range");
  int shift = exponent10 - fraction_digits + 9;
  Quantity q;
  if (shift >= 0) {
    if (shift > 38 && scaled != 0) return fail("is out of range");
    if (scaled != 0 && !mul_checked(scaled, pow10(shift), &scaled)) return fail("is out of range");
  } else {
    int down = -shift;
    if (down > 38) {
      scaled = scaled != 0 ? 1 : 0;
    } else {
      __int128 divisor = pow10(down);
      bool inexact = scaled % divisor != 0;
      scaled = scaled / divisor + (inexact ? 1 : 0);
    }
  }
  if (scaled > kMaxNano) return fail("is out of range");
  // Rounding is toward +infinity for the magnitude the text names; a
  // negative quantity rounds away from zero, as the API server does.
  q.nano_ = negative ? -scaled : scaled;
  return q;
}

Quantity Quantity::from_value(int64_t value) {
  Quantity q;
  q.nano_ = static_cast<__int128>(value) * kNanoPerUnit;
  return q;
}

Quantity Quantity::from_milli(int64_t milli) {
  Quantity q;
  q.nano_ = static_cast<__int128>(milli) * 1'000'000;
  return q;
}

int64_t Quantity::value() const { return ceil_to(nano_, kNanoPerUnit); }
int64_t Quantity::milli_value() const { return ceil_to(nano_, 1'000'000); }
int64_t Quantity::micro_value() const { return ceil_to(nano_, 1'000); }

int64_t Quantity::micro_value_floor() const { return floor_to(nano_, 1'000); }

std::string Quantity::decimal() const {
  __int128 whole = nano_ / kNanoPerUnit;
  __int128 fraction = nano_ % kNanoPerUnit;
  if (fraction == 0) return int128_to_string(whole);
  std::string frac = int128_to_string(fraction < 0 ? -fraction : fraction);
  frac.insert(frac.begin(), 9 - frac.size(), '0');
  while (frac.back() == '0') frac.pop_back();
  std::string sign = (nano_ < 0 && whole == 0) ? "-" : "";
  return sign + int128_to_string(whole) + "." + frac;
}

std::string bytes_quantity(uint64_t bytes) { return std::to_string(bytes); }

std::string milli_quantity(int64_t milli) {
  if (milli % 1000 == 0) return std::to_string(milli / 1000);
  return std::to_string(milli) + "m";
}

}  // namespace fracgpu::kube

// Kubernetes quantities ("20Gi", "500m", "1.5", "2e3"), as the API server
// writes them in capacities and in a claim's consumedCapacity.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fracgpu::kube {

// An exact value in billionths (the API server keeps nothing finer: it rounds
// finer values up to 1n). Range: |value| < 2^63, which covers every capacity.
class Quantity {
 public:
  // The API's grammar: [+-] digits [. digits] then one of the binary suffixes
  // Ki Mi Gi Ti Pi Ei, the decimal ones n u m k M G T P E (or none), or an
  // exponent e<int> / E<int>. Precision finer than 1n is rounded up.
  // nullopt with *why ("has an unknown suffix "gb"") when it is not one.
  static std::optional<Quantity> parse(std::string_view text, std::string* why = nullptr);
  static Quantity from_value(int64_t value);
  static Quantity from_milli(int64_t milli);

  // Rounded up to whole units / thousandths / millionths, as the API's
  // Value() and MilliValue() do.
  int64_t value() const;
  int64_t milli_value() const;
  int64_t micro_value() const;
  // Rounded down to millionths: a booking in millionths that never passes
  // one in billionths (the scheduler's): shares of several claims on a GPU,
  // each rounded down, still add up to no more than it booked.
  int64_t micro_value_floor() const;
  // A stable form for comparing quantities written differently ("1" and
  // "1000m", "80Gi" and "85899345920"): plain decimal, no suffix.
  std::string decimal() const;

  friend auto operator<=>(const Quantity&, const Quantity&) = default;

 private:
  __int128 nano_ = 0;
};

// 85899345920 -> "85899345920": memory is published as whole bytes.
std::string bytes_quantity(uint64_t bytes);
// 500 -> "500m", 1000 -> "1", 2500 -> "2500m": GPU time in thousandths.
std::string milli_quantity(int64_t milli);

}  // namespace fracgpu::kube

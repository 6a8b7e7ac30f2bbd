#include "tierflow/core/units.hpp"

#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "tierflow/core/error.hpp"

namespace tierflow {

std::uint64_t parse_size(std::string_view text, std::string_view what, bool allow_zero) {
  auto fail = [&](const char* why) -> std::uint64_t {
    throw user_error(std::string(what) + ": '" + std::string(text) + "' " + why);
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  if (s.empty() || s.front() == '-' || s.front() == '+')
    return fail("is not a size (use a number with an optional K, M, G or T suffix)");

  double number = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), number);
  if (ec != std::errc() || !std::isfinite(number))
    return fail("is not a size (use a number with an optional K, M, G or T suffix)");

  std::string suffix(end, s.data() + s.size());
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (suffix.ends_with("IB")) suffix.erase(suffix.size() - 2);
  else if (suffix.size() == 2 && suffix.back() == 'B') suffix.pop_back();
  else if (suffix == "B") suffix.clear();

  double scale = 1;
  if (suffix == "K") scale = 0x1p10;
  else if (suffix == "M") scale = 0x1p20;
  else if (suffix == "G") scale = 0x1p30;
  else if (suffix == "T") scale = 0x1p40;
  else if (!suffix.empty()) return fail("has an unknown suffix (use K, M, G or T)");

  const double bytes = number * scale;
  if (bytes >= 0x1p64) return fail("is too large");
  if (bytes != std::floor(bytes)) return fail("is not a whole number of bytes");
  if (bytes == 0 && !allow_zero) return fail("must be greater than zero");
  return static_cast<std::uint64_t>(bytes);
}

std::string format_bytes(double bytes) {
  static constexpr std::array<const char*, 5> units = {"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t unit = 0;
  while (std::fabs(bytes) >= 1024 && unit + 1 < units.size()) {
    bytes /= 1024;
    ++unit;
  }
  char out[48];
  if (unit == 0) std::snprintf(out, sizeof out, "%.0f %s", bytes, units[unit]);
  else std::snprintf(out, sizeof out, "%.2f %s", bytes, units[unit]);
  return out;
}

std::string format_rate(double bytes_per_second) { return format_bytes(bytes_per_second) + "/s"; }

}  // namespace tierflow

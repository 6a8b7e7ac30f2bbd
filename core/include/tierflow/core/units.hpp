// Sizes and rates as people type and read them: "1G", "4K", "1.50 GiB/s".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tierflow {

// Parses a byte count: a number with an optional binary suffix K, M, G or T
// (also "KiB", "KB", lower case), e.g. "4K" = 4096, "1.5G". `what` names the
// flag or key in the error. Throws user_error for anything else, for zero when
// `allow_zero` is false, and for values that do not fit in 64 bits.
std::uint64_t parse_size(std::string_view text, std::string_view what, bool allow_zero = false);

// "1.00 GiB", "512 B", "3.25 MiB".
std::string format_bytes(double bytes);
// "2.41 GiB/s".
std::string format_rate(double bytes_per_second);

}  // namespace tierflow

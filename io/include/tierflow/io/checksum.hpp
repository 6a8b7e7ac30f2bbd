// Integrity checksums for extents: XXH3-64 (libxxhash), fast enough to run at
// NVMe bandwidth on one core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace tierflow::io {

// XXH3-64 of `bytes` (seed 0).
std::uint64_t checksum(std::span<const std::byte> bytes) noexcept;

}  // namespace tierflow::io

// What a checkpoint of a block store holds: every block's identity, where its
// bytes are in the data file, and their checksum. core/ defines the manifest
// and checks it against a store; tiers/ writes and reads the files.
#pragma once

#include <cstdint>
#include <source_location>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/block.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow {

class block_store;

struct manifest_block {
  std::uint32_t id = 0;
  std::string name;
  std::uint64_t size_bytes = 0;
  tierflow::dtype type = tierflow::dtype::fp32;
  std::vector<std::int64_t> shape;
  tier_kind home = tier_kind::host;
  std::uint64_t offset = 0;    // in the data file, a multiple of block_alignment
  std::uint64_t checksum = 0;  // XXH3-64 of the block's size_bytes bytes
};

struct checkpoint_manifest {
  static constexpr int current_format = 1;
  int format = current_format;
  std::uint64_t generation = 0;  // 1, 2, ... one per checkpoint written into a directory
  std::string data_file;         // a name in the checkpoint's directory
  std::uint64_t data_bytes = 0;  // the data file's size
  std::vector<manifest_block> blocks;  // in id order
};

// A checkpoint that cannot be used: corrupt, truncated, or not matching the
// store it is restored into. what() is one line naming the checkpoint and,
// where there is one, the block, e.g.
//   checkpoint /ckpt: block "l3.w": checksum mismatch (corrupt data file blocks-4.bin)
class checkpoint_error : public error {
 public:
  checkpoint_error(std::string_view checkpoint, std::string_view block, std::string_view problem,
                   std::source_location where = std::source_location::current());
};

// The manifest as JSON text (stable key order).
std::string to_json(const checkpoint_manifest& m);
// Parses to_json()'s text; throws checkpoint_error naming `checkpoint` for
// anything malformed or of another format.
checkpoint_manifest parse_manifest(std::string_view json, std::string_view checkpoint);

// The manifest entries of `store`'s blocks, in id order, offsets laid out
// back to back (aligned), checksums zero — for the writer to fill in.
checkpoint_manifest describe_store(const block_store& store);

// Checks that `m` describes exactly `store`'s blocks (same count, and for each
// id the same name, size, dtype, shape and home); throws checkpoint_error
// naming the first difference.
void check_matches(const checkpoint_manifest& m, const block_store& store,
                   std::string_view checkpoint);

}  // namespace tierflow

// Crash-safe checkpoints of a whole block store, wherever each block lives.
//
// A checkpoint directory holds `manifest.json` (the blocks' identities,
// offsets and XXH3 checksums, followed by a line with the XXH3 of the
// manifest itself) and the data file it names, `blocks-<generation>.bin`.
// Writing a new checkpoint into a directory:
//   1. blocks-<g>.bin.tmp: every block's bytes (read through a host lease),
//      fsync, rename to blocks-<g>.bin, fsync the directory;
//   2. manifest.json.tmp: the manifest, fsync, rename over manifest.json —
//      the commit point — fsync the directory;
//   3. remove the previous generation's data file and any *.tmp left over.
// A process killed at any instant leaves manifest.json naming a complete,
// fsynced data file: the previous checkpoint before step 2's rename, the new
// one after it.
#pragma once

#include <cstdint>
#include <string>

#include "tierflow/core/checkpoint_manifest.hpp"
#include "tierflow/core/store.hpp"

namespace tierflow::tiers {

struct checkpoint_stats {
  std::uint64_t generation = 0;
  std::uint64_t blocks = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
};

// Writes every block of `store` into `directory` (created 0700 when missing)
// as above. Needs a host tier in the store (blocks pass through it) and no
// write lease held meanwhile on any block (each block is read under a read
// lease, so each is consistent; consistency across blocks is the caller's —
// checkpoint between steps). Throws tierflow::error naming the file on I/O
// failure; the previous checkpoint stays usable.
checkpoint_stats write_checkpoint(block_store& store, const std::string& directory);

// Reads the manifest in `directory` and checks its own checksum, not the data
// (cheap: e.g. to match a checkpoint's generation with a file saved beside it).
// Throws checkpoint_error when it is missing or corrupt.
checkpoint_manifest read_checkpoint_manifest(const std::string& directory);

// Reads and checks the checkpoint in `directory` without restoring it: the
// manifest's own checksum, the data file's size and every block's checksum.
// Throws checkpoint_error when it is missing, corrupt or truncated.
checkpoint_manifest verify_checkpoint(const std::string& directory);

// Restores `directory` into `store`: verifies everything first (as
// verify_checkpoint), then, when the store has no blocks, creates them from
// the manifest, otherwise checks they match it exactly (checkpoint_error on a
// mismatch), and writes every block's bytes through a host write lease
// (released dirty: they reach the home tiers by the usual write-back).
// Nothing in the store changes when the checkpoint is refused.
checkpoint_stats restore_checkpoint(block_store& store, const std::string& directory);

}  // namespace tierflow::tiers

// The Gloo backend: collectives over host memory between processes, on
// Gloo's TCP transport (Debian's libgloo-dev), for CPU clusters and for
// running the multi-rank paths on a machine without a GPU.
//
// The ranks meet through a key-value store they share — a directory every
// rank sees (Gloo's file store) or a `rendezvous_store` (torch.distributed's
// TCPStore under torchrun, from Python) — each writing its address under
// `prefix`, and every pair connects.
// Each collective runs on the communicator's own thread, in issue order,
// with `timeout` as its end-to-end limit; a peer that dies or stops
// answering fails it within that time (see communicator.hpp for what follows).
//
// Reductions of bf16 and fp16 add in fp32 and round once per pairwise step
// (Gloo's ring order); reduce_scatter is an all-reduce of the whole input of
// which each rank keeps its slice: twice a ring reduce-scatter's traffic,
// which Gloo's snapshot in Debian does not offer for uneven slices.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "tierflow/collectives/communicator.hpp"
#include "tierflow/collectives/rendezvous.hpp"  // rendezvous_store

namespace tierflow::collectives {

struct gloo_options {
  // Where the ranks meet: `store` when given, else the directory
  // `store_dir`, existing and writable by every rank.
  std::shared_ptr<rendezvous_store> store;
  std::string store_dir;
  // The keys' prefix in it: one per communicator made in the same directory.
  std::string prefix = "tierflow";
  // The address this rank listens on and gives its peers.
  std::string hostname = "127.0.0.1";
  // The limit of the rendezvous and of each collective.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Joins the group of `size` ranks as `rank` (blocks until every rank has
// joined, or throws after `timeout`). Throws user_error for a bad rank,
// size, directory or timeout, tierflow::error when the rendezvous fails.
std::unique_ptr<communicator> make_gloo_communicator(int rank, int size, const gloo_options& options);

}  // namespace tierflow::collectives

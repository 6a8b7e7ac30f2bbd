// What the ranks of a group meet through, whatever the backend: a key-value
// store every rank reaches (torch.distributed's TCPStore under torchrun, from
// Python; a map in a test of one process). Gloo swaps addresses through it,
// NCCL the group's unique id.
#pragma once

#include <string>
#include <vector>

namespace tierflow::collectives {

// A key-value store every rank of the group reaches. get() blocks until the
// key is set (or throws after the store's own timeout); calls come from the
// thread that makes the communicator.
class rendezvous_store {
 public:
  virtual ~rendezvous_store() = default;
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
};

}  // namespace tierflow::collectives

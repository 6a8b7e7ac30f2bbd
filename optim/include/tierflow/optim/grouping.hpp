// Which optimizer each parameter gets when a model trains with Muon: Muon for
// the 2-D hidden matrices; AdamW for embeddings, output heads, norms, biases
// and anything that is not a matrix (Muon's orthogonalized update only makes
// sense for the linear maps between hidden states).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace tierflow::optim {

enum class optimizer_kind { adamw, muon };

struct parameter_desc {
  std::string_view name;                   // e.g. "layers.3.mlp.up_proj.weight"
  std::span<const std::int64_t> shape;
};

// Muon iff the shape has two dimensions, both > 1, and the name does not mark
// an embedding or an output head ("embed", "wte", "wpe", "lm_head", "head",
// "output", "classifier", matched case-insensitively on the dotted parts).
optimizer_kind choose_optimizer(const parameter_desc& param);

struct parameter_groups {
  std::vector<std::size_t> muon;   // indices into the input, in order
  std::vector<std::size_t> adamw;
};

parameter_groups group_parameters(std::span<const parameter_desc> params);

}  // namespace tierflow::optim

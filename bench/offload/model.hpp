// Model shapes for `tierflow bench offload`: the weights of a transformer as
// the optimizer sees them, from a preset name or a custom
// "LAYERSxHIDDENxVOCAB" spec, and the training FLOPs of a step.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/zenflow/engine.hpp"

namespace tierflow::bench {

// One parameter tensor, as written: rows × cols for a 2-D weight, cols == 1
// for a 1-D one (norms, biases). The engine's shape type, so the plan can cut
// a weight into the engine's sub-groups without converting.
using weight = zenflow::weight_shape;

struct model_shape {
  std::string name;
  std::uint64_t hidden = 0;
  std::uint64_t vocab = 0;
  std::vector<weight> embedding;            // token (and position) embeddings
  std::vector<std::vector<weight>> layers;  // one list per transformer block
  std::vector<weight> head;                 // final norm, output projection if untied
  bool tied_head = false;                   // the output projection reuses embedding[0]

  std::uint64_t parameters() const;
  // Parameters of the transformer blocks and head, the ones that do matmuls
  // per token (embedding lookups are nearly free).
  std::uint64_t compute_parameters() const;
  // The 2-D weights a token is multiplied by: every block's matrices, the
  // head's, and the embedding matrix again when the head is tied to it.
  std::vector<weight> matmuls() const;
  // Training FLOPs of one step over `tokens` tokens: 6 · compute_parameters ·
  // tokens (2 forward, 4 backward), the usual estimate without attention's
  // sequence-length term.
  double step_flops(std::uint64_t tokens) const;
};

// The preset names, for help texts and errors.
const std::vector<std::string>& model_presets();

// A preset (gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, llama-1b, llama-7b,
// llama-13b) or a custom GPT-2-style "LxHxV" spec such as "24x1024x50257".
// Throws user_error naming the spec and the presets otherwise.
model_shape make_model(std::string_view spec);

}  // namespace tierflow::bench

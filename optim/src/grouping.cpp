#include "tierflow/optim/grouping.hpp"

#include <array>
#include <cctype>
#include <string>

namespace tierflow::optim {

namespace {

// The dotted parts of a parameter name that mark an embedding or an output head.
constexpr std::array<std::string_view, 9> non_hidden_parts = {
    "embed", "embeddings", "embed_tokens", "tok_embeddings", "wte", "wpe", "lm_head", "head", "output"};

bool names_embedding_or_head(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string_view rest = lower;
  while (!rest.empty()) {
    const std::size_t dot = rest.find('.');
    const std::string_view part = rest.substr(0, dot);
    for (std::string_view marker : non_hidden_parts)
      if (part == marker) return true;
    if (part == "classifier") return true;
    if (dot == std::string_view::npos) break;
    rest.remove_prefix(dot + 1);
  }
  return false;
}

}  // namespace

optimizer_kind choose_optimizer(const parameter_desc& param) {
  if (param.shape.size() != 2 || param.shape[0] <= 1 || param.shape[1] <= 1) return optimizer_kind::adamw;
  return names_embedding_or_head(param.name) ? optimizer_kind::adamw : optimizer_kind::muon;
}

parameter_groups group_parameters(std::span<const parameter_desc> params) {
  parameter_groups groups;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (choose_optimizer(params[i]) == optimizer_kind::muon) groups.muon.push_back(i);
    else groups.adamw.push_back(i);
  }
  return groups;
}

}  // namespace tierflow::optim

#include "offload/model.hpp"

#include <charconv>

#include "tierflow/core/error.hpp"

namespace tierflow::bench {
namespace {

// GPT-2: fused QKV, 4h MLP, biases, LayerNorms, tied output head.
model_shape gpt2(std::string name, std::uint64_t layers, std::uint64_t h, std::uint64_t vocab,
                 std::uint64_t positions = 1024) {
  model_shape m{std::move(name), h, vocab, {}, {}, {}, true};
  m.embedding = {{"wte", vocab, h}, {"wpe", positions, h}};
  for (std::uint64_t l = 0; l < layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    m.layers.push_back({{p + "ln_1.weight", h}, {p + "ln_1.bias", h},
                        {p + "attn.c_attn.weight", h, 3 * h}, {p + "attn.c_attn.bias", 3 * h},
                        {p + "attn.c_proj.weight", h, h}, {p + "attn.c_proj.bias", h},
                        {p + "ln_2.weight", h}, {p + "ln_2.bias", h},
                        {p + "mlp.c_fc.weight", h, 4 * h}, {p + "mlp.c_fc.bias", 4 * h},
                        {p + "mlp.c_proj.weight", 4 * h, h}, {p + "mlp.c_proj.bias", h}});
  }
  m.head = {{"ln_f.weight", h}, {"ln_f.bias", h}};
  return m;
}

// Llama: separate q/k/v/o (grouped KV heads), SwiGLU MLP, RMSNorm.
model_shape llama(std::string name, std::uint64_t layers, std::uint64_t h, std::uint64_t kv,
                  std::uint64_t intermediate, std::uint64_t vocab, bool tied) {
  model_shape m{std::move(name), h, vocab, {}, {}, {}, tied};
  m.embedding = {{"embed_tokens", vocab, h}};
  for (std::uint64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    m.layers.push_back({{p + "input_layernorm.weight", h},
                        {p + "self_attn.q_proj.weight", h, h}, {p + "self_attn.k_proj.weight", kv, h},
                        {p + "self_attn.v_proj.weight", kv, h}, {p + "self_attn.o_proj.weight", h, h},
                        {p + "post_attention_layernorm.weight", h},
                        {p + "mlp.gate_proj.weight", intermediate, h}, {p + "mlp.up_proj.weight", intermediate, h},
                        {p + "mlp.down_proj.weight", h, intermediate}});
  }
  m.head = {{"norm.weight", h}};
  if (!tied) m.head.push_back({"lm_head.weight", vocab, h});
  return m;
}

std::uint64_t sum(const std::vector<weight>& ws) {
  std::uint64_t n = 0;
  for (const auto& w : ws) n += w.elements();
  return n;
}

bool parse_number(std::string_view text, std::uint64_t& out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && out > 0;
}

}  // namespace

std::uint64_t model_shape::parameters() const { return sum(embedding) + compute_parameters(); }

std::uint64_t model_shape::compute_parameters() const {
  std::uint64_t n = sum(head);
  for (const auto& layer : layers) n += sum(layer);
  return n;
}

std::vector<weight> model_shape::matmuls() const {
  std::vector<weight> out;
  for (const auto& layer : layers)
    for (const auto& w : layer)
      if (w.matrix()) out.push_back(w);
  for (const auto& w : head)
    if (w.matrix()) out.push_back(w);
  if (tied_head) out.push_back(embedding[0]);
  return out;
}

double model_shape::step_flops(std::uint64_t tokens) const {
  // A tied head still multiplies by the embedding matrix for every token.
  const std::uint64_t head_matmul = tied_head ? embedding[0].elements() : 0;
  return 6.0 * static_cast<double>(compute_parameters() + head_matmul) * static_cast<double>(tokens);
}

const std::vector<std::string>& model_presets() {
  static const std::vector<std::string> names = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl",
                                                 "llama-1b",   "llama-7b",    "llama-13b"};
  return names;
}

model_shape make_model(std::string_view spec) {
  if (spec == "gpt2-small") return gpt2("gpt2-small", 12, 768, 50257);
  if (spec == "gpt2-medium") return gpt2("gpt2-medium", 24, 1024, 50257);
  if (spec == "gpt2-large") return gpt2("gpt2-large", 36, 1280, 50257);
  if (spec == "gpt2-xl") return gpt2("gpt2-xl", 48, 1600, 50257);
  if (spec == "llama-1b") return llama("llama-1b", 16, 2048, 512, 8192, 128256, true);
  if (spec == "llama-7b") return llama("llama-7b", 32, 4096, 4096, 11008, 32000, false);
  if (spec == "llama-13b") return llama("llama-13b", 40, 5120, 5120, 13824, 32000, false);

  // LAYERSxHIDDENxVOCAB, GPT-2 style.
  std::uint64_t dims[3] = {};
  std::size_t start = 0;
  bool ok = true;
  for (int i = 0; i < 3 && ok; ++i) {
    const std::size_t x = spec.find('x', start);
    const std::string_view part = spec.substr(start, i < 2 ? x - start : std::string_view::npos);
    ok = (i == 2 || x != std::string_view::npos) && parse_number(part, dims[i]);
    start = x + 1;
  }
  if (!ok || dims[0] > 1024 || dims[1] > 65536 || dims[2] > (1u << 22)) {
    std::string names;
    for (const auto& n : model_presets()) names += (names.empty() ? "" : ", ") + n;
    throw user_error("--model: '" + std::string(spec) + "' is not a preset (" + names +
                     ") or a LAYERSxHIDDENxVOCAB spec such as 24x1024x50257");
  }
  return gpt2(std::string(spec), dims[0], dims[1], dims[2]);
}

}  // namespace tierflow::bench

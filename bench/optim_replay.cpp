// tierflow_optim_replay: runs optim/'s Adam, AdamW or Muon over inputs given
// as files, so another implementation (bench/optim_vs_torch.py runs PyTorch's)
// can be compared with it on identical inputs, step for step.
//
//   tierflow_optim_replay DIR [--simd TARGET] [--threads N]
//
// DIR/case.json: {"optimizer": "adam"|"adamw"|"muon", "elements": N,
//   "rows": R, "cols": C (Muon; R·C = N), "steps": S, "grad_dtype":
//   "fp32"|"bf16"|"fp16", "state_dtype": "fp32"|"bf16" (Adam), and the
//   hyper-parameters: "lr", "beta1", "beta2", "eps", "weight_decay",
//   "amsgrad" (Adam); "lr", "weight_decay", "momentum", "nesterov", "eps",
//   "ns_steps", "adjust_lr": "original"|"match_rms_adamw", "gemm_dtype" (Muon)}
// DIR/param.bin: N fp32 values; DIR/grad.bin: S·N values of grad_dtype, one
//   step's gradient after another.
// Writes DIR/param_out.bin (fp32) and each state's final values as fp32:
//   exp_avg_out.bin, exp_avg_sq_out.bin (Adam), momentum_out.bin (Muon).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "tierflow/core/dtype.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/muon.hpp"

namespace {

using namespace tierflow;
using nlohmann::json;

std::vector<char> read_all(const std::string& path, std::size_t bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw user_error(path + ": cannot be opened");
  std::vector<char> data(bytes);
  if (!in.read(data.data(), static_cast<std::streamsize>(bytes)))
    throw user_error(path + ": shorter than the " + std::to_string(bytes) + " bytes case.json implies");
  if (in.peek() != std::char_traits<char>::eof())
    throw user_error(path + ": longer than the " + std::to_string(bytes) + " bytes case.json implies");
  return data;
}

void write_all(const std::string& path, const void* data, std::size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  if (!out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes)) || !out.flush())
    throw user_error(path + ": cannot be written");
}

// Widens a state kept as bf16 for the output (fp32 states are copied).
std::vector<float> as_fp32(const std::vector<std::uint16_t>& half, const std::vector<float>& full, dtype type) {
  if (type == dtype::fp32) return full;
  std::vector<float> out(half.size());
  for (std::size_t i = 0; i < half.size(); ++i) {
    const std::uint32_t bits = std::uint32_t(half[i]) << 16;
    std::memcpy(&out[i], &bits, 4);
  }
  return out;
}

void replay(const std::string& dir, const std::string& simd, int threads) {
  std::ifstream case_file(dir + "/case.json");
  if (!case_file) throw user_error(dir + "/case.json: cannot be opened");
  json c;
  try {
    c = json::parse(case_file);
  } catch (const json::exception& e) {
    throw user_error(dir + "/case.json: " + e.what());
  }
  const std::string kind = c.at("optimizer");
  if (kind != "adam" && kind != "adamw" && kind != "muon")
    throw user_error("optimizer: '" + kind + "' is not adam, adamw or muon");
  const std::size_t n = c.at("elements");
  const std::size_t steps = c.at("steps");
  const dtype grad_type = parse_dtype(c.value("grad_dtype", "fp32"), "grad_dtype");
  const std::size_t grad_bytes = n * size_of(grad_type);

  std::vector<float> param(n);
  const auto p = read_all(dir + "/param.bin", n * 4);
  std::memcpy(param.data(), p.data(), n * 4);
  const std::vector<char> grads = read_all(dir + "/grad.bin", steps * grad_bytes);
  optim::executor ex(threads, simd);

  if (kind == "muon") {
    optim::muon_options o;
    o.lr = c.at("lr");
    o.weight_decay = c.at("weight_decay");
    o.momentum = c.at("momentum");
    o.nesterov = c.at("nesterov").get<bool>() ? optim::nesterov::on : optim::nesterov::off;
    o.eps = c.at("eps");
    o.ns_steps = c.at("ns_steps");
    const std::string adjust = c.value("adjust_lr", "original");
    if (adjust == "match_rms_adamw") o.adjust_lr = optim::lr_adjustment::match_rms_adamw;
    else if (adjust != "original") throw user_error("adjust_lr: '" + adjust + "' is not original or match_rms_adamw");
    o.gemm_dtype = parse_dtype(c.value("gemm_dtype", "bf16"), "gemm_dtype");
    optim::muon_optimizer muon(o);
    std::vector<float> momentum(n, 0.0f);
    optim::muon_matrix m;
    m.param = param;
    m.momentum_buffer = momentum;
    m.rows = c.at("rows");
    m.cols = c.at("cols");
    for (std::size_t s = 0; s < steps; ++s) {
      m.grad = {grads.data() + s * grad_bytes, n, grad_type};
      muon.step(ex, m);
    }
    write_all(dir + "/momentum_out.bin", momentum.data(), n * 4);
  } else {
    optim::adam_options o = kind == "adam" ? optim::adam_options::adam() : optim::adam_options::adamw();
    o.lr = c.at("lr");
    o.beta1 = c.at("beta1");
    o.beta2 = c.at("beta2");
    o.eps = c.at("eps");
    o.weight_decay = c.at("weight_decay");
    o.amsgrad = c.value("amsgrad", false) ? optim::amsgrad::on : optim::amsgrad::off;
    const dtype state_type = parse_dtype(c.value("state_dtype", "fp32"), "state_dtype");
    const optim::adam_optimizer adam(o);
    // The states in their dtype: fp32 vectors, or bf16 patterns.
    const bool half = state_type != dtype::fp32;
    std::vector<float> m32(half ? 0 : n), v32(half ? 0 : n), vmax32(half ? 0 : n);
    std::vector<std::uint16_t> m16(half ? n : 0), v16(half ? n : 0), vmax16(half ? n : 0);
    auto ref = [&](std::vector<float>& f, std::vector<std::uint16_t>& h) {
      return half ? optim::half_ref(std::span<std::uint16_t>(h), state_type) : optim::fp32_ref(std::span<float>(f));
    };
    optim::adam_sub_group g;
    g.param = param;
    g.exp_avg = ref(m32, m16);
    g.exp_avg_sq = ref(v32, v16);
    if (o.amsgrad == optim::amsgrad::on) g.max_exp_avg_sq = ref(vmax32, vmax16);
    for (std::size_t s = 0; s < steps; ++s) {
      g.grad = {grads.data() + s * grad_bytes, n, grad_type};
      adam.step(ex, g, {.step = static_cast<std::int64_t>(s) + 1});
    }
    const auto m = as_fp32(m16, m32, state_type), v = as_fp32(v16, v32, state_type);
    write_all(dir + "/exp_avg_out.bin", m.data(), n * 4);
    write_all(dir + "/exp_avg_sq_out.bin", v.data(), n * 4);
  }
  write_all(dir + "/param_out.bin", param.data(), n * 4);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Runs optim/'s Adam, AdamW or Muon over inputs given as files");
  std::string dir, simd = "auto";
  int threads = 1;
  app.add_option("dir", dir, "Directory with case.json, param.bin and grad.bin")->required();
  app.add_option("--simd", simd, "SIMD target: auto or one of this CPU's")->capture_default_str();
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    replay(dir, simd, threads);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tierflow_optim_replay: %s\n", e.what());
    return 1;
  }
  return 0;
}

// `tierflow bench optim`: one optimizer step over N parameters on the CPU, timed
// (median of the timed steps), beside its bound measured in the same run:
// for Adam/AdamW the higher of two figures taken without tierflow's kernels
// (bound/stream_bound.hpp): a plain loop over the step's own streams, at its
// dtypes' widths, compiled separately for this CPU, and memcpy over as many
// bytes; for Muon the Newton–Schulz GEMMs alone. bench/optim_vs_peers.py puts
// torch and DeepSpeed beside it.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "bound/stream_bound.hpp"
#include "commands.hpp"
#include "tierflow/core/dtype.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/muon.hpp"
#include "tierflow/tiers/host_memory.hpp"

namespace tierflow::cli {
namespace {

using nlohmann::json;
using clock_type = std::chrono::steady_clock;

struct optim_options {
  std::string optimizer = "adamw";
  std::string params = "16M";
  std::string tensors;  // comma-separated element counts: one step per tensor, in turn
  std::string param_dtype = "fp32";
  std::string state_dtype = "fp32";
  std::string grad_dtype;  // default: the param dtype
  std::string gemm_dtype = "bf16";
  std::string shape = "1024x4096";
  std::string simd = "auto";
  int threads = 1;
  int matrices = 1;
  int steps = 10;
  std::string pages = "huge";
  bool check_finite = false;
  bool no_bound = false;
  bool as_json = false;
};

// The median of `t` (sorted in place); `t` is not empty.
double median_of(std::vector<double>& t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class F>
double median_seconds(int repeats, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
  }
  return median_of(t);
}

// The optimizer's buffers: each its own tiers::host_region (transparent huge
// pages unless --pages 4k, not pinned here), first touched by the
// executor's threads so each page lands where it is streamed.
//
// Placement matters as much as page size. Regions mapped one after another
// sit exactly their size apart, so with power-of-two sizes every stream's
// element i has the same address bits below 2^28: measured at one thread
// here, Adam then ran at 16 GiB/s instead of 43. Each buffer therefore
// starts at a 2 MiB boundary (so huge pages cover it whole) plus its own
// colour, k × (4 KiB + 64 B): different pages and different cache lines
// within them. (Huge pages themselves added ~15%, fewer TLB misses over seven
// streams; the bench reports which backing it got.)
template <class T>
struct buffer {
  static constexpr std::size_t huge = std::size_t{2} << 20;
  tiers::host_region region;
  T* data_ptr = nullptr;
  std::size_t size = 0;
  buffer(optim::executor& ex, std::size_t n, dtype type, tiers::huge_pages pages, std::size_t colour)
      : size(n) {
    if (n == 0) return;
    const std::size_t offset = (colour * (4096 + 64)) % huge;
    region = tiers::host_region::map({.bytes = n * sizeof(T) + 2 * huge,
                                      .pages = pages,
                                      .pre_touch = false,
                                      .pin = tiers::pinning::none});
    const auto base = reinterpret_cast<std::uintptr_t>(region.data());
    data_ptr = reinterpret_cast<T*>((base + huge - 1) / huge * huge + offset);
    optim::first_touch(ex, {data_ptr, n * sizeof(T) / size_of(type), type});
  }
  T* get() { return data_ptr; }
  std::span<T> span() { return {data_ptr, size}; }
};

// A normal float's 16-bit pattern, truncated (the benchmark's inputs need no
// rounding; the kernels round what they write).
std::uint16_t half_bits(float value, dtype t) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (t == dtype::bf16) return static_cast<std::uint16_t>(bits >> 16);
  const std::uint32_t exp = (bits >> 23) & 0xFF;
  if (exp <= 112) return static_cast<std::uint16_t>((bits >> 16) & 0x8000);  // tiny: signed zero
  return static_cast<std::uint16_t>(((bits >> 16) & 0x8000) | ((exp - 112) << 10) | ((bits >> 13) & 0x3FF));
}

// Times `one_step` `steps` times, each followed by one pass of the bound's
// plain loop and one of its memcpy (so that all three see the same machine:
// on a shared host the load changes between seconds). Returns the median
// step; adds both bounds, the higher one and the ratio to it to `j`.
template <class Step>
double time_beside_bound(Step& one_step, int steps, bound::stream_bound& b, double step_bytes, json& j) {
  for (int i = 0; i < 2; ++i) {  // warm-up, as for the step
    b.stream_pass();
    b.memcpy_pass();
  }
  std::vector<double> step_times, stream_times, memcpy_times;
  for (int i = 0; i < steps; ++i) {
    step_times.push_back(median_seconds(1, one_step));
    stream_times.push_back(b.stream_pass());
    memcpy_times.push_back(b.memcpy_pass());
  }
  const double seconds = median_of(step_times);
  const double stream_seconds = median_of(stream_times), memcpy_seconds = median_of(memcpy_times);
  const double stream_rate = static_cast<double>(b.stream_bytes()) / stream_seconds;
  const double memcpy_rate = static_cast<double>(b.memcpy_bytes()) / memcpy_seconds;
  const double bound_rate = std::max(stream_rate, memcpy_rate);
  j["bound_stream_bytes_per_param"] = static_cast<double>(b.stream_bytes()) / static_cast<double>(b.params());
  j["bound_stream_seconds_per_pass"] = stream_seconds;
  j["bound_stream_bytes_per_second"] = stream_rate;
  j["bound_memcpy_bytes"] = b.memcpy_bytes();
  j["bound_memcpy_seconds_per_pass"] = memcpy_seconds;
  j["bound_memcpy_bytes_per_second"] = memcpy_rate;
  j["bound"] = stream_rate >= memcpy_rate ? "stream" : "memcpy";
  j["bound_bytes_per_second"] = bound_rate;
  j["ratio_to_bound"] = step_bytes / seconds / bound_rate;
  return seconds;
}

// Elements [at, at + n) of every buffer of `g` (an absent one stays absent).
optim::adam_sub_group slice(const optim::adam_sub_group& g, std::size_t at, std::size_t n) {
  auto part = [&](auto ref) {
    if (ref.empty()) return ref;
    ref.data = static_cast<std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(ref.data)>>,
                                              const std::byte*, std::byte*>>(ref.data) +
               at * size_of(ref.type);
    ref.size = n;
    return ref;
  };
  return {g.param.subspan(at, n), part(g.grad), part(g.exp_avg), part(g.exp_avg_sq), part(g.max_exp_avg_sq),
          part(g.param_copy)};
}

// --tensors: the element count of each tensor, in order.
std::vector<std::size_t> parse_tensors(const std::string& list) {
  std::vector<std::size_t> sizes;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    std::size_t used = 0;
    std::size_t n = 0;
    try {
      n = std::stoull(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || n == 0)
      throw user_error("--tensors: \"" + item + "\" is not a positive element count (a comma-separated list)");
    sizes.push_back(n);
    at = comma + 1;
  }
  return sizes;
}

json bench_adam(const optim_options& opt, optim::executor& ex) {
  const std::vector<std::size_t> tensors = opt.tensors.empty() ? std::vector<std::size_t>{} : parse_tensors(opt.tensors);
  std::size_t n = 0;
  for (const std::size_t t : tensors) n += t;
  if (tensors.empty()) n = parse_size(opt.params, "--params");
  const dtype param_t = parse_dtype(opt.param_dtype, "--param-dtype");
  const dtype state_t = parse_dtype(opt.state_dtype, "--state-dtype");
  const dtype grad_t = opt.grad_dtype.empty() ? param_t : parse_dtype(opt.grad_dtype, "--grad-dtype");
  optim::adam_options o = opt.optimizer == "adam" ? optim::adam_options::adam() : optim::adam_options::adamw();
  const optim::adam_optimizer adam(o);

  const tiers::huge_pages pages = opt.pages == "4k" ? tiers::huge_pages::off : tiers::huge_pages::transparent;

  // fp32 master parameters always; a bf16/fp16 model also gets the copy written back.
  std::size_t colour = 0;
  buffer<float> p(ex, n, dtype::fp32, pages, colour++);
  buffer<float> g32(ex, grad_t == dtype::fp32 ? n : 0, dtype::fp32, pages, colour++);
  buffer<std::uint16_t> g16(ex, grad_t != dtype::fp32 ? n : 0, grad_t, pages, colour++);
  buffer<float> m32(ex, state_t == dtype::fp32 ? n : 0, dtype::fp32, pages, colour++),
      v32(ex, state_t == dtype::fp32 ? n : 0, dtype::fp32, pages, colour++);
  buffer<std::uint16_t> m16(ex, state_t != dtype::fp32 ? n : 0, state_t, pages, colour++),
      v16(ex, state_t != dtype::fp32 ? n : 0, state_t, pages, colour++);
  buffer<std::uint16_t> copy(ex, param_t != dtype::fp32 ? n : 0, param_t, pages, colour++);
  std::fill_n(p.get(), n, 0.5f);
  optim::const_tensor_ref grad;
  if (grad_t == dtype::fp32) {
    std::fill_n(g32.get(), n, 1e-3f);
    grad = {g32.get(), n, dtype::fp32};
  } else {
    std::fill_n(g16.get(), n, half_bits(1e-3f, grad_t));
    grad = {g16.get(), n, grad_t};
  }
  optim::tensor_ref param_copy;
  if (param_t != dtype::fp32) param_copy = {copy.get(), n, param_t};
  optim::adam_sub_group group{p.span(), grad,
                              state_t == dtype::fp32 ? optim::tensor_ref{m32.get(), n, dtype::fp32}
                                                     : optim::tensor_ref{m16.get(), n, state_t},
                              state_t == dtype::fp32 ? optim::tensor_ref{v32.get(), n, dtype::fp32}
                                                     : optim::tensor_ref{v16.get(), n, state_t},
                              {}, param_copy};
  // One sub-group per tensor (a model's parameters, stepped one after
  // another as an optimizer over a parameter list does), or one over all.
  std::vector<optim::adam_sub_group> groups;
  for (std::size_t at = 0; const std::size_t t : tensors.empty() ? std::vector<std::size_t>{n} : tensors) {
    groups.push_back(slice(group, at, t));
    at += t;
  }
  std::int64_t step = 0;
  auto one_step = [&] {
    ++step;
    for (const optim::adam_sub_group& g : groups)
      adam.step(ex, g,
                {.step = step, .check = opt.check_finite ? optim::finite_check::skip_step : optim::finite_check::off});
  };
  one_step();
  one_step();  // warm-up: pages mapped, caches and threads in place
  const double bytes = static_cast<double>(optim::adam_optimizer::bytes_per_param(group, o.amsgrad)) +
                       (opt.check_finite ? static_cast<double>(size_of(grad_t)) : 0.0);
  double seconds = 0;
  json j = {{"optimizer", opt.optimizer},
            {"params", n},
            {"tensors", groups.size()},
            {"threads", ex.threads()},
            {"simd", ex.simd()},
            {"param_dtype", name(param_t)},
            {"grad_dtype", name(grad_t)},
            {"state_dtype", name(state_t)},
            // "transparent" (huge pages advised) or "off" (4 KiB), as the region reports it.
            {"pages", p.region.page_backing()}};
  if (opt.no_bound) {
    seconds = median_seconds(opt.steps, one_step);
  } else {
    // The bound, measured without tierflow's kernels over the step's own
    // streams (bound/stream_bound.hpp).
    bound::stream_bound b(n,
                          {.grad_bytes = static_cast<unsigned>(size_of(grad_t)),
                           .state_bytes = static_cast<unsigned>(size_of(state_t)),
                           .copy_bytes = param_t == dtype::fp32 ? 0u : static_cast<unsigned>(size_of(param_t)),
                           .grad_read_twice = opt.check_finite},
                          ex.threads(), pages);
    seconds = time_beside_bound(one_step, opt.steps, b, bytes * static_cast<double>(n), j);
  }
  j["seconds_per_step"] = seconds;
  j["params_per_second"] = static_cast<double>(n) / seconds;
  j["bytes_per_param"] = bytes;
  j["bytes_per_second"] = bytes * static_cast<double>(n) / seconds;
  return j;
}

std::pair<std::size_t, std::size_t> parse_shape(const std::string& s) {
  const auto x = s.find('x');
  try {
    if (x != std::string::npos) {
      std::size_t used1 = 0, used2 = 0;
      const auto r = std::stoull(s.substr(0, x), &used1), c = std::stoull(s.substr(x + 1), &used2);
      if (used1 == x && used2 == s.size() - x - 1 && r > 0 && c > 0) return {r, c};
    }
  } catch (const std::exception&) {
  }
  throw user_error("--shape: expected ROWSxCOLS, e.g. 1024x4096, got '" + s + "'");
}

json bench_muon(const optim_options& opt, optim::executor& ex) {
  const auto [rows, cols] = parse_shape(opt.shape);
  if (opt.matrices < 1) throw user_error("--matrices: must be at least 1");
  optim::muon_options o;
  o.gemm_dtype = parse_dtype(opt.gemm_dtype, "--gemm-dtype");
  const dtype grad_t = opt.grad_dtype.empty() ? parse_dtype(opt.param_dtype, "--param-dtype")
                                              : parse_dtype(opt.grad_dtype, "--grad-dtype");
  optim::muon_optimizer muon(o);
  const std::size_t per = rows * cols, count = static_cast<std::size_t>(opt.matrices);
  std::vector<float> p(per * count, 0.5f), buf(per * count, 0.0f), g32;
  std::vector<std::uint16_t> g16;
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 1e-3f);
  std::vector<float> gvals(per * count);
  for (auto& x : gvals) x = dist(rng);
  if (grad_t == dtype::fp32) g32 = gvals;
  else {
    g16.resize(gvals.size());
    for (std::size_t i = 0; i < gvals.size(); ++i) g16[i] = half_bits(gvals[i], grad_t);
  }
  auto step_all = [&] {
    for (std::size_t k = 0; k < count; ++k) {
      const optim::const_tensor_ref grad =
          grad_t == dtype::fp32 ? optim::const_tensor_ref{g32.data() + k * per, per, dtype::fp32}
                                : optim::const_tensor_ref{g16.data() + k * per, per, grad_t};
      muon.step(ex, {std::span<float>(p).subspan(k * per, per), grad, std::span<float>(buf).subspan(k * per, per),
                     rows, cols, {}});
    }
  };
  step_all();
  const int repeats = std::max(1, std::min(opt.steps, 5));
  const double seconds = median_seconds(repeats, step_all);
  // Newton–Schulz alone on one matrix, and its GEMMs alone on the same buffers.
  std::vector<float> out(per);
  auto ns = [&] { muon.orthogonalize(ex, std::span<const float>(gvals).first(per), rows, cols, out); };
  ns();
  const double ns_seconds = median_seconds(repeats, ns);
  auto gemms = [&] { muon.run_gemms_only(ex, rows, cols); };
  gemms();
  const double gemm_seconds = median_seconds(repeats, gemms);
  const double n = static_cast<double>(per * count);
  const double bytes = 4.0 * 2 + static_cast<double>(size_of(grad_t)) + 4.0 * 2;  // p, buf rw; g read
  return {{"optimizer", "muon"},
          {"params", per * count},
          {"threads", ex.threads()},
          {"simd", ex.simd()},
          {"shape", opt.shape},
          {"matrices", count},
          {"grad_dtype", name(grad_t)},
          {"gemm_dtype", name(o.gemm_dtype)},
          // bf16 without oneDNN's bf16 GEMMs on this CPU: fp32 GEMMs rounded to bf16
          {"gemm_native", o.gemm_dtype != dtype::bf16 || optim::bf16_gemms_native()},
          {"ns_steps", o.ns_steps},
          {"seconds_per_step", seconds},
          {"params_per_second", n / seconds},
          {"bytes_per_second", bytes * n / seconds},
          {"ns_seconds", ns_seconds},
          {"gemm_seconds", gemm_seconds},
          {"ns_to_gemm_ratio", ns_seconds / gemm_seconds}};
}

void print_human(const json& j) {
  auto row = [](const char* key, const std::string& value) { std::printf("  %-22s %s\n", key, value.c_str()); };
  auto num = [](double v, const char* fmt) {
    char b[64];
    std::snprintf(b, sizeof b, fmt, v);
    return std::string(b);
  };
  std::printf("bench optim: %s, %s parameters, %d thread(s), simd %s\n",
              j["optimizer"].get<std::string>().c_str(), std::to_string(j["params"].get<std::size_t>()).c_str(),
              j["threads"].get<int>(), j["simd"].get<std::string>().c_str());
  if (j["optimizer"] == "muon") {
    row("shape", j["shape"].get<std::string>() + " x " + std::to_string(j["matrices"].get<std::size_t>()) +
                     " matrices, gemm " + j["gemm_dtype"].get<std::string>() +
                     (j.value("gemm_native", true) ? "" : " (as fp32 GEMMs rounded to bf16: no bf16 GEMMs on this CPU)"));
  } else {
    if (j["tensors"].get<std::size_t>() > 1) row("tensors", std::to_string(j["tensors"].get<std::size_t>()) + ", stepped in turn");
    row("dtypes", "param " + j["param_dtype"].get<std::string>() + ", grad " + j["grad_dtype"].get<std::string>() +
                      ", state " + j["state_dtype"].get<std::string>());
    row("pages", j["pages"] == "off" ? "4 KiB" : "transparent huge pages (advised)");
  }
  row("step", num(j["seconds_per_step"].get<double>() * 1e3, "%.2f ms"));
  row("params/s", num(j["params_per_second"].get<double>() / 1e9, "%.3f G"));
  row("bandwidth", format_rate(j["bytes_per_second"].get<double>()));
  if (j.contains("bound_bytes_per_second")) {
    const bool stream = j["bound"] == "stream";
    row("bound: plain loop", format_rate(j["bound_stream_bytes_per_second"].get<double>()) + " (" +
                                 num(j["bound_stream_bytes_per_param"].get<double>(), "%.0f") + " B/param" +
                                 (stream ? ", the higher)" : ")"));
    row("bound: memcpy", format_rate(j["bound_memcpy_bytes_per_second"].get<double>()) +
                             (stream ? "" : " (the higher)"));
    row("ratio to bound", num(j["ratio_to_bound"].get<double>(), "%.3f"));
  }
  if (j.contains("ns_seconds")) {
    row("newton-schulz", num(j["ns_seconds"].get<double>() * 1e3, "%.1f ms") + " (one matrix)");
    row("its gemms alone", num(j["gemm_seconds"].get<double>() * 1e3, "%.1f ms"));
    row("ns / gemms", num(j["ns_to_gemm_ratio"].get<double>(), "%.3f"));
  }
}

}  // namespace

void add_bench_optim_command(CLI::App& app) {
  auto opt = std::make_shared<optim_options>();
  CLI::App* cmd = bench_command(app).add_subcommand(
      "optim", "Time one CPU optimizer step (Adam, AdamW, Muon) beside its bandwidth or GEMM bound");
  cmd->add_option("--optimizer", opt->optimizer, "adamw (default), adam or muon")
      ->check(CLI::IsMember({"adamw", "adam", "muon"}));
  cmd->add_option("--params", opt->params, "Parameters per step, K/M/G suffixes (Adam; default 16M)");
  cmd->add_option("--tensors", opt->tensors,
                  "Adam over these tensors instead of one of --params: their element counts, comma-separated, "
                  "stepped one after another as an optimizer over a model's parameter list does");
  cmd->add_option("--param-dtype", opt->param_dtype,
                  "Model dtype: fp32, or bf16/fp16 (gradients in it, updated copy written in it)");
  cmd->add_option("--state-dtype", opt->state_dtype, "Adam moments: fp32 (default) or bf16");
  cmd->add_option("--grad-dtype", opt->grad_dtype, "Gradient dtype when it differs from --param-dtype");
  cmd->add_option("--gemm-dtype", opt->gemm_dtype, "Muon's GEMMs: bf16 (default) or fp32");
  cmd->add_option("--threads", opt->threads, "CPU threads for the step (default 1)");
  cmd->add_option("--shape", opt->shape, "Muon matrix ROWSxCOLS (default 1024x4096)");
  cmd->add_option("--matrices", opt->matrices, "Muon matrices per step (default 1)");
  cmd->add_option("--steps", opt->steps, "Timed steps; the median is reported (default 10)");
  cmd->add_option("--simd", opt->simd, "SIMD target: auto (default) or one of this CPU's, e.g. avx2");
  cmd->add_option("--pages", opt->pages,
                  "Page size of the buffers: huge (default; transparent huge pages, as the host tier maps its state) or 4k")
      ->check(CLI::IsMember({"huge", "4k"}));
  cmd->add_flag("--check-finite", opt->check_finite, "Also read the gradients for inf/nan first (fp16 loss scaling)");
  cmd->add_flag("--no-bound", opt->no_bound, "Skip the bandwidth bounds (Adam)");
  cmd->add_flag("--json", opt->as_json, "One JSON object on stdout instead of the table");
  cmd->callback([opt] {
    if (opt->steps < 1) throw user_error("--steps: must be at least 1");
    optim::executor ex(opt->threads, opt->simd);
    const json j = opt->optimizer == "muon" ? bench_muon(*opt, ex) : bench_adam(*opt, ex);
    if (opt->as_json) std::cout << j.dump(2) << '\n';
    else print_human(j);
  });
}

}  // namespace tierflow::cli

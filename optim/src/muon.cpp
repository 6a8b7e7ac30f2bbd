#include "tierflow/optim/muon.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <omp.h>

#include <dnnl.hpp>

#include "kernels.hpp"
#include "tierflow/core/affinity.hpp"
#include "validate.hpp"

namespace tierflow::optim {

// oneDNN's CPU runtime in the Debian build is OpenMP: its GEMMs run on the
// calling thread's OpenMP team, sized per call from the executor. The
// element-wise passes here use the same team (not oneTBB), so the two kinds of
// work never compete for the cores within one step.

namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

// bf16 pattern → float (exact) and float → bf16 value (nearest even), for the
// small m × m passes that do not go through the Highway kernels.
inline float bf16_to_float(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((bits | 0x00400000u) >> 16);
  return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// v rounded to the nearest bf16 value (as a float).
inline float round_to_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// Rounds the n floats at p to bf16 values, in parallel.
void round_all_to_bf16(float* p, std::size_t n) {
  const auto total = static_cast<std::int64_t>(n);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < total; ++i) p[i] = round_to_bf16(p[i]);
}

// The dtype the Newton–Schulz buffers and GEMMs use for `gemm`: bf16 only
// where oneDNN runs bf16 GEMMs here; fp32 (rounded to bf16) otherwise.
dtype storage_of(dtype gemm) { return gemm == dtype::bf16 && bf16_gemms_native() ? dtype::bf16 : dtype::fp32; }

// Whether bf16 mode runs on fp32 GEMMs here, rounding their operands to bf16.
bool rounds_to_bf16(dtype gemm) { return gemm == dtype::bf16 && storage_of(gemm) == dtype::fp32; }

// One block row of a symmetric product P = S Sᵀ (m × m): rows [row0,
// row0 + rows) and only the columns [row0, m) — the upper triangle and its
// diagonal block. The lower triangle is mirrored afterwards.
struct sym_block {
  std::size_t row0 = 0, rows = 0;
  dnnl::matmul gram, square;
  dnnl::memory::desc gram_src, gram_wei, gram_dst, square_src, square_wei, square_dst;
};

// The matmuls of one Newton–Schulz iteration for X of m × n (m <= n):
//   gram:   A  = X Xᵀ        (m × m; bf16 out in bf16 mode, as torch rounds it)
//   square: A2 = A A         (m × m, fp32 out: combined with A and I next)
//   update: X' = B X         (m × n; B = c A2 + b A + a I)
// A and A2 are symmetric, so each is computed by block rows over its upper
// triangle only and mirrored: with k block rows that is (k+1)/2k of the
// multiply-adds (62.5% at k = 4), and the mirrored result is exactly
// symmetric where a full product is so only up to rounding.
struct ns_plan {
  std::vector<sym_block> blocks;
  dnnl::matmul update;
  dnnl::memory::desc x_md, b_md, y_md;
};

// Block rows for the symmetric products of an m × m result: about m/8 rows
// each (a multiple of 64), never fewer than 256 — smaller blocks lose more
// GEMM efficiency than the triangle saves.
std::size_t sym_block_rows(std::size_t m) {
  const std::size_t eighth = (m / 8 + 63) / 64 * 64;
  return std::min(m, std::max<std::size_t>(256, eighth));
}

// Copies the upper triangle of the m × m row-major `a` onto its lower one,
// in 32 × 32 tiles, in parallel.
template <class T>
void mirror_upper(T* a, std::size_t m) {
  constexpr std::size_t tile = 32;
  const auto tiles = static_cast<std::int64_t>((m + tile - 1) / tile);
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t ti = 0; ti < tiles; ++ti) {
    const std::size_t i0 = static_cast<std::size_t>(ti) * tile, i1 = std::min(m, i0 + tile);
    for (std::size_t j0 = 0; j0 <= i0; j0 += tile) {
      const std::size_t j1 = std::min(m, j0 + tile);
      for (std::size_t i = i0; i < i1; ++i)
        for (std::size_t j = j0; j < std::min(j1, i); ++j) a[i * m + j] = a[j * m + i];
    }
  }
}

}  // namespace

bool bf16_gemms_native() {
  static const bool native = [] {
    try {
      const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
      const dnnl::memory::desc md({2, 2}, dt::bf16, tag::ab);
      (void)dnnl::matmul::primitive_desc(dnnl::matmul::desc(md, md, md), engine);
      return true;
    } catch (const dnnl::error&) {  // dnnl_unimplemented: no bf16 kernel for this ISA
      return false;
    }
  }();
  return native;
}

struct muon_optimizer::workspace {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::map<std::tuple<std::size_t, std::size_t, dtype>, ns_plan> plans;
  // fp32 mode uses the float buffers only; bf16 mode keeps X, A and B in bf16.
  std::vector<float> u;               // the momentum-combined update, rows × cols
  std::vector<float> x32[2], a32, a2;  // m × n (two: ping-pong), m × m, m × m
  std::vector<std::uint16_t> x16[2], a16, b16;

  const ns_plan& plan(std::size_t m, std::size_t n, dtype gemm) {
    const auto key = std::make_tuple(m, n, gemm);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    const dt t = gemm == dtype::bf16 ? dt::bf16 : dt::f32;
    using dims = dnnl::memory::dims;
    const auto M = static_cast<dnnl::memory::dim>(m), N = static_cast<dnnl::memory::dim>(n);
    ns_plan p;
    p.x_md = dnnl::memory::desc({M, N}, t, tag::ab);
    p.b_md = dnnl::memory::desc({M, M}, t, tag::ab);
    p.y_md = dnnl::memory::desc({M, N}, t, tag::ab);
    p.update = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.b_md, p.x_md, p.y_md), engine));
    const std::size_t block = sym_block_rows(m);
    for (std::size_t row0 = 0; row0 < m; row0 += block) {
      sym_block b;
      b.row0 = row0;
      b.rows = std::min(block, m - row0);
      const auto R = static_cast<dnnl::memory::dim>(b.rows), W = static_cast<dnnl::memory::dim>(m - row0);
      // gram: X[row0 : row0+rows, :] · (X[row0 : m, :])ᵀ into A[row0.., row0..] (leading dimension m)
      b.gram_src = dnnl::memory::desc({R, N}, t, tag::ab);
      b.gram_wei = dnnl::memory::desc({N, W}, t, tag::ba);
      b.gram_dst = dnnl::memory::desc({R, W}, t, dims{M, 1});
      // square: A[row0 : row0+rows, :] · A[:, row0 : m] into A2[row0.., row0..]
      b.square_src = dnnl::memory::desc({R, M}, t, tag::ab);
      b.square_wei = dnnl::memory::desc({M, W}, t, dims{M, 1});
      b.square_dst = dnnl::memory::desc({R, W}, dt::f32, dims{M, 1});
      b.gram = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(b.gram_src, b.gram_wei, b.gram_dst), engine));
      b.square = dnnl::matmul(
          dnnl::matmul::primitive_desc(dnnl::matmul::desc(b.square_src, b.square_wei, b.square_dst), engine));
      p.blocks.push_back(std::move(b));
    }
    return plans.emplace(key, std::move(p)).first->second;
  }

  void reserve(std::size_t rows, std::size_t cols, dtype gemm) {
    const std::size_t mn = rows * cols, m = std::min(rows, cols), mm = m * m;
    if (u.size() < mn) u.resize(mn);
    if (a2.size() < mm) a2.resize(mm);
    if (gemm == dtype::bf16) {
      for (auto& x : x16)
        if (x.size() < mn) x.resize(mn);
      if (a16.size() < mm) a16.resize(mm);
      if (b16.size() < mm) b16.resize(mm);
    } else {
      for (auto& x : x32)
        if (x.size() < mn) x.resize(mn);
      if (a32.size() < mm) a32.resize(mm);
    }
  }

  void* x_buffer(int i, dtype gemm) {
    return gemm == dtype::bf16 ? static_cast<void*>(x16[i].data()) : static_cast<void*>(x32[i].data());
  }

  // The GEMMs of one iteration on X in x_buffer(cur), into x_buffer(1 - cur).
  // With `combine_too` the element passes between them run as well (mirror,
  // B = c A2 + b A + a I, and in bf16 mode on fp32 GEMMs the rounding of A,
  // B and X' to bf16); without, the GEMMs alone (the bound NS is measured
  // against).
  void iteration(const muon_options& o, const ns_plan& p, std::size_t m, std::size_t n, int cur, bool combine_too) {
    const dtype gemm = storage_of(o.gemm_dtype);
    const bool rounds = combine_too && rounds_to_bf16(o.gemm_dtype);
    const std::size_t elem = gemm == dtype::bf16 ? 2 : 4;
    auto* x = static_cast<std::byte*>(x_buffer(cur, gemm));
    auto* a = gemm == dtype::bf16 ? reinterpret_cast<std::byte*>(a16.data()) : reinterpret_cast<std::byte*>(a32.data());
    auto* a2b = reinterpret_cast<std::byte*>(a2.data());
    for (const sym_block& b : p.blocks) {
      dnnl::memory src(b.gram_src, engine, x + b.row0 * n * elem), wei(b.gram_wei, engine, x + b.row0 * n * elem),
          dst(b.gram_dst, engine, a + (b.row0 * m + b.row0) * elem);
      b.gram.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    }
    stream.wait();
    if (combine_too) {
      if (gemm == dtype::bf16) mirror_upper(a16.data(), m);
      else mirror_upper(a32.data(), m);
      if (rounds) round_all_to_bf16(a32.data(), m * m);  // A, stored as bf16 by the bf16 GEMM
    }
    for (const sym_block& b : p.blocks) {
      dnnl::memory src(b.square_src, engine, a + b.row0 * m * elem), wei(b.square_wei, engine, a + b.row0 * elem),
          dst(b.square_dst, engine, a2b + (b.row0 * m + b.row0) * 4);
      b.square.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    }
    stream.wait();
    if (combine_too) {
      mirror_upper(a2.data(), m);
      combine(o, m);
      if (rounds) round_all_to_bf16(a2.data(), m * m);  // B, the update GEMM's bf16 operand
    }
    void* b_buf = gemm == dtype::bf16 ? static_cast<void*>(b16.data()) : static_cast<void*>(a2.data());
    dnnl::memory b_mem(p.b_md, engine, b_buf), x_mem(p.x_md, engine, x),
        y_mem(p.y_md, engine, x_buffer(1 - cur, gemm));
    p.update.execute(stream, {{DNNL_ARG_SRC, b_mem}, {DNNL_ARG_WEIGHTS, x_mem}, {DNNL_ARG_DST, y_mem}});
    stream.wait();
    if (rounds) round_all_to_bf16(x32[1 - cur].data(), m * n);  // X', stored as bf16
  }

  // ns_steps iterations on X in x_buffer(0); returns which buffer holds the result.
  int iterate(const muon_options& o, std::size_t m, std::size_t n) {
    const ns_plan& p = plan(m, n, storage_of(o.gemm_dtype));
    int cur = 0;
    for (int s = 0; s < o.ns_steps; ++s) {
      iteration(o, p, m, n, cur, /*combine_too=*/true);
      cur = 1 - cur;
    }
    return cur;
  }

  // B = c A2 + b A + a I: folding a·X into the update GEMM as a·I saves a pass
  // over X per iteration (X' = a X + B X = (a I + B) X).
  void combine(const muon_options& o, std::size_t m) {
    const float a = o.ns_a, b = o.ns_b, c = o.ns_c;
    const auto rows = static_cast<std::int64_t>(m);
    if (storage_of(o.gemm_dtype) == dtype::bf16) {
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::size_t r = static_cast<std::size_t>(i) * m;
        for (std::size_t j = 0; j < m; ++j) {
          float v = c * a2[r + j] + b * bf16_to_float(a16[r + j]);
          if (j == static_cast<std::size_t>(i)) v += a;
          b16[r + j] = float_to_bf16(v);
        }
      }
    } else {
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::size_t r = static_cast<std::size_t>(i) * m;
        for (std::size_t j = 0; j < m; ++j) a2[r + j] = c * a2[r + j] + b * a32[r + j];
        a2[r + static_cast<std::size_t>(i)] += a;
      }
    }
  }
};

namespace {

void validate(const muon_options& options) {
  detail::require_finite_at_least(options.lr, 0.0f, "lr");
  detail::require_finite_at_least(options.weight_decay, 0.0f, "weight_decay");
  detail::require_unit_interval(options.momentum, "momentum");
  detail::require(options.ns_steps >= 0 && options.ns_steps <= 100, "ns_steps",
                  "must be in [0, 100], got " + std::to_string(options.ns_steps));
  detail::require(std::isfinite(options.eps) && options.eps > 0.0f, "eps", "must be finite and > 0");
  detail::require(std::isfinite(options.ns_a) && std::isfinite(options.ns_b) && std::isfinite(options.ns_c),
                  "ns_coefficients", "must be finite");
  detail::require_dtype(options.gemm_dtype, "gemm_dtype", true, true, false);
}

}  // namespace

muon_optimizer::muon_optimizer(const muon_options& options) : options_(options) {
  validate(options);
  ws_ = std::make_unique<workspace>();
}

void muon_optimizer::set_options(const muon_options& options) {
  validate(options);
  options_ = options;
}

muon_optimizer::~muon_optimizer() = default;
muon_optimizer::muon_optimizer(muon_optimizer&&) noexcept = default;
muon_optimizer& muon_optimizer::operator=(muon_optimizer&&) noexcept = default;

float muon_optimizer::adjusted_lr(const muon_options& o, std::size_t rows, std::size_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  double ratio = 1.0;
  switch (o.adjust_lr) {
    case lr_adjustment::original: ratio = std::sqrt(std::max(1.0, r / c)); break;
    case lr_adjustment::match_rms_adamw: ratio = 0.2 * std::sqrt(std::max(r, c)); break;
    case lr_adjustment::spectral_unclamped: ratio = std::sqrt(r / c); break;
  }
  return static_cast<float>(static_cast<double>(o.lr) * ratio);
}

namespace {

void require_shape(std::size_t rows, std::size_t cols) {
  detail::require(rows >= 1 && cols >= 1, "shape",
                  "must be at least 1 x 1, got " + std::to_string(rows) + " x " + std::to_string(cols));
}

// Sizes the OpenMP team (oneDNN's threads and the element loops here) to
// the executor for the guard's lifetime, and pins its pool threads to the
// executor's CPUs as the executor pins its oneTBB threads: team thread t > 0
// on cpus[t mod size]. Thread 0 is the caller, whose placement is the
// caller's. The team size is a setting of the calling thread in a runtime
// the whole process shares (inside PyTorch, libgomp is torch's intra-op
// pool too), so the caller's own size is given back at the end: left
// behind, the executor's would become the caller's thread count.
class omp_team {
 public:
  explicit omp_team(executor& ex) : caller_threads_(omp_get_max_threads()) {
    omp_set_num_threads(ex.threads());
    const std::vector<int>& cpus = ex.cpus();
    if (cpus.empty() || ex.threads() < 2) return;
#pragma omp parallel
    {
      const int t = omp_get_thread_num();
      if (t > 0) {
        const int cpu = cpus[static_cast<std::size_t>(t) % cpus.size()];
        try {
          pin_current_thread(std::span(&cpu, 1));
        } catch (const std::exception&) {
          // The executor checked these CPUs; a refusal now leaves the thread
          // where it was, which is slower but correct.
        }
      }
    }
  }
  ~omp_team() { omp_set_num_threads(caller_threads_); }
  omp_team(const omp_team&) = delete;
  omp_team& operator=(const omp_team&) = delete;

 private:
  int caller_threads_;
};

}  // namespace

// NS(in) into out; `in` may be ws.u. The transposition of a tall matrix is
// fused into the load (with the 1/||X|| scale) and into the store.
void muon_optimizer::orthogonalize_into(executor& ex, const float* in, std::size_t rows,
                                        std::size_t cols, float* out) {
  workspace& ws = *ws_;
  const muon_options& o = options_;
  const omp_team team(ex);
  const dtype gemm = storage_of(o.gemm_dtype);
  ws.reserve(rows, cols, gemm);
  const bool tall = rows > cols;
  const std::size_t m = tall ? cols : rows, n = tall ? rows : cols;
  const auto total = static_cast<std::int64_t>(rows * cols);

  double sum_sq = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : sum_sq)
  for (std::int64_t i = 0; i < total; ++i) sum_sq += static_cast<double>(in[i]) * in[i];
  const float inv_norm = static_cast<float>(1.0 / std::max(std::sqrt(sum_sq), static_cast<double>(o.eps)));

  // Pairs element (r, c) of the row-major input/output with its place in the
  // workspace X (transposed when tall) and calls visit(matrix_index, x_index),
  // in parallel; 32 × 32 blocks for the transpose.
  constexpr std::size_t blk = 32;
  auto for_each_element = [&](auto visit) {
    if (!tall) {
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < total; ++i) visit(static_cast<std::size_t>(i), static_cast<std::size_t>(i));
      return;
    }
    const auto row_blocks = static_cast<std::int64_t>((rows + blk - 1) / blk);
#pragma omp parallel for schedule(static)
    for (std::int64_t rb = 0; rb < row_blocks; ++rb) {
      const std::size_t r0 = static_cast<std::size_t>(rb) * blk, r1 = std::min(rows, r0 + blk);
      for (std::size_t c0 = 0; c0 < cols; c0 += blk) {
        const std::size_t c1 = std::min(cols, c0 + blk);
        for (std::size_t r = r0; r < r1; ++r)
          for (std::size_t c = c0; c < c1; ++c) visit(r * cols + c, c * n + r);
      }
    }
  };
  // X = in (or inᵀ) / ||in||, in the GEMM dtype; out = X (transposed back) after.
  auto load = [&](auto* x, auto convert) {
    for_each_element([&](std::size_t i, std::size_t k) { x[k] = convert(in[i] * inv_norm); });
  };
  auto store = [&](const auto* x, auto convert) {
    for_each_element([&](std::size_t i, std::size_t k) { out[i] = convert(x[k]); });
  };

  if (gemm == dtype::bf16) {
    load(ws.x16[0].data(), [](float v) { return float_to_bf16(v); });
    const int cur = ws.iterate(o, m, n);
    store(ws.x16[cur].data(), [](std::uint16_t v) { return bf16_to_float(v); });
  } else {
    if (rounds_to_bf16(o.gemm_dtype)) load(ws.x32[0].data(), [](float v) { return round_to_bf16(v); });  // (the bf16 GEMM's operand)
    else load(ws.x32[0].data(), [](float v) { return v; });
    const int cur = ws.iterate(o, m, n);
    store(ws.x32[cur].data(), [](float v) { return v; });
  }
}

void muon_optimizer::orthogonalize(executor& ex, std::span<const float> in, std::size_t rows,
                                   std::size_t cols, std::span<float> out) {
  require_shape(rows, cols);
  detail::require_buffer(const_tensor_ref(in.data(), in.size(), dtype::fp32), rows * cols, "in");
  detail::require_buffer(const_tensor_ref(out.data(), out.size(), dtype::fp32), rows * cols, "out");
  orthogonalize_into(ex, in.data(), rows, cols, out.data());
}

void muon_optimizer::run_gemms_only(executor& ex, std::size_t rows, std::size_t cols) {
  require_shape(rows, cols);
  const omp_team team(ex);
  const dtype gemm = storage_of(options_.gemm_dtype);
  ws_->reserve(rows, cols, gemm);
  const std::size_t m = std::min(rows, cols), n = std::max(rows, cols);
  const ns_plan& p = ws_->plan(m, n, gemm);
  for (int s = 0; s < options_.ns_steps; ++s) ws_->iteration(options_, p, m, n, s & 1, /*combine_too=*/false);
}

void muon_optimizer::step(executor& ex, const muon_matrix& mat, float grad_scale) {
  const muon_options& o = options_;
  require_shape(mat.rows, mat.cols);
  const std::size_t n = mat.rows * mat.cols;
  detail::require_buffer(const_tensor_ref(mat.param.data(), mat.param.size(), dtype::fp32), n, "param");
  detail::require_dtype(mat.grad.type, "grad", true, true, true);
  detail::require_buffer(mat.grad, n, "grad");
  detail::require_buffer(const_tensor_ref(mat.momentum_buffer.data(), mat.momentum_buffer.size(), dtype::fp32),
                         n, "momentum_buffer");
  if (!mat.param_copy.empty()) {
    detail::require_dtype(mat.param_copy.type, "param_copy", false, true, true);
    detail::require_buffer(mat.param_copy, n, "param_copy");
  }
  detail::require_grad_scale(grad_scale);

  const omp_team team(ex);
  workspace& ws = *ws_;
  ws.reserve(mat.rows, mat.cols, storage_of(o.gemm_dtype));
  float* u = ws.u.data();
  float* buf = mat.momentum_buffer.data();
  const float mu = o.momentum;
  const bool ema = o.momentum_form == muon_momentum::ema;
  const bool nest = o.nesterov == nesterov::on;
  const auto total = static_cast<std::int64_t>(n);
  constexpr std::int64_t chunk = 1 << 14;
  const std::int64_t chunks = (total + chunk - 1) / chunk;

  // u = g * grad_scale in fp32 (Highway conversion), then the momentum.
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::size_t b = static_cast<std::size_t>(c * chunk), e = std::min(n, b + chunk);
    detail::convert_range(ex.target(), mat.grad.data, mat.grad.type, u, dtype::fp32, grad_scale, b, e);
    for (std::size_t i = b; i < e; ++i) {
      const float g = u[i];
      if (ema) {
        buf[i] = buf[i] + (1.0f - mu) * (g - buf[i]);      // buf.lerp_(g, 1 - mu)
        u[i] = nest ? g + mu * (buf[i] - g) : buf[i];       // g.lerp(buf, mu)
      } else {
        buf[i] = mu * buf[i] + g;                           // buf.mul_(mu).add_(g)
        u[i] = nest ? g + mu * buf[i] : buf[i];             // g.add(buf, alpha=mu)
      }
    }
  }

  orthogonalize_into(ex, u, mat.rows, mat.cols, u);

  const float decay = 1.0f - o.lr * o.weight_decay;
  const float lr = adjusted_lr(o, mat.rows, mat.cols);
  float* p = mat.param.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::size_t b = static_cast<std::size_t>(c * chunk), e = std::min(n, b + chunk);
    for (std::size_t i = b; i < e; ++i) p[i] = p[i] * decay - lr * u[i];
    if (!mat.param_copy.empty())
      detail::convert_range(ex.target(), p, dtype::fp32, mat.param_copy.data, mat.param_copy.type, 1.0f, b, e);
  }
}

}  // namespace tierflow::optim

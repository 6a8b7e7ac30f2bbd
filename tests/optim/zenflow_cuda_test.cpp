// ZenFlow's device side on CUDA. Everywhere: its per-element Adam (shared by
// the kernel and the host) against adam_optimizer on every SIMD target, the
// host half of its gradient path (widening and accumulation on several
// threads against a scalar loop, the download slots' bookkeeping), and the
// constructor's refusals. With a GPU: the engine over cuda_zenflow_device
// against the engine over the host stand-in, with the same arithmetic on
// both, step after step, through refreshes, with and without overlap.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../core/zenflow_test_support.hpp"
#include "adam_element.hpp"
#include "cuda/gradient_staging.hpp"
#include "tierflow/optim/gradients.hpp"
#include "reference.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/zenflow/engine.hpp"
#include "tierflow/core/zenflow/standin.hpp"
#include "tierflow/optim/adam.hpp"
#include "tierflow/optim/executor.hpp"
#include "tierflow/optim/zenflow_cuda.hpp"

#if TIERFLOW_WITH_CUDA
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "tierflow/core/cuda_error.hpp"
#include "tierflow/core/cuda_handles.hpp"
#endif

namespace tierflow::optim {
namespace {

using zenflow::weight_shape;

// ---- the shared per-element arithmetic, on the CPU -----------------------------------

// adam_element over `steps` steps against adam_optimizer on target `simd`
// (fp32 everything, one thread); returns the largest relative difference of
// p, m and v (0 when bit-identical).
double element_vs_optimizer(const adam_options& o, const std::string& simd, int steps) {
  const std::size_t n = 1037;  // not a multiple of any vector width: the kernels' tails run too
  executor ex(1, simd);
  const adam_optimizer opt(o);
  std::vector<float> p = test::normal_values(n, 5, 1.0f, 0.25f), m(n, 0.0f), v(n, 0.0f);
  std::vector<float> pe = p, me = m, ve = v;
  for (int t = 1; t <= steps; ++t) {
    const std::vector<float> g = test::normal_values(n, 40 + static_cast<unsigned>(t), 0.1f);
    const adam_sub_group group{p, fp32_ref(std::span<const float>(g)), fp32_ref(std::span<float>(m)),
                               fp32_ref(std::span<float>(v)), {}, {}};
    EXPECT_EQ(opt.step(ex, group, {.step = t}), step_outcome::applied);
    const detail::adam_element_constants k = detail::make_adam_element_constants(o, t);
    for (std::size_t i = 0; i < n; ++i) detail::adam_element(k, g[i], pe[i], me[i], ve[i]);
  }
  // Relative to the element or, for one that cancelled to near zero, to the
  // RMS of its array (as adam_test measures).
  double worst = 0;
  for (const auto& [got, want] : {std::pair{&p, &pe}, std::pair{&m, &me}, std::pair{&v, &ve}}) {
    double rms = 0;
    for (const float x : *want) rms += static_cast<double>(x) * x;
    rms = std::sqrt(rms / static_cast<double>(n));
    for (std::size_t i = 0; i < n; ++i) {
      const double a = (*got)[i], b = (*want)[i];
      if (a != b) worst = std::max(worst, std::abs(a - b) / std::max(std::abs(b), rms));
    }
  }
  return worst;
}

// Bit-identical to the SIMD targets whose MulAdd is a fused multiply-add (the
// element's arithmetic fuses the same operations); within a few ulp of the
// portable path and SSE4, which round the product and the sum apart: over 20
// steps the largest difference measured there is 3.3e-7, asserted 2e-6 (the
// bound adam_test puts between the SIMD paths).
TEST(zenflow_cuda, adam_element_matches_adam_optimizer_on_every_simd_target) {
  adam_options adamw = adam_options::adamw();
  adamw.lr = 1e-2f;
  adam_options adam_l2 = adam_options::adam();
  adam_l2.weight_decay = 0.05f;
  adam_options adam_plain = adam_options::adam();  // no decay: takes AdamW's path with lr·wd = 0
  for (const adam_options& o : {adamw, adam_l2, adam_plain}) {
    for (const std::string& simd : simd_targets()) {
      const bool unfused = simd == "scalar" || simd == "sse4" || simd == "ssse3";
      const double diff = element_vs_optimizer(o, simd, 20);
      if (unfused) {
        EXPECT_LT(diff, 2e-6) << simd;
      } else {
        EXPECT_EQ(diff, 0.0) << simd << ": the fused path should agree bit for bit";
      }
    }
  }
}

// ---- the gradients' host half, on the CPU -------------------------------------------

// Sizes around the tile (16 Ki elements) and the widening piece (2 Ki): none,
// one, less than a vector, a tile and one, several tiles and a tail.
constexpr std::size_t odd_sizes[] = {0, 1, 7, 2049, 16385, 3 * 16384 + 5};

TEST(zenflow_cuda_host, widening_on_threads_matches_a_scalar_loop) {
  for (const int threads : {1, 3}) {
    for (const std::string& simd : simd_targets()) {
      executor ex(threads, simd);
      for (const dtype type : {dtype::fp32, dtype::bf16, dtype::fp16}) {
        for (const std::size_t n : odd_sizes) {
          test::typed_buffer src(type, test::normal_values(n, 7 + static_cast<unsigned>(n), 3.0f));
          std::vector<float> got(n + 1, -1.0f);  // one past the end: must stay
          widen_gradient(ex, src.data(), type, got.data(), n);
          for (std::size_t i = 0; i < n; ++i)
            ASSERT_EQ(test::bits_of(got[i]), test::bits_of(src.at(i)))
                << simd << ", " << threads << " threads, n " << n << ", element " << i;
          ASSERT_EQ(got[n], -1.0f) << "written past the end, n " << n;
        }
      }
    }
  }
}

// The engine's window sum: += over the host's column runs only, the other
// columns untouched, bit for bit the plain loop's result.
TEST(zenflow_cuda_host, accumulation_over_runs_on_threads_matches_a_scalar_loop) {
  struct shape {
    std::uint64_t rows, cols;
    std::vector<zenflow::column_run> runs;
  };
  const shape shapes[] = {
      {1, 1, {{0, 1}}},
      {7, 5, {{0, 2}, {3, 5}}},  // runs shorter than a vector
      {2049, 9, {{1, 2}, {4, 8}}},  // runs of one piece and one element
      {33, 1500, {{0, 400}, {401, 402}, {405, 1499}}},  // several tiles, a run across tile edges
      {16385, 3, {{0, 3}}},  // one run, the whole weight
  };
  for (const int threads : {1, 3}) {
    executor ex(threads);
    for (const dtype type : {dtype::fp32, dtype::bf16, dtype::fp16}) {
      for (const shape& sh : shapes) {
        const std::size_t n = sh.rows * sh.cols;
        test::typed_buffer g(type, test::normal_values(n, 11 + static_cast<unsigned>(n), 2.0f));
        std::vector<float> sum = test::normal_values(n, 3, 1.0f), want = sum;
        for (const zenflow::column_run r : sh.runs)
          for (std::uint64_t k = r.begin * sh.rows; k < r.end * sh.rows; ++k) want[k] += g.at(k);
        accumulate_gradient(ex, g.data(), type, sh.runs, sh.rows, sum);
        for (std::size_t k = 0; k < n; ++k)
          ASSERT_EQ(test::bits_of(sum[k]), test::bits_of(want[k]))
              << threads << " threads, " << sh.rows << "x" << sh.cols << ", element " << k;
      }
    }
  }
}

// The pinned slots: downloads start in the plan's order as slots free up, a
// request out of the plan replans without losing or repeating a weight, and
// a dropped weight gives its slot back.
TEST(zenflow_cuda_host, download_ring_keeps_the_plan_and_the_slots) {
  using issued = detail::download_ring::issued;
  detail::download_ring ring(2);
  const auto issue_all = [&] {
    std::vector<std::pair<std::size_t, unsigned>> out;
    while (const std::optional<issued> i = ring.issue()) out.emplace_back(i->weight, i->slot);
    return out;
  };
  using pairs = std::vector<std::pair<std::size_t, unsigned>>;

  EXPECT_FALSE(ring.begin({0, 2, 3, 5}));
  EXPECT_EQ(issue_all(), (pairs{{0, 0}, {2, 1}}));  // two slots: two downloads ahead, no more
  EXPECT_FALSE(ring.take(3).has_value());           // not yet down: a miss
  ASSERT_EQ(ring.take(0), std::optional<unsigned>(0));
  EXPECT_EQ(ring.held(), std::optional<unsigned>(0));
  EXPECT_TRUE(issue_all().empty());  // slot 0 is still being read
  ring.release(0);
  EXPECT_FALSE(ring.held().has_value());
  EXPECT_EQ(issue_all(), (pairs{{3, 0}}));  // the freed slot takes the next weight
  ASSERT_EQ(ring.take(2), std::optional<unsigned>(1));
  ring.release(1);
  EXPECT_EQ(issue_all(), (pairs{{5, 1}}));

  // Weight 5 asked first, then 3: both in flight, both found.
  ASSERT_EQ(ring.take(5), std::optional<unsigned>(1));
  ring.release(1);
  ASSERT_EQ(ring.take(3), std::optional<unsigned>(0));
  ring.release(0);
  EXPECT_TRUE(issue_all().empty());  // the plan is done

  // A new step whose first request is out of order (4 before 1): replanned
  // from 4, then what was issued but not taken (1) and what was not issued (6, 7).
  EXPECT_FALSE(ring.begin({1, 4, 6, 7}));
  EXPECT_EQ(issue_all(), (pairs{{1, 0}, {4, 1}}));
  ASSERT_EQ(ring.take(4), std::optional<unsigned>(1));
  ring.release(1);
  EXPECT_EQ(issue_all(), (pairs{{6, 1}}));
  EXPECT_FALSE(ring.take(7).has_value());
  ring.replan_from(7);
  EXPECT_EQ(issue_all(), (pairs{{7, 0}, {1, 1}}));
  ASSERT_EQ(ring.take(7), std::optional<unsigned>(0));
  ring.release(0);
  EXPECT_EQ(issue_all(), (pairs{{6, 0}}));

  // A step that ends with a download nobody took says so, and frees it.
  EXPECT_TRUE(ring.begin({2, 3}));
  EXPECT_EQ(issue_all(), (pairs{{2, 0}, {3, 1}}));

  // Dropping a weight in flight frees its slot for the next one; dropping
  // one not yet issued removes it from the plan.
  EXPECT_TRUE(ring.begin({0, 1, 2, 3}));  // 2 and 3 were never taken
  EXPECT_EQ(issue_all(), (pairs{{0, 0}, {1, 1}}));
  EXPECT_EQ(ring.drop(1), std::optional<unsigned>(1));
  EXPECT_FALSE(ring.drop(2).has_value());
  EXPECT_EQ(issue_all(), (pairs{{3, 1}}));
  ASSERT_EQ(ring.take(0), std::optional<unsigned>(0));
  ring.release(0);
  EXPECT_TRUE(issue_all().empty());
}

// ---- the constructor ---------------------------------------------------------------

std::vector<weight_shape> small_model() { return {{"w", 4, 6}, {"b", 3, 1}}; }

// Arguments refused before any CUDA call, so in every build.
TEST(zenflow_cuda, refuses_bad_arguments) {
  float host[64] = {};
  const cuda_zenflow_weight fake{host, host};
  const auto weights = small_model();
  cuda_zenflow_options ok;
  ok.compute_type = dtype::fp32;
  ok.grad_type = dtype::fp32;
  EXPECT_THROW(cuda_zenflow_device(weights, {fake}, ok), user_error);  // one tensor for two weights
  EXPECT_THROW(cuda_zenflow_device(weights, {fake, {nullptr, host}}, ok), user_error);
  EXPECT_THROW(cuda_zenflow_device({}, {}, ok), user_error);
  EXPECT_THROW(cuda_zenflow_device({{"empty", 0, 3}}, {fake}, ok), user_error);
  cuda_zenflow_options ams = ok;
  ams.adam.amsgrad = amsgrad::on;
  EXPECT_THROW(cuda_zenflow_device(weights, {fake, fake}, ams), user_error);
  cuda_zenflow_options bad_lr = ok;
  bad_lr.adam.lr = -1.0f;
  EXPECT_THROW(cuda_zenflow_device(weights, {fake, fake}, bad_lr), user_error);
  cuda_zenflow_options bad_type = ok;
  bad_type.grad_type = static_cast<dtype>(7);
  EXPECT_THROW(cuda_zenflow_device(weights, {fake, fake}, bad_type), user_error);
}

#if TIERFLOW_WITH_CUDA

bool gpu_present() {
  int count = 0;
  const bool present = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return present;
}

// Without a GPU the device cannot be made and says which call failed; with
// one, host memory is refused as the tensors.
TEST(zenflow_cuda, needs_a_gpu_and_device_memory) {
  float host[64] = {};
  const cuda_zenflow_weight fake{host, host};
  cuda_zenflow_options o;
  o.compute_type = dtype::fp32;
  o.grad_type = dtype::fp32;
  if (!gpu_present()) {
    try {
      cuda_zenflow_device device(small_model(), {fake, fake}, o);
      FAIL() << "made a CUDA device without a GPU";
    } catch (const user_error& e) {
      FAIL() << "no GPU is an environment failure, not a user error: " << e.what();
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find("cudaGetDeviceCount"), std::string::npos) << e.what();
      EXPECT_EQ(&e.code().category(), &::tierflow::detail::cuda_category()) << e.what();
    }
    return;
  }
  EXPECT_THROW(cuda_zenflow_device(small_model(), {fake, fake}, o), user_error);
  o.device = 1 << 20;
  EXPECT_THROW(cuda_zenflow_device(small_model(), {fake, fake}, o), user_error);
}

#else

TEST(zenflow_cuda, needs_a_cuda_build) {
  float host[64] = {};
  const cuda_zenflow_weight fake{host, host};
  cuda_zenflow_options o;
  try {
    cuda_zenflow_device device(small_model(), {fake, fake}, o);
    FAIL() << "made a CUDA device in a build without CUDA";
  } catch (const user_error& e) {
    EXPECT_STREQ(e.what(), "the CUDA ZenFlow device needs a CUDA build of tierflow");
  }
}

#endif

#if TIERFLOW_WITH_CUDA

// ---- the engine over the GPU against the engine over the stand-in --------------------

// adam_element as the engine's rule: the host side of both runs and the
// stand-in's device side compute exactly what the CUDA kernel computes.
class element_adam_rule final : public zenflow::update_rule {
 public:
  explicit element_adam_rule(const adam_options& o) : o_(o) {}
  zenflow::granularity unit(std::size_t) const noexcept override { return zenflow::granularity::columns; }
  std::size_t state_count() const noexcept override { return 2; }
  void apply(const zenflow::update_args& a) override {
    const detail::adam_element_constants k = detail::make_adam_element_constants(o_, a.step);
    for (std::size_t i = 0; i < a.param.size(); ++i) detail::adam_element(k, a.grad[i], a.param[i], a.state0[i], a.state1[i]);
  }
  void rebase_state(const zenflow::crossing_args& a) override { zenflow::rebase_adam_moments(a, o_.beta1, o_.beta2); }

 private:
  adam_options o_;
};

// Shapes with rows and columns of every kind: many short columns, few long
// ones, and 1-D weights (always the device's).
std::vector<weight_shape> model() {
  return {{"w0", 64, 48}, {"b0", 33, 1}, {"w1", 17, 130}, {"w2", 128, 9}, {"ln", 5, 1}};
}

// The gradient of step `step` for weight `w`. Exactly columns_to_keep(cols,
// topk) columns are 30× louder than the rest, a different set each step, so
// the selection is the same whatever the rounding of the column sums (the
// device sums in fp32, the stand-in in double). Rounded to `type`.
std::vector<float> gradient(const weight_shape& s, std::size_t w, std::uint64_t step, double topk, dtype type) {
  std::mt19937 rng(static_cast<unsigned>(1000 * step + w));
  std::normal_distribution<float> normal(0, 1);
  const std::uint64_t k = zenflow::columns_to_keep(s.cols, topk);
  EXPECT_EQ(std::gcd<std::uint64_t>(7, s.cols), 1u);  // c ↦ 7c + 5·step is a permutation
  std::vector<float> g(s.elements());
  for (std::uint64_t c = 0; c < s.cols; ++c) {
    const bool loud = s.matrix() && (7 * c + 5 * step) % s.cols < k;
    for (std::uint64_t r = 0; r < s.rows; ++r) g[c * s.rows + r] = test::round_to(type, normal(rng) * (loud ? 30.0f : 1.0f));
  }
  return g;
}

struct device_deleter {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};
using device_ptr = std::unique_ptr<void, device_deleter>;

device_ptr device_alloc(std::size_t bytes) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  return device_ptr(p);
}

struct stream_deleter {
  void operator()(CUstream_st* s) const noexcept { (void)cudaStreamDestroy(s); }
};

// How the test trainer hands the device its gradients.
enum class gradient_mode {
  constructor,  // one buffer, the constructor's; no gradients_ready()
  ready,        // one buffer, gradients_ready() each step
  // Two buffers, gradients_ready(buffer t % 2): step t+1's gradient is
  // written into the other buffer, and a "forward" that holds the trainer's
  // stream until step() has returned is enqueued, before step(t) runs.
  two_buffers_ahead,
};

// A host function on the trainer's stream that holds it until released,
// for at most `limit`: what the next forward looks like to the device side.
// If step() waited for the trainer's stream, it would return only after the
// limit, and `timed_out` says so (a failure, not a hang).
struct stream_hold {
  std::atomic<bool> released{false};
  std::atomic<bool> timed_out{false};
  static constexpr auto limit = std::chrono::seconds(20);
  static void CUDART_CB run(void* self) {
    auto* h = static_cast<stream_hold*>(self);
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!h->released.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > until) {
        h->timed_out = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
};

struct gpu_case {
  const char* name;
  zenflow::config config;
  adam_options adam;
  dtype compute = dtype::fp32;
  dtype grad = dtype::fp32;
  bool own_stream = false;   // a non-blocking stream of the trainer's, or the legacy default stream
  bool apply_early = false;  // apply the previous window before the step, as a trainer during backward
  std::uint64_t steps = 14;
  gradient_mode gradients = gradient_mode::constructor;
};

// The two engines, fed the same gradients; after every step the GPU's compute
// copy must equal the stand-in's (fp32: within 1e-6 relative, expected
// bit-identical; bf16/fp16: the stand-in's fp32 values rounded to nearest
// even, exactly) and the GPU's owned columns the engine's selection.
void run_against_standin(const gpu_case& gc) {
  SCOPED_TRACE(gc.name);
  const std::vector<weight_shape> weights = model();
  element_adam_rule rule(gc.adam);

  // The stand-in.
  zenflow::memory_host_state ref_host(weights, 2);
  zenflow::standin_device ref_device(weights, rule);
  zenflow::engine ref(gc.config, weights, ref_device, ref_host, rule);

  // The GPU.
  std::unique_ptr<CUstream_st, stream_deleter> own;
  if (gc.own_stream) {
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    own.reset(s);
  }
  const cudaStream_t stream = own.get();
  const bool two_buffers = gc.gradients == gradient_mode::two_buffers_ahead;
  std::vector<device_ptr> params, grads[2];
  std::vector<const void*> grad_pointers[2];
  std::vector<cuda_zenflow_weight> tensors;
  for (const auto& s : weights) {
    params.push_back(device_alloc(s.elements() * size_of(gc.compute)));
    for (int b = 0; b < (two_buffers ? 2 : 1); ++b) {
      grads[b].push_back(device_alloc(s.elements() * size_of(gc.grad)));
      grad_pointers[b].push_back(grads[b].back().get());
    }
    tensors.push_back({params.back().get(), grads[0].back().get()});
  }
  cuda_zenflow_options options;
  options.compute_type = gc.compute;
  options.grad_type = gc.grad;
  options.adam = gc.adam;
  options.stream = reinterpret_cast<std::uintptr_t>(stream);
  cuda_zenflow_device device(weights, tensors, options);
  zenflow::memory_host_state host(weights, 2);
  zenflow::engine eng(gc.config, weights, device, host, rule);

  for (std::size_t w = 0; w < weights.size(); ++w) {
    const auto init = zenflow::initial(w, weights[w].elements());
    ref_device.initialize(w, init);
    std::copy(init.begin(), init.end(), ref_host.buffers(w).param.begin());
    device.initialize(w, init);
    std::copy(init.begin(), init.end(), host.buffers(w).param.begin());
  }

  // Pinned, so that an upload queued behind a held stream is enqueued at
  // once; per buffer, alive until the stream has read them (compare() waits).
  std::vector<cuda_pinned_buffer> uploads[2];
  std::vector<std::vector<float>> step_gradients[2];  // the fp32 values, for the stand-in
  for (int b = 0; b < 2; ++b) {
    uploads[b].resize(weights.size());
    step_gradients[b].resize(weights.size());
  }
  // The backward of `step`: its gradients into buffer step % 2 (or 0).
  const auto backward = [&](std::uint64_t step) {
    const int b = two_buffers ? static_cast<int>(step % 2) : 0;
    for (std::size_t w = 0; w < weights.size(); ++w) {
      step_gradients[b][w] = gradient(weights[w], w, step, gc.config.topk_ratio, gc.grad);
      test::typed_buffer typed(gc.grad, step_gradients[b][w]);
      const std::size_t bytes = typed.size() * size_of(gc.grad);
      uploads[b][w].reserve(bytes, "test gradient");
      std::memcpy(uploads[b][w].data(), typed.data(), bytes);
      ASSERT_EQ(cudaMemcpyAsync(grads[b][w].get(), uploads[b][w].data(), bytes, cudaMemcpyHostToDevice, stream),
                cudaSuccess);
    }
  };
  const auto compare = [&](std::uint64_t step) {
    for (std::size_t w = 0; w < weights.size(); ++w) {
      const std::size_t n = weights[w].elements();
      test::typed_buffer got(gc.compute, std::vector<float>(n, 0.0f));
      ASSERT_EQ(cudaMemcpyAsync(got.data(), params[w].get(), n * size_of(gc.compute), cudaMemcpyDeviceToHost, stream),
                cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const std::span<const float> want = ref_device.parameters(w);
      for (std::size_t i = 0; i < n; ++i) {
        if (gc.compute == dtype::fp32) {
          ASSERT_NEAR(got.at(i), want[i], 1e-6 * std::max(1.0f, std::abs(want[i])))
              << "step " << step << " weight " << weights[w].name << " element " << i;
        } else {
          ASSERT_EQ(got.at(i), test::round_to(gc.compute, want[i]))
              << "step " << step << " weight " << weights[w].name << " element " << i;
        }
      }
      const auto sel = eng.selected(w);
      const auto owned = device.owned_columns(w);
      ASSERT_EQ(std::vector<std::uint32_t>(owned.begin(), owned.end()), std::vector<std::uint32_t>(sel.begin(), sel.end()))
          << "step " << step << " weight " << weights[w].name;
      const auto ref_sel = ref.selected(w);
      ASSERT_EQ(std::vector<std::uint32_t>(sel.begin(), sel.end()),
                std::vector<std::uint32_t>(ref_sel.begin(), ref_sel.end()))
          << "step " << step << " weight " << weights[w].name;
    }
  };

  if (two_buffers) backward(0);
  std::uint64_t held_steps = 0;
  for (std::uint64_t step = 0; step < gc.steps; ++step) {
    if (gc.apply_early && eng.will_update()) {
      eng.apply_previous_window();
      ref.apply_previous_window();
    }
    if (!two_buffers) backward(step);
    if (::testing::Test::HasFatalFailure()) return;
    const int b = two_buffers ? static_cast<int>(step % 2) : 0;
    for (std::size_t w = 0; w < weights.size(); ++w)
      std::copy(step_gradients[b][w].begin(), step_gradients[b][w].end(), ref_device.gradient(w).begin());
    if (gc.gradients != gradient_mode::constructor) device.gradients_ready(grad_pointers[b]);

    // The trainer's overlap: the device's update, then (unless the device
    // must wait for the step) the next backward into the other buffer and a
    // forward that holds the stream until step() has returned.
    stream_hold hold;
    bool held = false;
    if (two_buffers) {
      eng.update_device();
      if (!eng.device_waits_for_step()) {
        if (step + 1 < gc.steps) backward(step + 1);
        ASSERT_EQ(cudaLaunchHostFunc(stream, stream_hold::run, &hold), cudaSuccess);
        held = true;
        ++held_steps;
      }
    }
    eng.step();
    ref.step();
    if (held) {
      hold.released.store(true, std::memory_order_release);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // the hold has returned: `hold` may go
      ASSERT_FALSE(hold.timed_out.load()) << "step " << step << ": step() waited for the trainer's next forward";
    } else if (two_buffers && step + 1 < gc.steps) {
      backward(step + 1);
    }
    compare(step);
    if (::testing::Test::HasFatalFailure()) return;
  }
  if (two_buffers) {
    EXPECT_GT(held_steps, 0u) << "no step overlapped the next forward: the case tests nothing";
  }
  eng.finish();
  ref.finish();
  compare(gc.steps);
}

TEST(zenflow_cuda, engine_on_the_gpu_matches_the_standin) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: the stand-in's engine tests cover the engine";
  adam_options adamw = adam_options::adamw();
  adamw.lr = 1e-2f;
  adam_options adam_l2 = adam_options::adam();
  adam_l2.lr = 1e-2f;
  adam_l2.weight_decay = 0.02f;
  zenflow::config l2_norm = zenflow::step_config(0.25, 2, 4, true, 2);
  l2_norm.norm = zenflow::importance_norm::l2;
  const gpu_case cases[] = {
      {"fp32, no overlap, legacy stream", zenflow::step_config(0.25, 2, 4, false), adamw},
      {"fp32, overlap, warm-up, l2 importance, own stream", l2_norm, adamw, dtype::fp32, dtype::fp32, true},
      {"fp32, a refresh every step, Adam with L2", zenflow::step_config(0.25, 1, 1, false), adam_l2},
      {"fp32, overlap, applied early", zenflow::step_config(0.25, 3, 6, true), adamw, dtype::fp32, dtype::fp32, true,
       true},
      {"bf16 compute and gradients, overlap", zenflow::step_config(0.3, 2, 4, true), adamw, dtype::bf16, dtype::bf16,
       true},
      {"fp16 compute, bf16 gradients, Adam with L2", zenflow::step_config(0.3, 3, 3, false), adam_l2, dtype::fp16,
       dtype::bf16},
      {"fp32, gradients_ready() on one buffer, overlap", zenflow::step_config(0.25, 2, 4, true), adamw, dtype::fp32,
       dtype::fp32, true, false, 14, gradient_mode::ready},
      {"fp32, two buffers, the next backward and forward ahead of step(), applied early",
       zenflow::step_config(0.25, 3, 6, true), adamw, dtype::fp32, dtype::fp32, true, true, 14,
       gradient_mode::two_buffers_ahead},
      {"bf16, two buffers ahead, legacy stream", zenflow::step_config(0.3, 2, 8, true), adamw, dtype::bf16,
       dtype::bf16, false, true, 17, gradient_mode::two_buffers_ahead},
  };
  for (const gpu_case& gc : cases) {
    run_against_standin(gc);
    if (HasFatalFailure()) return;
  }
}

// Per-step gradients: checked like the constructor's, required where the
// constructor had none, and required every step once a trainer started
// naming them.
TEST(zenflow_cuda, per_step_gradients_are_checked_and_required) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device here";
  const std::vector<weight_shape> weights = small_model();  // "w" 4x6, "b" 3x1
  std::vector<device_ptr> params, grads;
  std::vector<cuda_zenflow_weight> tensors;
  for (const auto& s : weights) {
    params.push_back(device_alloc(s.elements() * sizeof(float)));
    grads.push_back(device_alloc(s.elements() * sizeof(float)));
    tensors.push_back({params.back().get(), nullptr});  // every step names its gradients
  }
  cuda_zenflow_options o;
  o.compute_type = dtype::fp32;
  o.grad_type = dtype::fp32;
  cuda_zenflow_device device(weights, tensors, o);
  EXPECT_THROW(device.update_owned(1, 1), user_error);  // no gradient named yet
  EXPECT_THROW(device.download_gradient(0), user_error);
  EXPECT_THROW(device.gradients_ready(), user_error);  // the constructor's are null

  float host[64] = {};
  const std::vector<const void*> good{grads[0].get(), grads[1].get()};
  EXPECT_THROW(device.gradients_ready(std::vector<const void*>{grads[0].get()}), user_error);
  EXPECT_THROW(device.gradients_ready(std::vector<const void*>{grads[0].get(), nullptr}), user_error);
  EXPECT_THROW(device.gradients_ready(std::vector<const void*>{grads[0].get(), host}), user_error);
  EXPECT_THROW(device.gradients_ready(std::vector<const void*>{
                   grads[0].get(), static_cast<const std::byte*>(grads[1].get()) + 2}),
               user_error);

  // Weight w's gradient: 0.5·(k + 1) for element k.
  std::vector<float> values(24);
  for (std::size_t k = 0; k < values.size(); ++k) values[k] = 0.5f * static_cast<float>(k + 1);
  ASSERT_EQ(cudaMemcpy(grads[0].get(), values.data(), 24 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  device.gradients_ready(good);
  device.update_owned(1, 1);
  device.update_owned(1, 1);  // the same step again: still this step's gradients
  const std::span<const float> down = device.download_gradient(0);
  ASSERT_EQ(down.size(), 24u);
  EXPECT_EQ(std::vector<float>(down.begin(), down.end()), values);
  // The fused path: columns 1 and 3..5 (4 rows each) added, the others kept.
  std::vector<float> sum(24, 1.0f), want(24, 1.0f);
  const zenflow::column_run runs[] = {{1, 2}, {3, 6}};
  for (const auto r : runs)
    for (std::size_t k = r.begin * 4; k < r.end * 4; ++k) want[k] += values[k];
  EXPECT_TRUE(device.accumulate_gradient(0, runs, sum));
  EXPECT_EQ(sum, want);
  const zenflow::column_run outside[] = {{5, 7}};
  EXPECT_THROW(device.accumulate_gradient(0, outside, sum), user_error);
  // Step 2 without gradients_ready(): it would read step 1's.
  EXPECT_THROW(device.update_owned(1, 2), user_error);
  device.gradients_ready(good);
  device.update_owned(1, 2);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

#endif

}  // namespace
}  // namespace tierflow::optim

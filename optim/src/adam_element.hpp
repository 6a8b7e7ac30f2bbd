// Adam's per-step constants, computed in one place for every kernel, and
// Adam/AdamW on one element, the same arithmetic on the host and on a CUDA
// device: the CPU kernels (kernels.cpp) take their constants from here, the
// device side of ZenFlow (cuda/zenflow_kernels.cu) runs adam_element per
// element, and a test runs it on the CPU against adam_optimizer.
//
// It is the arithmetic of adam_lanes in kernels.cpp with every MulAdd fused:
//
//   g  = fma(l2, p, g)                                  (Adam: L2)
//   m  = fma(1 - beta1, g - m, m)                       (torch's lerp)
//   v  = fma(1 - beta2, g * g, beta2 * v)
//   d  = fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)
//   p  = p * fp32(1 - lr * wd)                          (AdamW: torch's mul_)
//   p  = fma(-lr / (1 - beta1^t), m / d, p)
//
// AdamW's decay rounds as torch's does: the factor 1 - lr*wd is rounded to
// fp32 and p is rounded after the decay, then again after the update.
//
// Every operation is spelled out (fma, IEEE sqrt and divide, no contraction
// left to the compiler), so the host and the device round identically: the
// result is bit-identical to adam_optimizer on a SIMD target with native FMA
// (AVX2, AVX-512, NEON on AArch64, SVE), and within a few ulp of its portable
// "scalar" path, which rounds the product and the sum of MulAdd separately.
//
// No grad_scale and no amsgrad: ZenFlow's device side uses neither.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TIERFLOW_HOST_DEVICE __host__ __device__
#else
#define TIERFLOW_HOST_DEVICE
#endif

namespace tierflow::optim::detail {

// Every per-step constant, computed once per step on the host.
struct adam_element_constants {
  float l2 = 0.0f;     // Adam's weight decay folded into the gradient (0 for AdamW)
  float decay = 1.0f;  // AdamW's fp32(1 - lr * weight_decay) (1 for Adam)
  float beta2 = 0.999f;
  float one_minus_beta1 = 0.1f;
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;    // lr / (1 - beta1^t)
  float inv_bc2_sqrt = 1.0f;  // 1 / sqrt(1 - beta2^t)
  float eps = 1e-8f;
};

// The constants of step `step` (1-based) for `o`, an adam_options (adam.hpp,
// not included: the kernels compile without oneTBB's headers), with the bias
// corrections in double as adam_optimizer::step (and PyTorch) computes them.
template <class AdamOptions>
adam_element_constants make_adam_element_constants(const AdamOptions& o, std::int64_t step) {
  const bool decoupled = o.decay == decltype(o.decay)::decoupled;
  adam_element_constants k;
  // Every constant in double from the options' values and rounded once, as
  // torch's Python-float scalars reach an fp32 tensor's operation: the factor
  // of p.mul_(1 - lr * weight_decay), the weights of exp_avg.lerp_(g, 1 - beta1)
  // and exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2), and the bias
  // corrections. (Options given as fp32 values are widened exactly.)
  const auto fp32 = [](double x) { return static_cast<float>(x); };
  const double lr = o.lr, beta1 = o.beta1, beta2 = o.beta2, weight_decay = o.weight_decay;
  k.l2 = decoupled ? 0.0f : fp32(weight_decay);
  k.decay = decoupled ? fp32(1.0 - lr * weight_decay) : 1.0f;
  k.beta2 = fp32(beta2);
  k.one_minus_beta1 = fp32(1.0 - beta1);
  k.one_minus_beta2 = fp32(1.0 - beta2);
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(beta1, t);
  const double bc2 = 1.0 - std::pow(beta2, t);
  k.step_size = fp32(lr / bc1);
  k.inv_bc2_sqrt = fp32(1.0 / std::sqrt(bc2));
  k.eps = fp32(o.eps);
  return k;
}

namespace adam_ops {

// Each operation rounds once, to nearest even, on both sides. On the device
// the intrinsics also keep nvcc from contracting a product into a later add
// (it does by default) and from using approximate sqrt or division.
TIERFLOW_HOST_DEVICE inline float fused(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
TIERFLOW_HOST_DEVICE inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TIERFLOW_HOST_DEVICE inline float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TIERFLOW_HOST_DEVICE inline float quotient(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TIERFLOW_HOST_DEVICE inline float root(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

}  // namespace adam_ops

// One step of one element: updates p, m and v in place from gradient g.
TIERFLOW_HOST_DEVICE inline void adam_element(const adam_element_constants& k, float g, float& p, float& m,
                                              float& v) {
  using namespace adam_ops;
  // As kernels.cpp chooses its path: Adam without weight decay takes AdamW's
  // (with decay 1, an exact multiply), so the two round alike there too.
  const bool decoupled = k.l2 == 0.0f;
  if (decoupled) p = mul(p, k.decay);  // AdamW: torch's p.mul_(1 - lr*wd), rounded
  else g = fused(k.l2, p, g);          // Adam: g += wd * p
  m = fused(k.one_minus_beta1, sub(g, m), m);
  v = fused(k.one_minus_beta2, mul(g, g), mul(k.beta2, v));
  const float denom = fused(root(v), k.inv_bc2_sqrt, k.eps);
  p = fused(-k.step_size, quotient(m, denom), p);
}

}  // namespace tierflow::optim::detail

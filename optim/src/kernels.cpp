// Highway kernels, compiled once per SIMD target (foreach_target.h re-includes
// this file for each) and chosen at run time by the executor's target.
//
// Every attainable target is compiled, including EMU128 (portable scalar), so
// the differential tests can run each against it; SSSE3 is left out (a CPU
// with it and without SSE4 gets EMU128).
#ifndef HWY_COMPILE_ALL_ATTAINABLE
#define HWY_COMPILE_ALL_ATTAINABLE
#endif
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS HWY_SSSE3
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/cache_control.h>
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace tierflow::optim::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class D>
using u16_of = hn::Rebind<std::uint16_t, D>;

// ---- conversions -----------------------------------------------------------
// Highway 1.0's bf16 DemoteTo truncates and its emulated fp16 DemoteTo
// truncates too (and its emulated fp16 PromoteTo mishandles inf), while PyTorch rounds to nearest even: these integer versions
// round correctly on every target (and cost nothing in a memory-bound pass).

template <class D>
HWY_INLINE hn::Vec<u16_of<D>> to_bf16_bits(D d, hn::Vec<D> v) {
  const hn::RebindToUnsigned<D> du32;
  const hn::RebindToSigned<D> di32;
  const auto bits = hn::BitCast(du32, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(lsb, hn::Set(du32, 0x7FFFu))));
  const auto quiet_nan = hn::ShiftRight<16>(hn::Or(bits, hn::Set(du32, 0x00400000u)));
  const auto r = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), quiet_nan, rounded);
  (void)d;
  return hn::DemoteTo(u16_of<D>(), hn::BitCast(di32, r));  // r <= 0xFFFF: exact
}

// binary32 → binary16, nearest even, overflow to inf, subnormals, NaN kept
// quiet. Every intermediate stays within int32 (no wrap-around).
template <class D>
HWY_INLINE hn::Vec<u16_of<D>> to_f16_bits(D d, hn::Vec<D> v) {
  const hn::RebindToUnsigned<D> du32;
  const hn::RebindToSigned<D> di32;
  const auto bits = hn::BitCast(di32, v);
  const auto magnitude = hn::And(bits, hn::Set(di32, 0x7FFFFFFF));
  const auto sign16 =
      hn::BitCast(di32, hn::ShiftRight<16>(hn::And(hn::BitCast(du32, v), hn::Set(du32, 0x80000000u))));
  // |v| >= 65536 (2^16): inf, or a quiet NaN for NaN inputs.
  const auto inf_nan = hn::IfThenElse(hn::Gt(magnitude, hn::Set(di32, 0x7F800000)),
                                      hn::Set(di32, 0x7E00), hn::Set(di32, 0x7C00));
  // |v| < 2^-14: the float adder aligns the mantissa and rounds it for us.
  const auto magic = hn::Set(di32, 126 << 23);
  const auto subnormal =
      hn::Sub(hn::BitCast(di32, hn::Add(hn::BitCast(d, magnitude), hn::BitCast(d, magic))), magic);
  // Normal range: rebias the exponent, round the 13 dropped bits to even.
  const auto odd = hn::And(hn::ShiftRight<13>(magnitude), hn::Set(di32, 1));
  const auto normal = hn::ShiftRight<13>(
      hn::Add(hn::Add(hn::Sub(magnitude, hn::Set(di32, 112 << 23)), hn::Set(di32, 0xFFF)), odd));
  auto r = hn::IfThenElse(hn::Lt(magnitude, hn::Set(di32, 113 << 23)), subnormal, normal);
  r = hn::IfThenElse(hn::Gt(magnitude, hn::Set(di32, (143 << 23) - 1)), inf_nan, r);
  return hn::DemoteTo(u16_of<D>(), hn::Or(r, sign16));  // within [0, 0xFFFF]: exact
}

// binary16 → binary32, exact for every pattern (Highway 1.0's emulated
// PromoteTo, used by the SSE4 target, turns inf into 65536).
template <class D>
HWY_INLINE hn::Vec<D> from_f16_bits(D d, hn::Vec<u16_of<D>> raw) {
  const hn::RebindToUnsigned<D> du32;
  const auto h = hn::PromoteTo(du32, raw);
  const auto exp_mask = hn::Set(du32, 0x7C00u << 13);
  auto o = hn::ShiftLeft<13>(hn::And(h, hn::Set(du32, 0x7FFFu)));  // exponent and mantissa
  const auto e = hn::And(o, exp_mask);
  o = hn::Add(o, hn::Set(du32, 112u << 23));                        // rebias 15 → 127
  // inf / NaN: rebias once more, to exponent 255.
  o = hn::IfThenElse(hn::Eq(e, exp_mask), hn::Add(o, hn::Set(du32, 112u << 23)), o);
  // zero / subnormal: let the float subtraction renormalize.
  const auto renorm = hn::BitCast(
      du32, hn::Sub(hn::BitCast(d, hn::Add(o, hn::Set(du32, 1u << 23))), hn::BitCast(d, hn::Set(du32, 113u << 23))));
  o = hn::IfThenElse(hn::Eq(e, hn::Zero(du32)), renorm, o);
  return hn::BitCast(d, hn::Or(o, hn::ShiftLeft<16>(hn::And(h, hn::Set(du32, 0x8000u)))));
}

// AVX2 and AVX-512 convert fp16 in hardware (F16C), through Highway's own
// ops; the other targets keep the integer conversions above (Highway 1.0's
// emulated ones round and widen wrongly at the edges).
#if (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3) && !defined(HWY_DISABLE_F16C)
inline constexpr bool have_f16c = true;
#else
inline constexpr bool have_f16c = false;
#endif

template <dtype T, class D>
HWY_INLINE hn::Vec<D> load_f32(D d, const void* base, std::size_t i) {
  if constexpr (T == dtype::fp32) {
    return hn::LoadU(d, static_cast<const float*>(base) + i);
  } else if constexpr (T == dtype::bf16) {
    const hn::RebindToUnsigned<D> du32;
    const auto raw = hn::LoadU(u16_of<D>(), static_cast<const std::uint16_t*>(base) + i);
    return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du32, raw)));
  } else {
    if constexpr (have_f16c) {
      // F16C's VCVTPH2PS: exact for every pattern.
      const hn::Rebind<hwy::float16_t, D> df16;
      return hn::PromoteTo(d, hn::LoadU(df16, reinterpret_cast<const hwy::float16_t*>(base) + i));
    }
    return from_f16_bits(d, hn::LoadU(u16_of<D>(), static_cast<const std::uint16_t*>(base) + i));
  }
}

// AVX-512 BF16's VCVTNEPS2BF16: sixteen floats to bf16 in one instruction,
// round to nearest even, NaN kept quiet — the integer rounding above, except
// that subnormal inputs and results become signed zero. Only the AVX3 pass
// has it, and only an executor whose target is "avx512-bf16" (a CPU with
// the extension) asks for it. Inline assembly, because Highway 1.0 has no
// target with the extension, and a function attribute would keep Highway's
// ops from inlining into it.
#undef TIERFLOW_NATIVE_BF16  // redefined on each pass of foreach_target
#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64 && (defined(__GNUC__) || defined(__clang__))
#define TIERFLOW_NATIVE_BF16 1
#else
#define TIERFLOW_NATIVE_BF16 0
#endif
inline constexpr bool have_native_bf16 = TIERFLOW_NATIVE_BF16;

template <dtype T, bool Native = false, class D>
HWY_INLINE void store_f32(D d, hn::Vec<D> v, void* base, std::size_t i) {
  if constexpr (T == dtype::fp32) {
    hn::StoreU(v, d, static_cast<float*>(base) + i);
  } else if constexpr (T == dtype::bf16) {
#if TIERFLOW_NATIVE_BF16
    if constexpr (Native && hn::MaxLanes(D()) == 16) {
      __m256i packed;
      asm("vcvtneps2bf16 %1, %0" : "=v"(packed) : "v"(v.raw));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i), packed);
      return;
    }
#endif
    hn::StoreU(to_bf16_bits(d, v), u16_of<D>(), static_cast<std::uint16_t*>(base) + i);
  } else {
    if constexpr (have_f16c) {
      // F16C's VCVTPS2PH with round-to-nearest-even: the integer rounding's
      // results (subnormals, overflow to inf), in one instruction.
      const hn::Rebind<hwy::float16_t, D> df16;
      hn::StoreU(hn::DemoteTo(df16, v), df16, reinterpret_cast<hwy::float16_t*>(base) + i);
      return;
    }
    hn::StoreU(to_f16_bits(d, v), u16_of<D>(), static_cast<std::uint16_t*>(base) + i);
  }
}

// Calls f(std::integral_constant<dtype, T>) for the run-time dtype `t`.
template <class F>
HWY_INLINE void with_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::fp32: f(std::integral_constant<dtype, dtype::fp32>{}); return;
    case dtype::bf16: f(std::integral_constant<dtype, dtype::bf16>{}); return;
    case dtype::fp16: f(std::integral_constant<dtype, dtype::fp16>{}); return;
  }
}

// ---- Adam ------------------------------------------------------------------

// The step's constants broadcast once and its pointers copied out of the
// argument struct before the loop. Reading them through `const
// adam_kernel_args&` inside the loop made the compiler reload every field
// after every store (a float store may alias the struct's float fields):
// eight extra loads per vector, measured at ~10% of single-thread bandwidth.
template <class D>
struct adam_consts {
  hn::Vec<D> grad_scale, l2, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay;
  adam_consts(D d, const adam_kernel_args& a)
      : grad_scale(hn::Set(d, a.grad_scale)),
        l2(hn::Set(d, a.k.l2)),
        one_minus_beta1(hn::Set(d, a.k.one_minus_beta1)),
        beta2(hn::Set(d, a.k.beta2)),
        one_minus_beta2(hn::Set(d, a.k.one_minus_beta2)),
        inv_bc2_sqrt(hn::Set(d, a.k.inv_bc2_sqrt)),
        eps(hn::Set(d, a.k.eps)),
        step_size(hn::Set(d, a.k.step_size)),
        decay(hn::Set(d, a.k.decay)) {}
};

struct adam_pointers {
  float* HWY_RESTRICT param;
  const void* HWY_RESTRICT grad;
  void* HWY_RESTRICT exp_avg;
  void* HWY_RESTRICT exp_avg_sq;
  void* HWY_RESTRICT max_exp_avg_sq;
  void* HWY_RESTRICT param_copy;
};

template <dtype G, dtype S, copy_kind C, bool Ams, bool Decoupled, bool Native, class D>
HWY_INLINE void adam_lanes(D d, const adam_consts<D>& k, const adam_pointers& a, std::size_t i) {
  auto g = hn::Mul(load_f32<G>(d, a.grad, i), k.grad_scale);
  auto p = hn::LoadU(d, a.param + i);
  // AdamW's decay first, rounded, as torch's p.mul_(1 - lr*wd): p is then
  // rounded again by the update, so the result rounds as torch's does. The
  // decayed p must reach the update as the addend of a MulAdd: GCC contracts
  // (-ffp-contract=fast) this Mul into a later plain Sub, dropping the
  // rounding (tried: 30% of AdamW's elements off torch's by an ulp again).
  if constexpr (Decoupled) p = hn::Mul(p, k.decay);
  else g = hn::MulAdd(k.l2, p, g);  // Adam: g += wd * p
  auto m = load_f32<S>(d, a.exp_avg, i);
  auto v = load_f32<S>(d, a.exp_avg_sq, i);
  m = hn::MulAdd(k.one_minus_beta1, hn::Sub(g, m), m);
  v = hn::MulAdd(k.one_minus_beta2, hn::Mul(g, g), hn::Mul(k.beta2, v));
  // The moments leave first: their stores do not wait for the sqrt and divide.
  store_f32<S, Native>(d, m, a.exp_avg, i);
  store_f32<S, Native>(d, v, a.exp_avg_sq, i);
  auto v_hat = v;
  if constexpr (Ams) {
    v_hat = hn::Max(load_f32<S>(d, a.max_exp_avg_sq, i), v);
    store_f32<S, Native>(d, v_hat, a.max_exp_avg_sq, i);
  }
  const auto denom = hn::MulAdd(hn::Sqrt(v_hat), k.inv_bc2_sqrt, k.eps);
  p = hn::NegMulAdd(k.step_size, hn::Div(m, denom), p);
  store_f32<dtype::fp32>(d, p, a.param, i);
  if constexpr (C == copy_kind::bf16) store_f32<dtype::bf16, Native>(d, p, a.param_copy, i);
  if constexpr (C == copy_kind::fp16) store_f32<dtype::fp16>(d, p, a.param_copy, i);
}

// Bytes ahead of the element being updated at which each input stream is
// prefetched: four cache lines. Measured on Zen 4 at one thread against the
// same loop without it: +4%; at 512 bytes +2%, and at 1 KiB and beyond slower
// (the lines arrive before they are needed and are evicted by the other
// streams' traffic). Non-temporal stores were 30% slower (the lines were just
// read, so streaming them out only adds evictions).
inline constexpr std::size_t prefetch_bytes = 256;

template <dtype T>
HWY_INLINE void prefetch_ahead(const void* base, std::size_t i) {
  hwy::Prefetch(static_cast<const unsigned char*>(base) + i * size_of(T) + prefetch_bytes);
}

template <dtype G, dtype S, copy_kind C, bool Ams, bool Decoupled, bool Native>
HWY_NOINLINE void adam_loop(const adam_kernel_args& args, std::size_t begin, std::size_t end) {
  using D = hn::ScalableTag<float>;
  const D d;
  const adam_consts<D> k(d, args);
  const adam_pointers a{args.param, args.grad, args.exp_avg, args.exp_avg_sq, args.max_exp_avg_sq,
                        args.param_copy};
  const std::size_t lanes = hn::Lanes(d);
  std::size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    // One prefetch per stream per vector: with 16 fp32 lanes that is one per
    // cache line; with narrower vectors a few land on the same line (cheap).
    // A prefetch past the end of a buffer is a hint and never faults.
    prefetch_ahead<G>(a.grad, i);
    prefetch_ahead<dtype::fp32>(a.param, i);
    prefetch_ahead<S>(a.exp_avg, i);
    prefetch_ahead<S>(a.exp_avg_sq, i);
    adam_lanes<G, S, C, Ams, Decoupled, Native>(d, k, a, i);
  }
  using D1 = hn::CappedTag<float, 1>;
  const D1 d1;
  const adam_consts<D1> k1(d1, args);
  for (; i < end; ++i) adam_lanes<G, S, C, Ams, Decoupled, Native>(d1, k1, a, i);
}

void AdamRange(const adam_kernel_args& a, std::size_t begin, std::size_t end) {
  with_dtype(a.grad_type, [&](auto g) {
    with_dtype(a.state_type, [&](auto s) {
      if constexpr (s.value != dtype::fp16) {  // fp16 moments are refused upstream
        auto with_native = [&](auto copy, auto native) {
          const bool decoupled = a.k.l2 == 0.0f;  // AdamW, or Adam without weight decay
          constexpr bool N = native.value;
          if (a.amsgrad) {
            if (decoupled) adam_loop<g.value, s.value, copy.value, true, true, N>(a, begin, end);
            else adam_loop<g.value, s.value, copy.value, true, false, N>(a, begin, end);
          } else {
            if (decoupled) adam_loop<g.value, s.value, copy.value, false, true, N>(a, begin, end);
            else adam_loop<g.value, s.value, copy.value, false, false, N>(a, begin, end);
          }
        };
        auto run = [&](auto copy) {
          // Only loops that write bf16 have a native variant.
          if constexpr (have_native_bf16 && (s.value == dtype::bf16 || copy.value == copy_kind::bf16)) {
            if (a.native_bf16) return with_native(copy, std::true_type{});
          }
          with_native(copy, std::false_type{});
        };
        switch (a.copy) {
          case copy_kind::none: run(std::integral_constant<copy_kind, copy_kind::none>{}); break;
          case copy_kind::bf16: run(std::integral_constant<copy_kind, copy_kind::bf16>{}); break;
          case copy_kind::fp16: run(std::integral_constant<copy_kind, copy_kind::fp16>{}); break;
        }
      }
    });
  });
}

// ---- non-finite check ----------------------------------------------------------
// x * 0 is 0 for finite x and NaN for inf or NaN: one FMA per vector, no
// mask traffic; the accumulator turns NaN for the first bad element and stays so.

template <dtype T>
HWY_NOINLINE bool all_finite_loop(const void* data, float scale, std::size_t begin, std::size_t end) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  const auto zero = hn::Zero(d);
  const auto s = hn::Set(d, scale);
  auto acc = hn::Zero(d);
  std::size_t i = begin;
  for (; i + lanes <= end; i += lanes) acc = hn::MulAdd(hn::Mul(load_f32<T>(d, data, i), s), zero, acc);
  if (!hn::AllFalse(d, hn::IsNaN(acc))) return false;
  const hn::CappedTag<float, 1> d1;
  auto acc1 = hn::Zero(d1);
  for (; i < end; ++i)
    acc1 = hn::MulAdd(hn::Mul(load_f32<T>(d1, data, i), hn::Set(d1, scale)), hn::Zero(d1), acc1);
  return hn::AllFalse(d1, hn::IsNaN(acc1));
}

bool AllFinite(const void* data, dtype type, float scale, std::size_t begin, std::size_t end) {
  bool ok = true;
  with_dtype(type, [&](auto t) { ok = all_finite_loop<t.value>(data, scale, begin, end); });
  return ok;
}

// ---- the STREAM-style bound ----------------------------------------------------

void StreamRange(float* p, const float* g, float* m, float* v, std::size_t begin, std::size_t end) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  std::size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    // The same prefetch as the Adam loop: the bound is the best this access
    // pattern reaches, so it gets every help the kernel it bounds gets.
    prefetch_ahead<dtype::fp32>(g, i);
    prefetch_ahead<dtype::fp32>(p, i);
    prefetch_ahead<dtype::fp32>(m, i);
    prefetch_ahead<dtype::fp32>(v, i);
    const auto gv = hn::LoadU(d, g + i);
    hn::StoreU(hn::Add(hn::LoadU(d, p + i), gv), d, p + i);
    hn::StoreU(hn::Add(hn::LoadU(d, m + i), gv), d, m + i);
    hn::StoreU(hn::Add(hn::LoadU(d, v + i), gv), d, v + i);
  }
  for (; i < end; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

// ---- conversions ------------------------------------------------------------------

template <dtype S, dtype T, bool Native>
HWY_NOINLINE void convert_loop(const void* src, void* dst, float scale, std::size_t begin,
                               std::size_t end) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  std::size_t i = begin;
  for (; i + lanes <= end; i += lanes)
    store_f32<T, Native>(d, hn::Mul(load_f32<S>(d, src, i), hn::Set(d, scale)), dst, i);
  const hn::CappedTag<float, 1> d1;
  for (; i < end; ++i) store_f32<T>(d1, hn::Mul(load_f32<S>(d1, src, i), hn::Set(d1, scale)), dst, i);
}

void ConvertRange(const void* src, dtype src_type, void* dst, dtype dst_type, float scale, bool native_bf16,
                  std::size_t begin, std::size_t end) {
  with_dtype(src_type, [&](auto s) {
    with_dtype(dst_type, [&](auto t) {
      if constexpr (have_native_bf16 && t.value == dtype::bf16) {
        if (native_bf16) return convert_loop<s.value, t.value, true>(src, dst, scale, begin, end);
      }
      convert_loop<s.value, t.value, false>(src, dst, scale, begin, end);
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace tierflow::optim::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tierflow::optim::detail {

HWY_EXPORT(AdamRange);
HWY_EXPORT(AllFinite);
HWY_EXPORT(StreamRange);
HWY_EXPORT(ConvertRange);

namespace {

// The slot of `target` in an HWY_EXPORT table (Highway's ChosenTarget layout:
// one slot per target bit, the last for EMU128/SCALAR). Indexing the table
// ourselves keeps the choice per executor instead of process-wide.
std::size_t table_index(std::int64_t target) {
  target &= ~native_bf16_bit;  // the AVX3 kernels either way
  return hwy::Num0BitsBelowLS1Bit_Nonzero64(static_cast<std::uint64_t>(
      HWY_CHOSEN_TARGET_SHIFT(target) | HWY_CHOSEN_TARGET_MASK_SCALAR));
}

const char* target_name(std::int64_t target) {
  switch (target) {
#if HWY_ARCH_X86
    case HWY_AVX3_DL: return "avx512-dl";
    case HWY_AVX3: return "avx512";
    case HWY_AVX2: return "avx2";
    case HWY_SSE4: return "sse4";
    case HWY_SSSE3: return "ssse3";
#endif
#if HWY_ARCH_ARM
    case HWY_SVE2_128: return "sve2-128";
    case HWY_SVE_256: return "sve-256";
    case HWY_SVE2: return "sve2";
    case HWY_SVE: return "sve";
    case HWY_NEON: return "neon";
#endif
    case HWY_EMU128: return "scalar";
    case HWY_SCALAR: return "scalar";
    default: return hwy::TargetName(target);
  }
}

}  // namespace

std::vector<std::pair<std::int64_t, std::string>> available_targets() {
  std::vector<std::pair<std::int64_t, std::string>> out;
  // Lower bits are better targets: walk from the lowest set bit up.
  for (std::int64_t t : hwy::SupportedAndGeneratedTargets()) {
#if HWY_ARCH_X86_64 && (defined(__GNUC__) || defined(__clang__))
    // AVX-512 with the BF16 extension first: the AVX3 kernels with native
    // bf16 stores (see store_f32).
    if (t == HWY_AVX3 && __builtin_cpu_supports("avx512bf16")) out.emplace_back(t | native_bf16_bit, "avx512-bf16");
#endif
    out.emplace_back(t, target_name(t));
  }
  return out;
}

void adam_range(std::int64_t target, const adam_kernel_args& args, std::size_t begin,
                std::size_t end) {
  if ((target & native_bf16_bit) != 0) {
    adam_kernel_args native = args;
    native.native_bf16 = true;
    HWY_DISPATCH_TABLE(AdamRange)[table_index(target)](native, begin, end);
    return;
  }
  HWY_DISPATCH_TABLE(AdamRange)[table_index(target)](args, begin, end);
}

bool all_finite(std::int64_t target, const void* data, dtype type, float scale,
                std::size_t begin, std::size_t end) {
  return HWY_DISPATCH_TABLE(AllFinite)[table_index(target)](data, type, scale, begin, end);
}

void stream_range(std::int64_t target, float* p, const float* g, float* m, float* v,
                  std::size_t begin, std::size_t end) {
  HWY_DISPATCH_TABLE(StreamRange)[table_index(target)](p, g, m, v, begin, end);
}

void convert_range(std::int64_t target, const void* src, dtype src_type, void* dst,
                   dtype dst_type, float scale, std::size_t begin, std::size_t end) {
  HWY_DISPATCH_TABLE(ConvertRange)[table_index(target)](src, src_type, dst, dst_type, scale,
                                                         (target & native_bf16_bit) != 0, begin, end);
}

}  // namespace tierflow::optim::detail
#endif  // HWY_ONCE

// The plain loops behind bound::stream_bound. This file is compiled on its own
// (bench/CMakeLists.txt: -O3, none of tierflow's SIMD code): the compiler
// vectorises the loops itself, once per x86-64 level (target_clones), and the
// loader picks the clone this CPU runs, so a binary carried to an older
// machine runs the baseline clone instead of dying of an illegal instruction.
#include "stream_bound.hpp"

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tierflow/core/error.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TF_BOUND_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TF_BOUND_CLONES  // other architectures: the baseline ISA only
#endif

namespace tierflow::bound {

std::size_t adam_streams::bytes_per_param() const noexcept {
  return 4 + 4 + grad_bytes * (grad_read_twice ? 2 : 1) + 4 * state_bytes + copy_bytes;
}

// ---- team ---------------------------------------------------------------------

team::team(int threads) : size_(threads), start_(threads), done_(threads) {
  if (threads < 1) throw user_error("stream bound: threads must be at least 1, got " + std::to_string(threads));
  for (int k = 1; k < threads; ++k) workers_.emplace_back([this, k] { work(k); });
}

team::~team() {
  stop_ = true;  // seen by the workers after the barrier below, which orders it
  start_.arrive_and_wait();
}

void team::work(int k) {
  for (;;) {
    // The barrier's completion synchronises with every arrival: job_ and
    // stop_, written before the caller arrived, are visible here.
    start_.arrive_and_wait();
    if (stop_) return;
    (*job_)(k);
    done_.arrive_and_wait();
  }
}

void team::run(const std::function<void(int)>& job) {
  job_ = &job;
  start_.arrive_and_wait();
  job(0);
  done_.arrive_and_wait();  // and the workers' writes are visible to the caller
}

// ---- the loops ----------------------------------------------------------------

namespace detail {

// A 16-bit stream is handled as the upper half of an fp32 (bf16's layout):
// the bound counts bytes, so fp16 streams go through the same loop.
template <class T>
[[gnu::always_inline]] inline float widen(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return std::bit_cast<float>(static_cast<std::uint32_t>(x) << 16);
}
template <class T>
[[gnu::always_inline]] inline T narrow(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16);
}

// Adam's traffic with one add in place of its arithmetic: reads p, g, m, v,
// writes p, m, v and, when there is one, the 16-bit copy of p.
template <class G, class S, bool Copy>
[[gnu::always_inline]] inline void adam_loop(float* __restrict p, const G* __restrict g, S* __restrict m,
                                             S* __restrict v, std::uint16_t* __restrict copy, std::size_t begin,
                                             std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    const float gi = widen(g[i]);
    const float pi = p[i] + gi;
    p[i] = pi;
    m[i] = narrow<S>(widen(m[i]) + gi);
    v[i] = narrow<S>(widen(v[i]) + gi);
    if constexpr (Copy) copy[i] = narrow<std::uint16_t>(pi);
  }
}

// The finite check's read of g: every bit pattern ORed (vectorises, unlike a
// float sum, and cannot be dropped since the result is stored).
template <class G>
[[gnu::always_inline]] inline std::uint32_t or_bits(const G* __restrict g, std::size_t begin, std::size_t end) {
  std::uint32_t acc = 0;
  for (std::size_t i = begin; i < end; ++i) {
    if constexpr (std::is_same_v<G, float>) acc |= std::bit_cast<std::uint32_t>(g[i]);
    else acc |= g[i];
  }
  return acc;
}

struct pass_args {
  std::byte *p, *g, *m, *v, *copy;
  unsigned grad_bytes, state_bytes, copy_bytes;
  bool grad_read_twice;
};

TF_BOUND_CLONES std::uint32_t adam_pass(const pass_args& a, std::size_t begin, std::size_t end) {
  auto* p = reinterpret_cast<float*>(a.p);
  auto* copy = reinterpret_cast<std::uint16_t*>(a.copy);
  std::uint32_t seen = 0;
  auto run = [&]<class G, class S>(G*, S*) {
    const auto* g = reinterpret_cast<const G*>(a.g);
    auto* m = reinterpret_cast<S*>(a.m);
    auto* v = reinterpret_cast<S*>(a.v);
    if (a.grad_read_twice) seen = or_bits(g, begin, end);
    if (a.copy_bytes != 0) adam_loop<G, S, true>(p, g, m, v, copy, begin, end);
    else adam_loop<G, S, false>(p, g, m, v, copy, begin, end);
  };
  using u16 = std::uint16_t;
  if (a.grad_bytes == 4 && a.state_bytes == 4) run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (a.grad_bytes == 4) run(static_cast<float*>(nullptr), static_cast<u16*>(nullptr));
  else if (a.state_bytes == 4) run(static_cast<u16*>(nullptr), static_cast<float*>(nullptr));
  else run(static_cast<u16*>(nullptr), static_cast<u16*>(nullptr));
  return seen;
}

}  // namespace detail

// ---- stream_bound -------------------------------------------------------------

namespace {

void check_widths(const adam_streams& s) {
  auto ok = [](unsigned w, bool zero_ok) { return w == 4 || w == 2 || (zero_ok && w == 0); };
  if (!ok(s.grad_bytes, false) || !ok(s.state_bytes, false) || (s.copy_bytes != 0 && s.copy_bytes != 2)) {
    throw user_error("stream bound: stream widths must be 4 or 2 bytes (the copy 0 or 2)");
  }
}

double seconds_of(const auto& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

stream_bound::stream_bound(std::size_t params, adam_streams streams, int threads, tiers::huge_pages pages)
    : params_(params), streams_(streams), team_(threads) {
  if (params == 0) throw user_error("stream bound: no parameters");
  check_widths(streams);
  p_ = map(params * 4, pages);
  g_ = map(params * streams.grad_bytes, pages);
  m_ = map(params * streams.state_bytes, pages);
  v_ = map(params * streams.state_bytes, pages);
  if (streams.copy_bytes != 0) copy_ = map(params * streams.copy_bytes, pages);
  copy_length_ = (streams.bytes_per_param() * params / 2 + 63) / 64 * 64;
  copy_source_ = map(copy_length_, pages);
  copy_target_ = map(copy_length_, pages);

  // First touch in the passes' partition, so each page sits where it is streamed.
  const float half = 0.5f, grad = 1e-3f;
  team_.run([&](int k) {
    const auto [b, e] = share(k, params_);
    for (std::size_t i = b; i < e; ++i) std::memcpy(p_ + i * 4, &half, 4);
    for (std::size_t i = b; i < e; ++i) {
      std::memcpy(g_ + i * streams_.grad_bytes, reinterpret_cast<const std::byte*>(&grad) + (4 - streams_.grad_bytes),
                  streams_.grad_bytes);  // little-endian: the upper half is bf16's
    }
    std::memset(m_ + b * streams_.state_bytes, 0, (e - b) * streams_.state_bytes);
    std::memset(v_ + b * streams_.state_bytes, 0, (e - b) * streams_.state_bytes);
    if (copy_ != nullptr) std::memset(copy_ + b * streams_.copy_bytes, 0, (e - b) * streams_.copy_bytes);
    const auto [cb, ce] = share(k, copy_length_);
    std::memset(copy_source_ + cb, 0x5a, ce - cb);
    std::memset(copy_target_ + cb, 0, ce - cb);
  });
}

std::byte* stream_bound::map(std::size_t bytes, tiers::huge_pages pages) {
  // Each stream at a 2 MiB boundary plus its own colour, k × (4 KiB + 64 B),
  // so that element i of the streams falls on different pages and cache sets
  // (power-of-two sized mappings would otherwise alias).
  constexpr std::size_t huge = std::size_t{2} << 20;
  const std::size_t offset = regions_.size() * (4096 + 64) % huge;
  region r;
  r.mapping = tiers::host_region::map(
      {.bytes = bytes + 2 * huge, .pages = pages, .pre_touch = false, .pin = tiers::pinning::none});
  const auto base = reinterpret_cast<std::uintptr_t>(r.mapping.data());
  r.data = reinterpret_cast<std::byte*>((base + huge - 1) / huge * huge + offset);
  regions_.push_back(std::move(r));
  return regions_.back().data;
}

// Thread k's part of [0, count): contiguous, starting on a multiple of 64
// elements so no two threads write the same cache line.
std::pair<std::size_t, std::size_t> stream_bound::share(int k, std::size_t count) const noexcept {
  const auto t = static_cast<std::size_t>(team_.size());
  auto edge = [&](std::size_t j) { return j == t ? count : count * j / t / 64 * 64; };
  return {edge(static_cast<std::size_t>(k)), edge(static_cast<std::size_t>(k) + 1)};
}

double stream_bound::stream_pass() {
  const detail::pass_args a{p_, g_, m_, v_, copy_, streams_.grad_bytes, streams_.state_bytes, streams_.copy_bytes,
                            streams_.grad_read_twice};
  std::vector<std::uint32_t> seen(static_cast<std::size_t>(team_.size()) * 16);  // a cache line each
  const std::function<void(int)> job = [&](int k) {
    const auto [b, e] = share(k, params_);
    seen[static_cast<std::size_t>(k) * 16] = detail::adam_pass(a, b, e);
  };
  return seconds_of([&] { team_.run(job); });
}

double stream_bound::memcpy_pass() {
  const std::function<void(int)> job = [&](int k) {
    const auto [b, e] = share(k, copy_length_);
    std::memcpy(copy_target_ + b, copy_source_ + b, e - b);
  };
  return seconds_of([&] { team_.run(job); });
}

}  // namespace tierflow::bound

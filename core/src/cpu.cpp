#include "tierflow/core/cpu.hpp"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif

namespace tierflow {
namespace {

std::string trim(std::string s) {
  const auto first = s.find_first_not_of(" \t");
  const auto last = s.find_last_not_of(" \t\n");
  return first == std::string::npos ? std::string() : s.substr(first, last - first + 1);
}

// "model name" (x86) or "CPU part"/"Hardware" (ARM) from /proc/cpuinfo.
std::string model_from_proc() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    for (std::string_view key : {"model name", "Hardware", "Model"}) {
      if (line.starts_with(key)) {
        if (auto colon = line.find(':'); colon != std::string::npos) return trim(line.substr(colon + 1));
      }
    }
  }
  return "unknown";
}

#if defined(__x86_64__) || defined(__i386__)

struct regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

regs cpuid(unsigned leaf, unsigned subleaf = 0) {
  regs r;
  __cpuid_count(leaf, subleaf, r.a, r.b, r.c, r.d);
  return r;
}

bool bit(unsigned value, int n) { return (value >> n) & 1u; }

std::uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (std::uint64_t{hi} << 32) | lo;
}

cpu_features probe_x86() {
  cpu_features f;
  const regs r0 = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &r0.b, 4);
  std::memcpy(vendor + 4, &r0.d, 4);
  std::memcpy(vendor + 8, &r0.c, 4);
  f.vendor = vendor;

  if (cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const regs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i + 0, &r.a, 4);
      std::memcpy(brand + 16 * i + 4, &r.b, 4);
      std::memcpy(brand + 16 * i + 8, &r.c, 4);
      std::memcpy(brand + 16 * i + 12, &r.d, 4);
    }
    f.model = trim(brand);
  }
  if (f.model.empty()) f.model = model_from_proc();

  const unsigned max_leaf = r0.a;
  const regs r1 = cpuid(1);
  const bool osxsave = bit(r1.c, 27);
  const std::uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;             // XMM and YMM state
  const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;     // XTILECFG, XTILEDATA

  regs r7, r7_1;
  if (max_leaf >= 7) {
    r7 = cpuid(7, 0);
    r7_1 = cpuid(7, 1);
  }
  auto add = [&](bool present, const char* name) {
    if (present) f.extensions.emplace_back(name);
    return present;
  };
  add(bit(r1.c, 19), "sse4_1");
  const bool fma = add(bit(r1.c, 12) && os_avx, "fma");
  const bool f16c = add(bit(r1.c, 29) && os_avx, "f16c");
  const bool avx2 = add(bit(r7.b, 5) && os_avx, "avx2");
  const bool avx512f = add(bit(r7.b, 16) && os_avx512, "avx512f");
  const bool avx512dq = add(bit(r7.b, 17) && os_avx512, "avx512dq");
  const bool avx512bw = add(bit(r7.b, 30) && os_avx512, "avx512bw");
  const bool avx512vl = add(bit(r7.b, 31) && os_avx512, "avx512vl");
  add(bit(r7.c, 11) && os_avx512, "avx512_vnni");
  const bool avx512bf16 = add(bit(r7_1.a, 5) && os_avx512, "avx512_bf16");
  add(bit(r7.d, 23) && os_avx512, "avx512_fp16");
  const bool amx_bf16 = add(bit(r7.d, 22) && os_amx, "amx_bf16");
  const bool amx_tile = add(bit(r7.d, 24) && os_amx, "amx_tile");

  const bool level_avx2 = avx2 && fma && f16c;
  const bool level_avx512 = level_avx2 && avx512f && avx512dq && avx512bw && avx512vl;
  if (level_avx512 && amx_tile && amx_bf16) f.simd = "amx";
  else if (level_avx512 && avx512bf16) f.simd = "avx512-bf16";
  else if (level_avx512) f.simd = "avx512";
  else if (level_avx2) f.simd = "avx2";
  else f.simd = "scalar";
  return f;
}

#endif

}  // namespace

cpu_features probe_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  return probe_x86();
#elif defined(__aarch64__)
  cpu_features f;
  f.vendor = "arm";
  f.model = model_from_proc();
  const unsigned long hw = getauxval(AT_HWCAP);
  f.extensions.emplace_back("neon");
  f.simd = "neon";
  if (hw & HWCAP_SVE) {
    f.extensions.emplace_back("sve");
    f.simd = "sve";
  }
  return f;
#else
  return cpu_features{"unknown", model_from_proc(), "scalar", {}};
#endif
}

}  // namespace tierflow

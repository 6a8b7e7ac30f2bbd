// What the CPU can do, probed at run time (never assumed from build flags).
#pragma once

#include <string>
#include <vector>

namespace tierflow {

// The widest SIMD level usable by this process on this CPU, as `tierflow info`
// names it: "scalar", "avx2", "avx512", "avx512-bf16", "amx" on x86-64;
// "neon", "sve" on ARM. A level counts only when the OS also saves its
// registers (XCR0), so a kernel that disabled AVX-512 reports "avx2".
struct cpu_features {
  std::string vendor;
  std::string model;
  std::string simd;                     // the best level, see above
  std::vector<std::string> extensions;  // every relevant extension found, e.g. "avx512_bf16"
};

cpu_features probe_cpu();

}  // namespace tierflow

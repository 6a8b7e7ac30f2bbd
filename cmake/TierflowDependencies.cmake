# Every dependency comes from the system (Debian packages, see scripts/setup.sh):
# found here, never vendored, never downloaded at build time.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(TBB REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 2.1 REQUIRED)

pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing>=2.3)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc>=2.0)
pkg_check_modules(NUMA REQUIRED IMPORTED_TARGET numa)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash>=0.8)
# collectives/: Gloo's TCP transport for host-buffer collectives (the target `gloo`).
find_package(Gloo CONFIG REQUIRED)

if(TIERFLOW_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(TIERFLOW_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# optim/: Highway for the run-time-dispatched SIMD kernels; oneDNN for Muon's
# GEMMs (bf16 on AVX512-BF16/AMX, fp32 elsewhere — Debian's OpenBLAS has no
# bf16 GEMM), whose Debian build runs on OpenMP. Debian's dnnl-config.cmake
# insists on OpenCL (its GPU runtime), which tierflow never uses: the library
# and header are found directly instead.
find_package(hwy REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_path(TIERFLOW_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp REQUIRED)
find_library(TIERFLOW_DNNL_LIBRARY NAMES dnnl REQUIRED)
if(NOT TARGET DNNL::dnnl)
  add_library(DNNL::dnnl UNKNOWN IMPORTED)
  set_target_properties(DNNL::dnnl PROPERTIES
    IMPORTED_LOCATION ${TIERFLOW_DNNL_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${TIERFLOW_DNNL_INCLUDE_DIR})
endif()

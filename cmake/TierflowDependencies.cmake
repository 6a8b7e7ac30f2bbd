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

if(TIERFLOW_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(TIERFLOW_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

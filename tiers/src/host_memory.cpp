#include "tierflow/tiers/host_memory.hpp"

#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/core/units.hpp"
#include "tierflow/tiers/cuda_probe.hpp"

#if TIERFLOW_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tierflow::tiers {
namespace {

constexpr std::uint64_t small_page = 4096;
constexpr std::uint64_t huge_page = 2u << 20;

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Faults every page in from `threads` threads, each over its own slice (2 MiB
// aligned, so a huge page is never split between two): the page faults —
// zeroing, and allocation on the bound node — run in parallel instead of
// inside a single-threaded mlock or at first use. Each slice is populated by
// madvise(MADV_POPULATE_WRITE) (Linux 5.14+: in-kernel, no user fault per
// page); where the kernel lacks it, by writing one byte per page.
void pre_touch(std::byte* data, std::uint64_t size, unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const std::uint64_t slices = (size + huge_page - 1) / huge_page;
  threads = static_cast<unsigned>(std::min<std::uint64_t>(threads, slices));
  auto touch = [&](std::uint64_t first, std::uint64_t last) {
    std::byte* begin = data + first;
    const std::uint64_t length = last - first;
#ifdef MADV_POPULATE_WRITE
    if (::madvise(begin, length, MADV_POPULATE_WRITE) == 0) return;
#endif
    for (std::uint64_t off = 0; off < length; off += small_page) {
      // volatile: the store must happen, to fault the page in.
      *reinterpret_cast<volatile char*>(begin + off) = 0;
    }
  };
  if (threads <= 1) {
    touch(0, size);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(threads);
  const std::uint64_t per = (slices + threads - 1) / threads * huge_page;
  for (unsigned t = 0; t < threads; ++t) {
    const std::uint64_t first = t * per;
    const std::uint64_t last = std::min(size, first + per);
    if (first >= last) break;
    workers.emplace_back(touch, first, last);
  }
  for (std::thread& w : workers) w.join();
}

int nearest_gpu_node(int device) {
  const cuda_status cuda = probe_cuda();
  for (const gpu& g : cuda.devices)
    if (g.index == device) return g.numa_node;
  return -1;
}

std::string memlock_limit_text() {
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return format_bytes(double(lim.rlim_cur));
}

}  // namespace

bool cuda_device_present() {
  static const bool present = probe_cuda().available;
  return present;
}

host_region host_region::map(const host_region_options& options) {
  if (options.bytes == 0) throw user_error("host memory: a region of 0 bytes was asked for");
  host_region r;
  r.cuda_device_ = options.cuda_device;

  // 1. Map at the exact size (rounded to the page), huge pages where asked.
  void* p = MAP_FAILED;
  if (options.pages == huge_pages::hugetlb) {
    r.size_ = round_up(options.bytes, huge_page);
    p = ::mmap(nullptr, r.size_, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p != MAP_FAILED) r.page_backing_ = "hugetlb";
    // MAP_HUGETLB fails when the reserved pool is empty: fall back below.
  }
  if (p == MAP_FAILED) {
    r.size_ = round_up(options.bytes, small_page);
    p = ::mmap(nullptr, r.size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      throw error(err, error_context{"mmap"}.range(0, r.size_).in_tier("host"));
    }
    if (options.pages != huge_pages::off) {
      // Advice only: a kernel without THP leaves 4 KiB pages, which still work.
      r.page_backing_ = ::madvise(p, r.size_, MADV_HUGEPAGE) == 0 ? "transparent" : "off";
    }
  }
  r.data_ = static_cast<std::byte*>(p);

  // 2. Bind to a NUMA node before the first touch, so the pages land there.
  int node = options.numa_node;
  if (node < 0 && cuda_device_present()) node = nearest_gpu_node(options.cuda_device);
  if (node >= 0 && numa_available() >= 0 && node <= numa_max_node()) {
    unsigned long mask[16] = {};
    mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
    if (::mbind(r.data_, r.size_, MPOL_BIND, mask, sizeof(mask) * 8, 0) == 0) r.numa_node_ = node;
  }

  // 3. Fault every page in, in parallel.
  const auto touch_start = std::chrono::steady_clock::now();
  if (options.pre_touch) pre_touch(r.data_, r.size_, options.touch_threads);
  r.touch_seconds_ = seconds_since(touch_start);

  // 4. Pin.
  const auto pin_start = std::chrono::steady_clock::now();
  bool pinned = false;
#if TIERFLOW_WITH_CUDA
  if (options.pin == pinning::cuda || (options.pin == pinning::automatic && cuda_device_present())) {
    cudaSetDevice(options.cuda_device);
    // cudaHostRegister page-locks the range and maps it for the device's DMA
    // engines: cudaMemcpyAsync from it is then truly asynchronous.
    const cudaError_t rc = cudaHostRegister(r.data_, r.size_, cudaHostRegisterDefault);
    if (rc == cudaSuccess) {
      r.pinned_by_ = "cuda_host_register";
      pinned = true;
    } else {
      (void)cudaGetLastError();
      if (options.pin == pinning::cuda) {
        const std::string why = cudaGetErrorString(rc);
        r.reset();
        throw error(std::make_error_code(std::errc::operation_not_permitted),
                    error_context{"cudaHostRegister (" + why + ")"}.range(0, options.bytes).in_tier("host"));
      }
      r.pin_note_ = std::string("cudaHostRegister failed: ") + cudaGetErrorString(rc);
    }
  }
#else
  if (options.pin == pinning::cuda) {
    r.reset();
    throw user_error("host memory: pinning with cudaHostRegister needs a CUDA build");
  }
#endif
  if (!pinned && (options.pin == pinning::mlock || options.pin == pinning::automatic ||
                  options.pin == pinning::cuda)) {
    if (::mlock(r.data_, r.size_) == 0) {
      r.pinned_by_ = "mlock";
      r.pin_note_.clear();
      pinned = true;
    } else {
      const int err = errno;
      const std::string note = "mlock of " + format_bytes(double(r.size_)) + " refused (" +
                               std::strerror(err) + "); RLIMIT_MEMLOCK is " +
                               memlock_limit_text() +
                               " — raise it (ulimit -l) or grant CAP_IPC_LOCK";
      if (options.pin == pinning::mlock) {
        r.reset();
        throw error(err, error_context{"mlock: " + note}.range(0, options.bytes).in_tier("host"));
      }
      r.pin_note_ = note;  // automatic: run unpinned, and say so in telemetry
    }
  }
  r.pin_seconds_ = seconds_since(pin_start);
  return r;
}

host_region::host_region(host_region&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      pinned_by_(std::exchange(other.pinned_by_, "none")),
      pin_note_(std::move(other.pin_note_)),
      page_backing_(std::move(other.page_backing_)),
      numa_node_(other.numa_node_),
      cuda_device_(other.cuda_device_),
      touch_seconds_(other.touch_seconds_),
      pin_seconds_(other.pin_seconds_) {}

host_region& host_region::operator=(host_region&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    pinned_by_ = std::exchange(other.pinned_by_, "none");
    pin_note_ = std::move(other.pin_note_);
    page_backing_ = std::move(other.page_backing_);
    numa_node_ = other.numa_node_;
    cuda_device_ = other.cuda_device_;
    touch_seconds_ = other.touch_seconds_;
    pin_seconds_ = other.pin_seconds_;
  }
  return *this;
}

host_region::~host_region() { reset(); }

void host_region::reset() noexcept {
  if (!data_) return;
#if TIERFLOW_WITH_CUDA
  if (pinned_by_ == "cuda_host_register") {
    cudaSetDevice(cuda_device_);
    if (cudaHostUnregister(data_) != cudaSuccess) {
      (void)cudaGetLastError();
      std::fprintf(stderr, "tierflow: warning: cudaHostUnregister failed\n");
    }
  }
#endif
  if (pinned_by_ == "mlock") ::munlock(data_, size_);
  if (::munmap(data_, size_) != 0)
    std::fprintf(stderr, "tierflow: warning: munmap of host memory failed: %s\n", std::strerror(errno));
  data_ = nullptr;
  size_ = 0;
  pinned_by_ = "none";
}

}  // namespace tierflow::tiers

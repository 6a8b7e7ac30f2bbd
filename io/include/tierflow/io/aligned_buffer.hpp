// Host memory aligned for O_DIRECT: an owned, zero-filled allocation.
#pragma once

#include <cstddef>
#include <span>

namespace tierflow::io {

class aligned_buffer {
 public:
  aligned_buffer() noexcept = default;
  // The transparent huge page size on x86-64 and arm64 with 4 KiB pages.
  static constexpr std::size_t huge_page_size = std::size_t{2} << 20;

  // Allocates `size` bytes aligned to `alignment` (a power of two, ≥ sizeof(void*)),
  // zero-filled. From `huge_page_size` up the buffer is aligned to it and asks
  // for transparent huge pages (MADV_HUGEPAGE), so that each block of it is
  // physically contiguous. Throws tierflow::error (ENOMEM).
  explicit aligned_buffer(std::size_t size, std::size_t alignment = 4096);
  aligned_buffer(aligned_buffer&& other) noexcept;
  aligned_buffer& operator=(aligned_buffer&& other) noexcept;
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  ~aligned_buffer();

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::span<std::byte> span() const noexcept { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace tierflow::io

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>

#include "detail/tier_impl.hpp"
#include "tierflow/core/units.hpp"

namespace tierflow::tiers {

namespace detail {

namespace {

io::file_space_options space_options(const nvme_tier_options& options) {
  if (options.directory.empty()) throw user_error("nvme tier: no directory given");
  if (options.budget == 0) throw user_error("nvme tier: the budget is zero");
  const std::uint64_t budget = aligned_size(options.budget);
  io::file_space_options s;
  s.directory = options.directory;
  // A block must fit in one file; files no larger than the budget needs.
  s.file_size = std::min(aligned_size(std::max<std::uint64_t>(options.file_size, block_alignment)), budget);
  // One spare file of slack: extents cannot span files, so the free space of
  // several files' tails may not hold one more block. The budget still caps
  // what is allocated.
  s.capacity = (budget + s.file_size - 1) / s.file_size * s.file_size + s.file_size;
  s.checksums = io::checksums::off;  // checksummed here, per block, also on the staged path
  s.direct = io::direct_io::prefer;
  s.keep = io::keep_files::no;
  return s;
}

}  // namespace

nvme_tier::nvme_tier(const nvme_tier_options& options)
    : budget_("nvme", aligned_size(options.budget)),
      checksums_(options.checksums),
      engine_(io::make_engine(options.io)),
      space_(std::make_unique<io::file_space>(space_options(options))) {}

nvme_tier::~nvme_tier() = default;

std::string nvme_tier::name() const { return "nvme (" + space_->directory() + ")"; }

tier_allocation nvme_tier::allocate(std::uint64_t bytes, std::string_view block) {
  budget_.charge(bytes, block);
  try {
    const io::extent e = space_->allocate(bytes);
    return tier_allocation{nullptr, e.offset, bytes, e.file_index};
  } catch (const tierflow::error& e) {
    budget_.discharge(bytes);
    error_context context = e.context();
    context.block = std::string(block);
    context.tier = "nvme";
    throw tierflow::error(e.code(), std::move(context));
  }
}

void nvme_tier::deallocate(const tier_allocation& a) noexcept {
  space_->release(io::extent{a.file, a.offset, a.size});
  {
    lock_guard lock(mutex_);
    sums_.erase(key(a));
  }
  budget_.discharge(a.size);
}

const io::file& nvme_tier::file_of(const tier_allocation& a) const {
  return space_->file_of(io::extent{a.file, a.offset, a.size});
}

void nvme_tier::record_checksum(const tier_allocation& a, std::uint64_t sum) {
  lock_guard lock(mutex_);
  sums_[key(a)] = sum;
}

void nvme_tier::verify_checksum(const tier_allocation& a, std::uint64_t sum,
                                std::string_view block) const {
  std::uint64_t expected = 0;
  {
    lock_guard lock(mutex_);
    const auto it = sums_.find(key(a));
    if (it == sums_.end()) return;  // never written through this tier: nothing to compare
    expected = it->second;
  }
  if (expected == sum) return;
  char text[80];
  std::snprintf(text, sizeof text, "checksum mismatch (expected %016" PRIx64 ", read %016" PRIx64 ")",
                expected, sum);
  throw tierflow::error(EBADMSG, error_context{std::string("read: ") + text}
                                     .at(file_of(a).path())
                                     .range(a.offset, a.size)
                                     .in_tier("nvme")
                                     .of_block(std::string(block)));
}

std::map<std::string, std::string> nvme_tier::details() const {
  const io::file_space_stats s = space_->stats();
  return {{"directory", space_->directory()},
          {"io_engine", engine_->describe()},
          {"files", std::to_string(s.files)},
          {"file_bytes", std::to_string(s.file_bytes)},
          {"checksums", checksums_ ? "xxh3" : "off"}};
}

}  // namespace detail

std::unique_ptr<tier> make_nvme_tier(const nvme_tier_options& options) {
  return std::make_unique<detail::nvme_tier>(options);
}

}  // namespace tierflow::tiers

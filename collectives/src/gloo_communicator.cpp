// The Gloo backend (gloo.hpp): one thread per communicator runs its
// collectives in issue order through Gloo's options-based algorithms.

#include "tierflow/collectives/gloo.hpp"

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <pthread.h>
#include <sys/stat.h>

#include <csignal>
#include <ctime>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tierflow/core/error.hpp"

namespace tierflow::collectives {

namespace {

// ---- element arithmetic ---------------------------------------------------------------------

float from_bf16(std::uint16_t bits) noexcept { return std::bit_cast<float>(std::uint32_t{bits} << 16); }

std::uint16_t to_bf16(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);  // a quiet NaN
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // to nearest, ties to even
}

float from_fp16(std::uint16_t bits) noexcept { return static_cast<float>(std::bit_cast<_Float16>(bits)); }

std::uint16_t to_fp16(float value) noexcept { return std::bit_cast<std::uint16_t>(static_cast<_Float16>(value)); }

float combine(reduce_op op, float a, float b) noexcept {
  if (op == reduce_op::sum) return a + b;
  if (a != a) return a;  // a NaN wins max and min, as in torch
  if (b != b) return b;
  return (op == reduce_op::max) == (a < b) ? b : a;
}

// Gloo's reduction callback for (dtype, op): out[i] = a[i] op b[i].
gloo::AllreduceOptions::Func reduction(dtype t, reduce_op op) {
  switch (t) {
    case dtype::fp32:
      return [op](void* out, const void* a, const void* b, std::size_t n) {
        auto* o = static_cast<float*>(out);
        const auto* x = static_cast<const float*>(a);
        const auto* y = static_cast<const float*>(b);
        for (std::size_t i = 0; i < n; ++i) o[i] = combine(op, x[i], y[i]);
      };
    case dtype::bf16:
    case dtype::fp16: {
      const bool bf16 = t == dtype::bf16;
      return [op, bf16](void* out, const void* a, const void* b, std::size_t n) {
        auto* o = static_cast<std::uint16_t*>(out);
        const auto* x = static_cast<const std::uint16_t*>(a);
        const auto* y = static_cast<const std::uint16_t*>(b);
        for (std::size_t i = 0; i < n; ++i) {
          const float v = bf16 ? combine(op, from_bf16(x[i]), from_bf16(y[i]))
                               : combine(op, from_fp16(x[i]), from_fp16(y[i]));
          o[i] = bf16 ? to_bf16(v) : to_fp16(v);
        }
      };
    }
  }
  throw user_error("gloo: an unknown dtype");
}

// A non-null address for a buffer of no bytes: Gloo's unbound buffers take
// a pointer, and an empty tensor's may be null.
std::byte empty_buffer[8];

template <typename P>
P* or_empty(P* p) {
  return p != nullptr ? p : reinterpret_cast<P*>(empty_buffer);
}

std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

// SIGPIPE blocked in this thread while it lives (and in the threads made
// meanwhile, which inherit the mask: Gloo's transport loop, the
// communicator's own): a write to a peer that died is then EPIPE, Gloo's
// error, instead of a signal that ends the process. Any SIGPIPE raised in
// this thread meanwhile is taken before the mask is put back.
class sigpipe_blocked {
 public:
  sigpipe_blocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~sigpipe_blocked() {
    const timespec now{};
    while (sigtimedwait(&pipe_, nullptr, &now) == SIGPIPE) {
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  sigpipe_blocked(const sigpipe_blocked&) = delete;
  sigpipe_blocked& operator=(const sigpipe_blocked&) = delete;

 private:
  sigset_t pipe_{}, old_{};
};

// Gloo's store interface over a rendezvous_store.
class store_adapter final : public gloo::rendezvous::Store {
 public:
  explicit store_adapter(rendezvous_store& store) : store_(store) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_.set(key, data); }
  std::vector<char> get(const std::string& key) override { return store_.get(key); }
  void wait(const std::vector<std::string>& keys) override {
    for (const auto& key : keys) store_.get(key);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override { wait(keys); }

 private:
  rendezvous_store& store_;
};

// ---- the communicator ---------------------------------------------------------------------------

class gloo_communicator final : public communicator {
 public:
  gloo_communicator(int rank, int size, const gloo_options& options) : rank_(rank), size_(size), options_(options) {
    const std::string place = options.store ? std::string("the given store") : options.store_dir;
    const std::string where = "gloo rendezvous of rank " + std::to_string(rank) + " of " + std::to_string(size) +
                              " in " + place + " (prefix '" + options.prefix + "')";
    const sigpipe_blocked quiet;  // (for the rendezvous, and inherited by the threads made here)
    try {
      gloo::transport::tcp::attr attr(options.hostname.c_str());
      auto device = gloo::transport::tcp::CreateDevice(attr);
      std::unique_ptr<gloo::rendezvous::Store> base;
      if (options.store) {
        base = std::make_unique<store_adapter>(*options.store);
      } else {
        base = std::make_unique<gloo::rendezvous::FileStore>(options.store_dir);
      }
      gloo::rendezvous::PrefixStore store(options.prefix, *base);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(options.timeout);
      context->connectFullMesh(store, device);
      context_ = std::move(context);
    } catch (const gloo::Exception& e) {
      throw error(ECONNABORTED, error_context{"gloo rendezvous"}.at(place), where + " failed: " + first_line(e.what()));
    } catch (const error&) {
      throw;  // (the store's own, naming what failed)
    } catch (const std::exception& e) {
      throw error(ECONNABORTED, error_context{"gloo rendezvous"}.at(place), where + " failed: " + first_line(e.what()));
    }
    thread_ = std::thread([this] { run(); });
  }

  ~gloo_communicator() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::string_view backend() const noexcept override { return "gloo"; }

  work_ptr all_gather(const void* in, void* out, std::span<const std::size_t> counts, dtype t) override {
    return submit("all_gather", gather(in, out, counts, t));
  }

  // Waits for `after` on this communicator's thread, in the queue's order.
  work_ptr all_gather_after(const work_ptr& after, const void* in, void* out, std::span<const std::size_t> counts,
                            dtype t) override {
    return submit("all_gather", gather(in, out, counts, t), after);
  }

  // Gloo has no all-gather into strided places: its allgatherv's ring, on
  // one unbound buffer over the pieces' span, each rank passing on to the
  // right the piece it got from the left the round before (its own first).
  work_ptr all_gather_strided(const work_ptr& after, const void* in, void* out, std::size_t count,
                              std::size_t stride, dtype t) override {
    check_stride(*this, count, stride);
    const std::size_t bytes = count * size_of(t), step = stride * size_of(t);
    return submit("all_gather", [=, this](std::uint32_t tag) {
      if (count == 0) return;
      auto* base = static_cast<std::byte*>(out);
      if (in != base + rank_ * step) std::memcpy(base + rank_ * step, in, bytes);
      if (size_ == 1) return;
      auto pieces = context_->createUnboundBuffer(base, (size_ - 1) * step + bytes);
      const auto slot = gloo::Slot::build(gloo::kAllgatherSlotPrefix, tag);
      const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
      const auto deadline = std::chrono::steady_clock::now() + options_.timeout;  // for the whole collective
      const auto remaining = [&] {  // (at least 1 ms: Gloo reads -1 ms as "its own default")
        return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                          deadline - std::chrono::steady_clock::now()));
      };
      const auto settle = [&] {
        if (!pieces->waitSend(remaining()) || !pieces->waitRecv(remaining())) throw std::runtime_error("aborted");
      };
      for (int round = 0; round < size_ - 1; ++round) {
        if (round > 0) settle();  // the piece to pass on has arrived, the last one has left
        const int sent = (rank_ - round + size_) % size_, received = (rank_ - round - 1 + size_) % size_;
        pieces->send(right, slot, sent * step, bytes);
        pieces->recv(left, slot, received * step, bytes);
      }
      settle();
    }, after);
  }

  work_ptr reduce_scatter(const void* in, void* out, std::span<const std::size_t> counts, dtype t,
                          reduce_op op) override {
    std::vector<std::size_t> elements = checked_counts(counts, "reduce_scatter");
    const std::size_t total = std::accumulate(elements.begin(), elements.end(), std::size_t{0});
    const std::size_t offset = std::accumulate(elements.begin(), elements.begin() + rank_, std::size_t{0});
    return submit("reduce_scatter", [=, this](std::uint32_t tag) {
      if (total == 0) return;
      std::vector<std::byte> whole(total * size_of(t));
      std::memcpy(whole.data(), in, whole.size());
      reduce(whole.data(), total, t, op, tag);
      if (elements[rank_] != 0)  // (an empty slice's buffer may be null)
        std::memcpy(out, whole.data() + offset * size_of(t), elements[rank_] * size_of(t));
    });
  }

  work_ptr all_reduce(void* inout, std::size_t count, dtype t, reduce_op op) override {
    return submit("all_reduce", [=, this](std::uint32_t tag) {
      if (count != 0) reduce(inout, count, t, op, tag);
    });
  }

  work_ptr broadcast(void* buffer, std::size_t count, dtype t, int root) override {
    if (root < 0 || root >= size_)
      throw user_error("broadcast: root " + std::to_string(root) + " is not a rank of " + std::to_string(size_));
    return submit("broadcast", [=, this](std::uint32_t tag) {
      if (count == 0) return;
      gloo::BroadcastOptions opts(context_);
      if (size_of(t) == 4) {
        opts.setOutput(static_cast<float*>(buffer), count);
      } else {
        opts.setOutput(static_cast<std::uint16_t*>(buffer), count);
      }
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::broadcast(opts);
    });
  }

 private:
  struct task {
    std::string what;
    std::function<void(std::uint32_t)> run;
    std::shared_ptr<signalled_work> done;
    work_ptr after;  // what must be done before it starts (null: nothing)
  };

  // The task of one all_gather (the counts checked now, in the caller's thread).
  std::function<void(std::uint32_t)> gather(const void* in, void* out, std::span<const std::size_t> counts, dtype t) {
    std::vector<std::size_t> elements = checked_counts(counts, "all_gather");
    const std::size_t total = std::accumulate(elements.begin(), elements.end(), std::size_t{0});
    const std::size_t offset = std::accumulate(elements.begin(), elements.begin() + rank_, std::size_t{0});
    return [=, this](std::uint32_t tag) {
      if (total == 0) return;  // (Gloo's allgatherv of nothing at all is not a no-op in Debian's snapshot)
      gloo::AllgathervOptions opts(context_);
      // In place (`in` is this rank's slot of `out`): Gloo takes no input and
      // reads the slot, instead of a memcpy of the slot onto itself.
      const bool in_place = in == static_cast<const std::byte*>(out) + offset * size_of(t);
      if (size_of(t) == 4) {
        if (!in_place) opts.setInput(or_empty(static_cast<float*>(const_cast<void*>(in))), elements[rank_]);
        opts.setOutput(or_empty(static_cast<float*>(out)), elements);
      } else {
        if (!in_place)
          opts.setInput(or_empty(static_cast<std::uint16_t*>(const_cast<void*>(in))), elements[rank_]);
        opts.setOutput(or_empty(static_cast<std::uint16_t*>(out)), elements);
      }
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::allgatherv(opts);
    };
  }

  static std::string first_line(std::string_view text) {
    const auto end = text.find('\n');
    return std::string(text.substr(0, end));
  }

  std::vector<std::size_t> checked_counts(std::span<const std::size_t> counts, std::string_view what) const {
    if (counts.size() != static_cast<std::size_t>(size_))
      throw user_error(std::string(what) + ": " + std::to_string(counts.size()) + " counts for " +
                       std::to_string(size_) + " ranks");
    return {counts.begin(), counts.end()};
  }

  void reduce(void* data, std::size_t count, dtype t, reduce_op op, std::uint32_t tag) {
    gloo::AllreduceOptions opts(context_);
    if (size_of(t) == 4) {
      opts.setOutput(static_cast<float*>(data), count);
    } else {
      opts.setOutput(static_cast<std::uint16_t*>(data), count);
    }
    opts.setReduceFunction(reduction(t, op));
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    gloo::allreduce(opts);
  }

  work_ptr submit(std::string what, std::function<void(std::uint32_t)> run, work_ptr after = nullptr) {
    auto done = std::make_shared<signalled_work>();
    {
      std::lock_guard lock(mutex_);
      if (broken_) {
        done->finish(broken_);
        return done;
      }
      queue_.push_back(task{std::move(what), std::move(run), done, std::move(after)});
    }
    cv_.notify_all();
    return done;
  }

  void run() {
    for (std::uint32_t tag = 0;; ++tag) {
      task next;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        next = std::move(queue_.front());
        queue_.pop_front();
        if (broken_) {
          next.done->finish(broken_);
          continue;
        }
      }
      std::exception_ptr failure;
      try {
        if (next.after) next.after->wait();
        next.run(tag);
      } catch (const gloo::Exception& e) {
        failure = broken(next.what, first_line(e.what()));
      } catch (const std::exception& e) {
        failure = broken(next.what, e.what());
      }
      next.done->finish(failure);
    }
  }

  // Marks the communicator broken by `what`'s failure and fails what waits.
  std::exception_ptr broken(const std::string& what, const std::string& cause) {
    const std::string message = "gloo communicator (rank " + std::to_string(rank_) + " of " +
                                std::to_string(size_) + "): " + what + " failed: " + cause +
                                "; the communicator is broken, every later collective fails";
    auto failure = std::make_exception_ptr(error(ECONNABORTED, error_context{what}, message));
    std::deque<task> pending;
    {
      std::lock_guard lock(mutex_);
      broken_ = failure;
      pending.swap(queue_);
    }
    for (auto& t : pending) t.done->finish(failure);
    return failure;
  }

  const int rank_, size_;
  const gloo_options options_;
  std::shared_ptr<gloo::Context> context_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<task> queue_;
  std::exception_ptr broken_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<communicator> make_gloo_communicator(int rank, int size, const gloo_options& options) {
  if (size < 1) throw user_error("gloo: size " + std::to_string(size) + " is not a number of ranks");
  if (rank < 0 || rank >= size)
    throw user_error("gloo: rank " + std::to_string(rank) + " is not a rank of " + std::to_string(size));
  if (options.timeout <= std::chrono::milliseconds::zero())
    throw user_error("gloo: timeout " + std::to_string(options.timeout.count()) + " ms is not positive");
  if (options.prefix.empty()) throw user_error("gloo: prefix is empty");
  if (options.store) return std::make_unique<gloo_communicator>(rank, size, options);
  struct stat st {};
  if (options.store_dir.empty()) throw user_error("gloo: neither a store nor store_dir (the rendezvous directory)");
  if (::stat(options.store_dir.c_str(), &st) != 0)
    throw user_error("gloo: store_dir '" + options.store_dir + "': " + errno_text(errno));
  if (!S_ISDIR(st.st_mode)) throw user_error("gloo: store_dir '" + options.store_dir + "' is not a directory");
  return std::make_unique<gloo_communicator>(rank, size, options);
}

}  // namespace tierflow::collectives

#pragma once
// Device policies and owning buffers.
//
//   Buffer<float, Host>   host memory (this header)
//   Buffer<bf16, Cuda>    device memory (device/cuda.hpp, needs CUDA)
//
// A buffer owns its memory (RAII, move-only) and knows its size in elements;
// shapes live with the code that uses it (layouts are compile-time there).
// No managed memory: host and device buffers are distinct types, so a host
// pointer cannot reach a CUDA kernel by accident.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <utility>

namespace fived {

struct Host {};
struct Cuda {};

// Buffers of a device allocated so far by this process (all threads). A steady-state
// training step allocates none: its workspaces are sized once from the static layouts, and
// the tests count these over steps 2-5.
template <class Device>
std::atomic<std::size_t>& buffer_allocations() {
  static std::atomic<std::size_t> count{0};
  return count;
}

// Bytes held by the live buffers of a device in this process (all threads): what the
// library's own buffers occupy right now. Progress lines report it as memory in use on the
// host; tests measure a step's activations with it against the planner's figure.
template <class Device>
std::atomic<std::size_t>& buffer_bytes_held() {
  static std::atomic<std::size_t> bytes{0};
  return bytes;
}

// How many ranks share this process's count of host bytes: host::run sets it to its
// number of threads while they run; a rank that is a process of its own is alone (1).
inline std::atomic<int>& host_ranks_in_process() {
  static std::atomic<int> ranks{1};
  return ranks;
}

// Tag for a buffer whose memory a range at a time is given back and taken again while the
// buffer keeps its addresses (a model's flat parameters and gradients, which ZeRO-2/3 hold a
// unit at a time): any host memory can (device/host_pages.hpp); on CUDA such a buffer is a
// reserved address range with chunks mapped on demand (device/cuda_pages.hpp).
struct ReleasablePages {};
inline constexpr ReleasablePages releasable_pages{};

template <class T, class Device = Host>
class Buffer;

template <class T>
class Buffer<T, Host> {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t n) : data_(std::make_unique<T[]>(n)), size_(n) {  // value-initialised (zeros)
    if (n != 0) ++buffer_allocations<Host>();
    buffer_bytes_held<Host>() += n * sizeof(T);
  }
  Buffer(std::size_t n, ReleasablePages) : Buffer(n) {}
  Buffer(Buffer&& o) noexcept : data_(std::move(o.data_)), size_(std::exchange(o.size_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      buffer_bytes_held<Host>() -= size_ * sizeof(T);
      data_ = std::move(o.data_);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { buffer_bytes_held<Host>() -= size_ * sizeof(T); }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  std::span<T> span() { return {data_.get(), size_}; }
  std::span<const T> span() const { return {data_.get(), size_}; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }
  void zero() { std::fill_n(data_.get(), size_, T{}); }

 private:
  std::unique_ptr<T[]> data_;
  std::size_t size_ = 0;
};

}  // namespace fived

#pragma once
// CUDA device policy: streams, events and Buffer<T, Cuda> (errors: device/cuda_error.hpp).
//
//   fived::cuda::Stream s;                             // non-blocking stream, RAII
//   fived::Buffer<float, fived::Cuda> x(n);            // cudaMalloc'd, zeroed, move-only
//   fived::Buffer<float, fived::Cuda> g(n, fived::releasable_pages);  // pages given back a range
//                                                      // at a time (device/cuda_pages.hpp)
//   x.upload(host_span, s);  x.download(host_span, s); auto h = x.to_host(s);
//
// Host code only (no kernels): this header compiles with the host compiler and
// with nvcc. Device memory and host memory are distinct types; there is no
// managed memory.

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include <fived/device/buffer.hpp>
#include <fived/device/cuda_error.hpp>
#include <fived/device/cuda_pages.hpp>

namespace fived::cuda {

// Number of CUDA devices; 0 when there is none or no usable driver (the
// runtime then returns an error and leaves the count untouched).
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// A move-only owner of a CUDA handle (a stream, an event, pinned host memory), given back
// once, by `Destroy`, when its owner goes: what Stream, Event and the pinned staging of
// nn/cuda/ops.hpp hold, so each of them moves by default.
template <class H, auto Destroy>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(H h) noexcept : h_(h) {}
  UniqueHandle(UniqueHandle&& o) noexcept : h_(std::exchange(o.h_, H{})) {}
  UniqueHandle& operator=(UniqueHandle&& o) noexcept {
    if (this != &o) reset(std::exchange(o.h_, H{}));
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() { reset(); }

  H get() const noexcept { return h_; }
  // Gives the handle held back (errors ignored: nothing to do about them here) and takes h.
  void reset(H h = H{}) noexcept {
    if (h_ != H{}) (void)Destroy(h_);
    h_ = h;
  }

 private:
  H h_{};
};

// Owning, move-only cudaStream_t (created non-blocking: no implicit
// synchronisation with the legacy default stream).
class Stream {
 public:
  Stream() : Stream(cudaStreamNonBlocking) {}
  explicit Stream(unsigned flags, int priority = 0) {
    cudaStream_t s = nullptr;
    FIVED_CUDA_CHECK(cudaStreamCreateWithPriority(&s, flags, priority));
    s_.reset(s);
  }

  cudaStream_t get() const noexcept { return s_.get(); }
  operator cudaStream_t() const noexcept { return s_.get(); }  // NOLINT(google-explicit-constructor)
  void synchronize() const { FIVED_CUDA_CHECK(cudaStreamSynchronize(s_.get())); }

 private:
  UniqueHandle<cudaStream_t, cudaStreamDestroy> s_;
};

// Owning, move-only cudaEvent_t. Timing is on by default (for benchmarks);
// pass cudaEventDisableTiming for pure ordering events.
class Event {
 public:
  explicit Event(unsigned flags = cudaEventDefault) {
    cudaEvent_t e = nullptr;
    FIVED_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    e_.reset(e);
  }

  cudaEvent_t get() const noexcept { return e_.get(); }
  operator cudaEvent_t() const noexcept { return e_.get(); }  // NOLINT(google-explicit-constructor)
  void record(cudaStream_t stream) { FIVED_CUDA_CHECK(cudaEventRecord(e_.get(), stream)); }
  void synchronize() const { FIVED_CUDA_CHECK(cudaEventSynchronize(e_.get())); }
  // Makes `stream` wait for the work recorded in this event.
  void wait_on(cudaStream_t stream) const { FIVED_CUDA_CHECK(cudaStreamWaitEvent(stream, e_.get(), 0)); }
  // Milliseconds between two recorded (timing) events; waits for `end`.
  static float elapsed_ms(const Event& start, const Event& end) {
    end.synchronize();
    float ms = 0;
    FIVED_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), end.get()));
    return ms;
  }

 private:
  UniqueHandle<cudaEvent_t, cudaEventDestroy> e_;
};

}  // namespace fived::cuda

namespace fived {

// Device memory of n elements of T, from cudaMalloc on the current device,
// zero-filled on construction (as Buffer<T, Host> is value-initialised).
// Move-only; freed with cudaFree. Transfers to and from the host are ordered
// on the given stream and return when the copy is complete (host memory may
// be pageable), so the host span can be reused or read right after.
template <class T>
class Buffer<T, Cuda> {
  static_assert(std::is_trivially_copyable_v<T>, "Buffer<T, Cuda> holds trivially copyable element types only");

 public:
  Buffer() = default;
  explicit Buffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    FIVED_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), n * sizeof(T)));
    ++buffer_allocations<Cuda>();
    // The fill runs on the legacy default stream, which non-blocking streams do
    // not wait for: finish it here, so the buffer is zero for every stream.
    cudaError_t e = cudaMemset(data_, 0, n * sizeof(T));
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
    if (e != cudaSuccess) {
      (void)cudaFree(data_);
      data_ = nullptr;
      ::fived::cuda::check(e, "cudaMemset(data_, 0, n * sizeof(T))", __FILE__, __LINE__);
    }
    buffer_bytes_held<Cuda>() += n * sizeof(T);
  }
  // Releasable (device/cuda_pages.hpp): a reserved address range whose pages
  // cuda::release_pages gives back and cuda::commit_pages maps again; zeroed, like the other.
  Buffer(std::size_t n, ReleasablePages) : size_(n) {
    if (n == 0) return;
    pages_ = std::make_unique<cuda::PagedMemory>(n * sizeof(T));
    data_ = static_cast<T*>(pages_->data());
    ++buffer_allocations<Cuda>();
    buffer_bytes_held<Cuda>() += n * sizeof(T);
  }
  // Allocates and copies `host` (ordered on `stream`, complete on return).
  Buffer(std::span<const T> host, cudaStream_t stream) : Buffer(host.size()) { upload(host, stream); }
  explicit Buffer(const Buffer<T, Host>& host, cudaStream_t stream = nullptr) : Buffer(host.span(), stream) {}

  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), pages_(std::move(o.pages_)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      pages_ = std::move(o.pages_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  // A span over device memory: for passing pointer + size, never for dereferencing on the host.
  std::span<T> span() noexcept { return {data_, size_}; }
  std::span<const T> span() const noexcept { return {data_, size_}; }

  // Zero-fills asynchronously on `stream`.
  void zero(cudaStream_t stream = nullptr) {
    if (size_ != 0) FIVED_CUDA_CHECK(cudaMemsetAsync(data_, 0, bytes(), stream));
  }

  void upload(std::span<const T> host, cudaStream_t stream = nullptr) {
    check_size(host.size(), "upload");
    if (size_ == 0) return;
    FIVED_CUDA_CHECK(cudaMemcpyAsync(data_, host.data(), bytes(), cudaMemcpyHostToDevice, stream));
    FIVED_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void upload(const Buffer<T, Host>& host, cudaStream_t stream = nullptr) { upload(host.span(), stream); }

  void download(std::span<T> host, cudaStream_t stream = nullptr) const {
    check_size(host.size(), "download");
    if (size_ == 0) return;
    FIVED_CUDA_CHECK(cudaMemcpyAsync(host.data(), data_, bytes(), cudaMemcpyDeviceToHost, stream));
    FIVED_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void download(Buffer<T, Host>& host, cudaStream_t stream = nullptr) const { download(host.span(), stream); }

  Buffer<T, Host> to_host(cudaStream_t stream = nullptr) const {
    Buffer<T, Host> h(size_);
    download(h.span(), stream);
    return h;
  }

 private:
  void check_size(std::size_t n, const char* what) const {
    if (n != size_)
      throw std::invalid_argument(std::string("Buffer<T, Cuda>::") + what + ": the host span has " + std::to_string(n) +
                                  " elements, the device buffer " + std::to_string(size_));
  }
  void release() noexcept {
    if (data_ != nullptr) {
      if (pages_ == nullptr) (void)cudaFree(data_);
      buffer_bytes_held<Cuda>() -= size_ * sizeof(T);
    }
    pages_.reset();
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  std::unique_ptr<cuda::PagedMemory> pages_;  // a releasable buffer's reservation
};

}  // namespace fived

#pragma once
// Helpers shared by the CUDA tests: GPU detection for skipping, and device
// buffers filled from and read back to host vectors.

#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fived::test {

// Exit code CTest reads as "skipped" (SKIP_RETURN_CODE 77).
inline constexpr int skip_code = 77;

// Without a GPU, cudaGetDeviceCount fails (e.g. insufficient driver) and
// leaves the count untouched: start at 0 and treat any error as no GPU.
inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory with host-side fill and read-back, ordered on `stream`.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer(const std::vector<T>& host, cudaStream_t stream) : n_(host.size()) {
    if (n_ != 0) cuda_check(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), "cudaMalloc");
    upload(host, stream);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }

  void upload(const std::vector<T>& host, cudaStream_t stream) {
    if (host.size() != n_) throw std::runtime_error("DeviceBuffer::upload: size mismatch");
    if (n_ == 0) return;
    cuda_check(cudaMemcpyAsync(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  std::vector<T> download(cudaStream_t stream) const {
    std::vector<T> host(n_);
    if (n_ == 0) return host;
    cuda_check(cudaMemcpyAsync(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return host;
  }
  std::span<T> span() { return {p_, n_}; }
  std::span<const T> cspan() const { return {p_, n_}; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace fived::test

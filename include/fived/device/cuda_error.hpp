#pragma once
// CUDA errors as exceptions: a failed runtime call or kernel launch throws fived::cuda::Error
// with the call, the file and line, and CUDA's name and description (driver calls:
// device/cuda_driver.hpp).
//
//   FIVED_CUDA_CHECK(cudaMemsetAsync(p, 0, n, s));   // a runtime call
//   kernel<<<grid, block, 0, s>>>(...);
//   FIVED_CUDA_CHECK_LAUNCH("kernel");                 // cudaGetLastError after a launch

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace fived::cuda {

// A failed CUDA runtime call or kernel launch: "file:line: call failed: name: description".
class Error : public std::runtime_error {
 public:
  Error(cudaError_t code, const std::string& what) : std::runtime_error(what), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

inline void check(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  throw Error(e, std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " + cudaGetErrorName(e) +
                     ": " + cudaGetErrorString(e));
}

// After a kernel launch: launch-configuration errors (and sticky errors from
// earlier asynchronous work) surface here, named after the kernel.
inline void check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return;
  throw Error(e, std::string(file) + ":" + std::to_string(line) + ": launch of " + kernel + " failed: " +
                     cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace fived::cuda

#define FIVED_CUDA_CHECK(call) ::fived::cuda::check((call), #call, __FILE__, __LINE__)
#define FIVED_CUDA_CHECK_LAUNCH(kernel_name) ::fived::cuda::check_launch((kernel_name), __FILE__, __LINE__)

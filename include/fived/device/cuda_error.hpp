#pragma once
// CUDA errors as exceptions: a failed runtime call, driver call or kernel launch throws
// fived::cuda::Error with the call, the file and line, and CUDA's name and description.
//
//   FIVED_CUDA_CHECK(cudaMemsetAsync(p, 0, n, s));   // a runtime call
//   FIVED_CU_CHECK(cuMemMap(at, size, 0, handle, 0)); // a driver call
//   kernel<<<grid, block, 0, s>>>(...);
//   FIVED_CUDA_CHECK_LAUNCH("kernel");                 // cudaGetLastError after a launch

#include <cuda.h>
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

inline void check_driver(CUresult r, const char* call, const char* file, int line) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  (void)cuGetErrorName(r, &name);
  (void)cuGetErrorString(r, &text);
  throw Error(cudaErrorUnknown, std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " +
                                    (name ? name : "?") + ": " + (text ? text : "?"));
}

}  // namespace fived::cuda

#define FIVED_CU_CHECK(call) ::fived::cuda::check_driver((call), #call, __FILE__, __LINE__)
#define FIVED_CUDA_CHECK(call) ::fived::cuda::check((call), #call, __FILE__, __LINE__)
#define FIVED_CUDA_CHECK_LAUNCH(kernel_name) ::fived::cuda::check_launch((kernel_name), __FILE__, __LINE__)

#pragma once
// The CUDA driver API calls fived makes (the virtual memory of device/cuda_pages.hpp), found
// at run time through the runtime (cudaGetDriverEntryPointByVersion) instead of linked: a
// program that links libcuda does not even start where no driver is installed, and fived's
// CUDA programs must start there to say "no CUDA device" (and its tests to skip).
//
//   FIVED_CU_CHECK(cuda::driver().mem_map(at, size, 0, handle, 0));  // throws fived::cuda::Error

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "fived/device/cuda_error.hpp"

namespace fived::cuda {

struct DriverApi {
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuMemGetAllocationGranularity) mem_get_allocation_granularity = nullptr;
  decltype(&::cuMemAddressReserve) mem_address_reserve = nullptr;
  decltype(&::cuMemAddressFree) mem_address_free = nullptr;
  decltype(&::cuMemCreate) mem_create = nullptr;
  decltype(&::cuMemRelease) mem_release = nullptr;
  decltype(&::cuMemMap) mem_map = nullptr;
  decltype(&::cuMemUnmap) mem_unmap = nullptr;
  decltype(&::cuMemSetAccess) mem_set_access = nullptr;
};

namespace driver_detail {

template <class F>
void find(F& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t e = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &found);
#endif
  check(e, "cudaGetDriverEntryPoint", __FILE__, __LINE__);
  if (found != cudaDriverEntryPointSuccess || p == nullptr)
    throw Error(cudaErrorSymbolNotFound, std::string("fived: the CUDA driver has no ") + symbol +
                                             " (device/cuda_pages.hpp needs CUDA 12 or later)");
  fn = reinterpret_cast<F>(p);
}

}  // namespace driver_detail

// The calls, looked up once (the first call needs a working runtime).
inline const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi a;
    driver_detail::find(a.get_error_name, "cuGetErrorName");
    driver_detail::find(a.get_error_string, "cuGetErrorString");
    driver_detail::find(a.mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
    driver_detail::find(a.mem_address_reserve, "cuMemAddressReserve");
    driver_detail::find(a.mem_address_free, "cuMemAddressFree");
    driver_detail::find(a.mem_create, "cuMemCreate");
    driver_detail::find(a.mem_release, "cuMemRelease");
    driver_detail::find(a.mem_map, "cuMemMap");
    driver_detail::find(a.mem_unmap, "cuMemUnmap");
    driver_detail::find(a.mem_set_access, "cuMemSetAccess");
    return a;
  }();
  return api;
}

inline void check_driver(CUresult r, const char* call, const char* file, int line) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  (void)driver().get_error_name(r, &name);
  (void)driver().get_error_string(r, &text);
  throw Error(cudaErrorUnknown, std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " +
                                    (name ? name : "?") + ": " + (text ? text : "?"));
}

}  // namespace fived::cuda

#define FIVED_CU_CHECK(call) ::fived::cuda::check_driver((call), #call, __FILE__, __LINE__)

#pragma once
// A CUDA device's peak dense bf16 tensor-core FLOP/s, read from the device: SMs x clock x
// FLOPs per SM per clock of its architecture. The MFU denominator of progress lines, so a run
// on an H100, an A100 or a B200 is measured against its own ceiling, not a constant.
//
//   double peak = fived::cuda::peak_bf16_flops(0);   // H100 SXM: 132 SMs x 1.98 GHz x 4096
//
// The clock is the device's maximum (boost); sustained clocks under load are lower, so the
// figure is an upper bound (NVIDIA's 989 TFLOP/s for the H100 SXM uses 1.83 GHz). 0 for an
// architecture this table does not know: no MFU rather than a wrong one. Needs CUDA.

#include <cuda_runtime.h>

#include "fived/device/cuda.hpp"

namespace fived::cuda {

// Dense bf16 FLOPs per SM per clock (2 x the tensor cores' FMAs), by compute capability.
constexpr double bf16_flops_per_sm_clock(int major, int minor) {
  if (major == 8 && minor == 0) return 2048;   // A100
  if (major == 8) return 1024;                 // 8.6 / 8.7 / 8.9: A10, Orin, L40S (fp32 accumulate)
  if (major == 9) return 4096;                 // H100, H200
  if (major == 10) return 8192;                // B200
  return 0;
}

inline double peak_bf16_flops(int device) {
  int sms = 0, khz = 0, major = 0, minor = 0;
  FIVED_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  FIVED_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
  FIVED_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FIVED_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return static_cast<double>(sms) * khz * 1e3 * bf16_flops_per_sm_clock(major, minor);
}

}  // namespace fived::cuda

#pragma once
// All CUDA kernels (namespace fived::kernels::cuda), the counterparts of the
// host reference kernels in fived/kernels/host.hpp: same arguments with a
// leading cudaStream_t (GEMM: a leading CublasLt&). See each header's comment.
//
// The kernels are device code: they are declared only when compiling with nvcc
// (a .cu file). From host-compiled C++ this header gives the device layer alone
// (fived/device/cuda.hpp: Buffer<T, Cuda>, Stream, Event, FIVED_CUDA_CHECK).

#include <fived/device/cuda.hpp>

#if defined(__CUDACC__)
#include <fived/kernels/cuda/adamw.hpp>
#include <fived/kernels/cuda/attention.hpp>
#include <fived/kernels/cuda/attention_blocks.hpp>
#include <fived/kernels/cuda/common.hpp>
#include <fived/kernels/cuda/convert.hpp>
#include <fived/kernels/cuda/crossentropy.hpp>
#include <fived/kernels/cuda/cudnn_attention.hpp>
#include <fived/kernels/cuda/embedding.hpp>
#include <fived/kernels/cuda/gelu.hpp>
#include <fived/kernels/cuda/gemm.hpp>
#include <fived/kernels/cuda/layernorm.hpp>
#include <fived/kernels/cuda/moe.hpp>
#include <fived/kernels/cuda/norm.hpp>
#include <fived/kernels/cuda/regroup.hpp>
#include <fived/kernels/cuda/residual.hpp>
#include <fived/kernels/cuda/router.hpp>
#include <fived/kernels/cuda/rotary.hpp>
#include <fived/kernels/cuda/swiglu.hpp>
#endif

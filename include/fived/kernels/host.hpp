#pragma once
// All host reference kernels (namespace fived::kernels::host); the interface is
// shared with the CUDA versions in kernels/cuda/ (see each header's comment).

#include "fived/kernels/host/adamw.hpp"
#include "fived/kernels/host/attention.hpp"
#include "fived/kernels/host/convert.hpp"
#include "fived/kernels/host/crossentropy.hpp"
#include "fived/kernels/host/embedding.hpp"
#include "fived/kernels/host/gelu.hpp"
#include "fived/kernels/host/gemm.hpp"
#include "fived/kernels/host/layernorm.hpp"
#include "fived/kernels/host/moe.hpp"
#include "fived/kernels/host/norm.hpp"
#include "fived/kernels/host/regroup.hpp"
#include "fived/kernels/host/residual.hpp"
#include "fived/kernels/host/rotary.hpp"
#include "fived/kernels/host/swiglu.hpp"

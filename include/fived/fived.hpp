#pragma once
// Everything fived offers, in one include. The CUDA parts (NCCL communicator
// and bootstrap) come in when FIVED_WITH_CUDA is defined, which linking
// fived::cuda does.

#include "fived/comm/bootstrap.hpp"
#include "fived/comm/communicator.hpp"
#include "fived/comm/counting.hpp"
#include "fived/comm/host.hpp"
#include "fived/comm/types.hpp"
#include "fived/context/zigzag.hpp"
#include "fived/io/safetensors.hpp"
#include "fived/mesh/axis.hpp"
#include "fived/mesh/context.hpp"
#include "fived/mesh/mesh.hpp"
#include "fived/model/contract.hpp"
#include "fived/nn/gpt.hpp"
#include "fived/optim/adamw.hpp"
#include "fived/pipeline/executor.hpp"
#include "fived/pipeline/schedule.hpp"
#include "fived/pipeline/stage_layers.hpp"
#include "fived/place/layout.hpp"
#include "fived/place/placement.hpp"
#include "fived/place/redistribute.hpp"
#include "fived/place/sharded.hpp"
#include "fived/train/data_parallel.hpp"
#include "fived/train/stop_signal.hpp"
#include "fived/train/trainer.hpp"

#if defined(FIVED_WITH_CUDA)
#include "fived/comm/nccl.hpp"
#include "fived/comm/nccl_bootstrap.hpp"
#endif

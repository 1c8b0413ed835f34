// train_moe built by nvcc with fived::cuda (FIVED_WITH_CUDA): the same program on the
// GPU only (without one it names train_moe, the host build), as 4 processes (see train_moe.cpp).
#include "train_moe.cpp"

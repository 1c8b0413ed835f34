// train_moe built by nvcc with fived::cuda (FIVED_WITH_CUDA): the same program, which
// trains on the GPU when there is one, as 4 processes (see train_moe.cpp).
#include "train_moe.cpp"

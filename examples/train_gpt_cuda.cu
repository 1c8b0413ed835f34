// train_gpt built by nvcc with fived::cuda (FIVED_WITH_CUDA): the same program, which
// trains on the GPU when there is one (see train_gpt.cpp).
#include "train_gpt.cpp"

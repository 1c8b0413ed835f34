// train_gpt built by nvcc with fived::cuda (FIVED_WITH_CUDA): the same program on the
// GPU only (without one it names train_gpt, the host build); see train_gpt.cpp.
#include "train_gpt.cpp"

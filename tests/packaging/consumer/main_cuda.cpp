// Built when fived::cuda exists: its include paths and libraries must work from
// host C++. ncclGetVersion needs no GPU.
#include <cstdio>

#include <cuda_runtime.h>
#include <nccl.h>

#include <fived/fived.hpp>

int main() {
  static_assert(fived::Mesh<fived::TP<2>>::size == 2);
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return 1;
  std::printf("NCCL %d, CUDA runtime headers %d\n", version, CUDART_VERSION);
  return 0;
}

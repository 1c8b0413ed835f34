#pragma once
// The error of fived's files: safetensors files (io/safetensors.hpp), their atomic
// writes (io/atomic_file.hpp) and checkpoint manifests (train/checkpoint.hpp). The
// message names the file, where in it, and what is wrong.

#include <stdexcept>

namespace fived::io {

class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};


}  // namespace fived::io

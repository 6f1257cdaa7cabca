// Error reporting shared by the .cu files (internal to kernels/cuda).
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace anchor::kernels::cuda::detail {

// Records `what` as the last error (thread-local) and returns a nonzero status.
int set_error(const std::string& what);
// Checks a CUDA runtime status; on failure records "<call>: <cuda error name> (<message>)".
int check_cuda(cudaError_t e, const char* call);

} // namespace anchor::kernels::cuda::detail

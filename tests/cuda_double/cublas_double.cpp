// The four cuBLAS calls hostopt-gpu-bench makes, on the CUDA double: a handle that holds a
// stream, and an SGEMM that is device work of 2mnk modelled flops reading A and B and writing
// C (checked by the race detector) and computing nothing: the bench only times it. Without a
// modelled device rate (HOSTOPT_CUDA_DOUBLE_MODEL=device_tflops=X) a GEMM would take no time
// and the bench could not size its work, so the handle is refused.
#include <cstdio>

#include <cublas_v2.h>

#include "cuda_double.hpp"
#include "double_internal.hpp"

struct cublasContext {
  cudaStream_t stream = nullptr; // the legacy default stream, as cuBLAS starts
};

namespace {

// Bytes a column-major rows x cols operand with leading dimension ld spans.
std::size_t span_bytes(int rows, int cols, int ld) {
  return cols == 0 ? 0 : (std::size_t(cols - 1) * std::size_t(ld) + std::size_t(rows)) * sizeof(float);
}

} // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  if (cuda_double::detail::config().device_flops_per_ns <= 0) {
    std::fprintf(stderr,
                 "cuda double: cuBLAS needs a modelled device: HOSTOPT_CUDA_DOUBLE_MODEL=device_tflops=X\n");
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *handle = new cublasContext{};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                              int m, int n, int k, const float* alpha, const float* A, int lda,
                              const float* B, int ldb, const float* beta, float* C, int ldc) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  const int a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const cudaError_t rc = cuda_double::launch(handle->stream, "cublasSgemm",
                                             {{A, span_bytes(a_rows, a_cols, lda), false},
                                              {B, span_bytes(b_rows, b_cols, ldb), false},
                                              {C, span_bytes(m, n, ldc), true}},
                                             nullptr, 0, 2.0 * double(m) * double(n) * double(k));
  return rc == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

} // extern "C"

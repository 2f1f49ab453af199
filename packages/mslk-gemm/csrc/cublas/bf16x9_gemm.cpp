// bf16x9_gemm: out [m, n] fp32 = a [m, k] · b [n, k]ᵀ with cuBLAS's FP32 emulation by nine BF16 products
// (CUBLAS_COMPUTE_32F_EMULATED_16BFX9). cuBLAS 13.0 sets the emulation strategy on a cuBLAS handle only (cuBLASLt
// gains an emulation descriptor in 13.1), so this GEMM uses the cuBLAS API: the library builds against 13.0.
#include <cublas_v2.h>

#include <mutex>

#include "common.h"

// A cuBLAS handle that emulates whenever it can (the strategy by default emulates only where cuBLAS finds it
// faster; the op promises the BF16x9 algorithm).
MSLK_API int mslk_cublas_create(void** handle) {
  cublasHandle_t created = nullptr;
  MSLK_RETURN_IF_ERROR(cublasCreate(&created));
  const cublasStatus_t status = cublasSetEmulationStrategy(created, CUBLAS_EMULATION_STRATEGY_EAGER);
  if (status != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(created);
    return status;
  }
  *handle = created;
  return CUBLAS_STATUS_SUCCESS;
}

// a and b are row-major (element (i, j) at i · ld + j) or, when a_column_major / b_column_major, column-major
// (at i + j · ld); out is row-major with leading dimension ldc.
MSLK_API int mslk_bf16x9_gemm_cublas(
    void* handle,
    const float* a,
    int64_t lda,
    int a_column_major,
    const float* b,
    int64_t ldb,
    int b_column_major,
    float* out,
    int64_t ldc,
    int64_t m,
    int64_t n,
    int64_t k,
    void* workspace,
    size_t workspace_bytes,
    cudaStream_t stream) {
  // A cuBLAS handle keeps its stream and workspace: one call at a time sets them and launches.
  static std::mutex launching;
  const std::lock_guard<std::mutex> lock(launching);
  const auto cublas = static_cast<cublasHandle_t>(handle);
  MSLK_RETURN_IF_ERROR(cublasSetStream(cublas, stream));
  MSLK_RETURN_IF_ERROR(cublasSetWorkspace(cublas, workspace, workspace_bytes));
  const float alpha = 1.0f;
  const float beta = 0.0f;
  // Column-major: outᵀ [n, m] = b [n, k] · aᵀ [k, m]. A row-major b is a column-major k x n matrix (transpose
  // it), a column-major one already n x k; a row-major a is a column-major k x m matrix, a column-major one m x k.
  return cublasGemmEx_64(
      cublas,
      b_column_major ? CUBLAS_OP_N : CUBLAS_OP_T,
      a_column_major ? CUBLAS_OP_T : CUBLAS_OP_N,
      n,
      m,
      k,
      &alpha,
      b,
      CUDA_R_32F,
      ldb,
      a,
      CUDA_R_32F,
      lda,
      &beta,
      out,
      CUDA_R_32F,
      ldc,
      CUBLAS_COMPUTE_32F_EMULATED_16BFX9,
      CUBLAS_GEMM_DEFAULT);
}

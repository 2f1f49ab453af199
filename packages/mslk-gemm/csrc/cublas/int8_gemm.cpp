// The exact int32 product of int8 GEMMs: out [m, n] int32 = xq [m, k] · wq [n, k]ᵀ (the caller applies the
// scale: cuBLASLt's INT8 kernels write int32 or int8, not bf16).
#include "common.h"

// k and n must be multiples of 16, every pointer 16-byte aligned.
MSLK_API int mslk_i8i8i32_cublas(
    void* handle,
    const void* xq,
    const void* wq,
    void* out,
    int64_t m,
    int64_t n,
    int64_t k,
    void* workspace,
    size_t workspace_bytes,
    cudaStream_t stream) {
  mslk::MatmulDesc desc;
  MSLK_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc.value, CUBLAS_COMPUTE_32I, CUDA_R_32I));
  const int32_t alpha = 1;
  const int32_t beta = 0;
  return mslk::matmul_tn(
      static_cast<cublasLtHandle_t>(handle),
      desc.value,
      CUDA_R_8I,
      CUDA_R_32I,
      &alpha,
      &beta,
      xq,
      wq,
      out,
      m,
      n,
      k,
      workspace,
      workspace_bytes,
      stream);
}

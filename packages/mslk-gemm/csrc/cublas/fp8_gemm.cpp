// f8f8bf16_cublas: out [m, n] bf16 = (xq [m, k] · wq [n, k]ᵀ) · x_scale · w_scale, FP8 e4m3 operands.
#include "common.h"

// Scales are device fp32 pointers: one value each (tensorwise; null means 1), or with `rowwise`, x_scale [m]
// and w_scale [n] (cuBLASLt's outer-vector scaling, sm_90 only). k must be a multiple of 16, n of 16 as well
// (16-byte rows), and every pointer 16-byte aligned.
MSLK_API int mslk_f8f8bf16_cublas(
    void* handle,
    const void* xq,
    const void* wq,
    void* out,
    int64_t m,
    int64_t n,
    int64_t k,
    const float* x_scale,
    const float* w_scale,
    int rowwise,
    int use_fast_accum,
    void* workspace,
    size_t workspace_bytes,
    cudaStream_t stream) {
  mslk::MatmulDesc desc;
  MSLK_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&desc.value, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLAS's A is wq and its B is xq (see matmul_tn), so w_scale scales A: per row of op(A), i.e. per n.
  if (w_scale != nullptr) {
    MSLK_RETURN_IF_ERROR(mslk::set(desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(w_scale)));
  }
  if (x_scale != nullptr) {
    MSLK_RETURN_IF_ERROR(mslk::set(desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(x_scale)));
  }
  if (rowwise) {
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    MSLK_RETURN_IF_ERROR(mslk::set(desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode));
    MSLK_RETURN_IF_ERROR(mslk::set(desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode));
  }
  const int8_t fast_accum = use_fast_accum ? 1 : 0;
  MSLK_RETURN_IF_ERROR(mslk::set(desc.value, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum));
  const float alpha = 1.0f;
  const float beta = 0.0f;
  return mslk::matmul_tn(
      static_cast<cublasLtHandle_t>(handle),
      desc.value,
      CUDA_R_8F_E4M3,
      CUDA_R_16BF,
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

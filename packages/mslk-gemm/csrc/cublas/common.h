// The C ABI of libmslk_gemm_cublas (loaded by mslk/gemm/native/library.py with ctypes) and the pieces its
// GEMMs share.
//
// Conventions of every exported GEMM: it returns a cublasStatus_t (0: success); its first argument is a handle
// that the library created (mslk_cublaslt_create / mslk_cublas_create), its last three are a device workspace,
// its size in bytes and the cudaStream_t to run on. Tensors are device pointers with sizes and leading
// dimensions in elements; everything runs on the calling thread's current device. No torch types cross the
// boundary, so the library works with any torch build of CUDA 13.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

#define MSLK_API extern "C" __attribute__((visibility("default")))

#define MSLK_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    const cublasStatus_t mslk_status_ = (expr);    \
    if (mslk_status_ != CUBLAS_STATUS_SUCCESS) {   \
      return mslk_status_;                         \
    }                                              \
  } while (0)

namespace mslk {

// Owns a cuBLASLt descriptor, so that every early return frees it.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Owned {
  T value = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (value != nullptr) {
      Destroy(value);
    }
  }
};

using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;

template <typename T>
cublasStatus_t set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value));
}

// out [m, n] (row-major, leading dimension n) = x [m, k] · w [n, k]ᵀ, x and w row-major (leading dimension k),
// with the compute type, scales and epilogue that `desc` holds. In cuBLAS's column-major terms this is
// outᵀ [n, m] = w · xᵀ: A = w transposed, B = x not transposed, the "TN" layout that the FP8 and INT8 tensor-core
// kernels require. alpha and beta point to host values of desc's scale type.
cublasStatus_t matmul_tn(
    cublasLtHandle_t handle,
    cublasLtMatmulDesc_t desc,
    cudaDataType_t in_type,
    cudaDataType_t out_type,
    const void* alpha,
    const void* beta,
    const void* x,
    const void* w,
    void* out,
    int64_t m,
    int64_t n,
    int64_t k,
    void* workspace,
    size_t workspace_bytes,
    cudaStream_t stream);

}  // namespace mslk

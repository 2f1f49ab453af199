"""The native part of mslk-gemm: cuBLAS(Lt) GEMMs in libmslk_gemm_cublas (csrc/cublas), called through a C ABI.

`library` loads the library and runs its functions; `fp8_gemm` defines `f8f8bf16_cublas`; `int8_gemm` and
`bf16x9_gemm` add cuBLAS backends to ops defined in mslk.gemm.triton; `toolkit` finds the CUDA headers and
libraries; `python -m mslk.gemm.native.build` builds the library in place. See docs/native.md.
"""

"""The reference library's module paths of its FP4 quantizers (spec Q-12, Q-13), kept so that code importing
them runs: `quantize_kernels.mx4.quantize_mx4`, `quantize_kernels.mx4_stacked.quantize_mx4_stacked`,
`quantize_kernels.nvfp4.quantize_nvfp4`. The kernels live in mslk.quantize.triton.fp4_quantize."""

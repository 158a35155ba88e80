"""GPU checks and timings of the kernels at Llama-3-8B shapes: attention, W4A16/W8A16 GEMM and GEMV,
W8A8 GEMM and GEMV, the elementwise kernels (``python -m kernels.bench.NAME``; needs CUDA)."""

"""The ground floor: Triton kernels and the plain-torch references they are tested against.

    torch_ops.py      the IR's ops in plain torch (norms, RoPE, attention, SwiGLU): the reference every
                      kernel is checked against, and what the runtime runs on the CPU
    torch_quant.py    quantized linears in plain torch (W4A16/W8A16 dequantize, W8A8 INT8/FP8): the same
    fused_norm.py, rope.py, activation.py, paged_attention.py, w4a16_gemm.py, w8a8_gemm.py, gemv.py, moe.py
                      the Triton kernels the runtime runs on CUDA
    bench/            GPU checks and timings of the kernels at real shapes (``python -m kernels.bench.gemm``)

Nothing here imports ``runtime``, ``passes`` or ``builder``: they import kernels, never the reverse.
Importing this package does not import Triton (the CPU runtime runs without it).
"""

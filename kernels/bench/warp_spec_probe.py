"""Does this Triton warp-specialize an attention loop for sm_90? A compile-only probe (no GPU needed).

    env -u TRITON_INTERPRET [PYTHONPATH=/tmp/tr36/site:.] python -m kernels.bench.warp_spec_probe

The prefill attention and the W4A8 GEMM are bound by Triton waiting on each wgmma right after issuing it
(docs/BENCHMARKS.md, sessions 51-52); FlashAttention-3 hides that wait by giving the loads, the MMAs and the softmax to
different warp groups. Triton has a loop option for it, ``tl.range(..., warp_specialize=True)``, and its sm_90
pipeline runs a Hopper warp-specialization pass. This compiles a plain FlashAttention forward loop (128 query rows,
64-key tiles, head dim 128, bf16; keys and values by pointers or by tensor descriptors) with and without the option
at 4 and 8 warps, and prints for each whether it compiled and what specialization left in it: ``ttg.warp_specialize``
regions in the TTGIR, ``setmaxnreg`` in the PTX (the register split between producer and consumer groups), and the
wgmma waits. Session 53, Triton 3.6.0 (the device's) and 3.9.0 alike: with the option the pass fails at 4 warps (an
assertion in WSLowerToken.cpp) and, at 8, compiles to the same code as without it (no region, no setmaxnreg): neither
warp-specializes this loop for sm_90, so a newer Triton carried to the device would not lift that wait either.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.bench.compile_sm90 import compile_kernel


@triton.jit
def _attention_loop(q_ptr, k_ptr, v_ptr, o_ptr, n_ctx, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, WS: tl.constexpr, DESC: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if DESC:
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[n_ctx, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[n_ctx, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    for start in tl.range(0, n_ctx, BLOCK_N, warp_specialize=WS):
        if DESC:
            k = k_desc.load([start, 0])
            v = v_desc.load([start, 0])
        else:
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :])
            v = tl.load(v_ptr + offs_n[:, None] * D + offs_d[None, :])
        s = tl.dot(q, k.T) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_new
    tl.store(o_ptr + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


def probe(warp_specialize: bool, descriptors: bool, num_warps: int) -> str:
    """One line: how the loop compiled for sm_90 with these settings, or why it did not."""
    name = f"warp_specialize={warp_specialize!s:5} descriptors={descriptors!s:5} warps={num_warps}"
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "n_ctx": "i32", "qk_scale": "fp32"}
    try:
        kernel = compile_kernel(_attention_loop, types, dict(BLOCK_M=128, BLOCK_N=64, D=128, WS=warp_specialize,
                                                             DESC=descriptors),
                                num_warps=num_warps, num_stages=3, divisible=("q_ptr", "k_ptr", "v_ptr", "o_ptr",
                                                                              "n_ctx"))
    except Exception as e:  # the pass manager's failure (its reproducer went to stderr)
        return f"{name}: did not compile ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    return (f"{name}: warp_specialize regions {ttgir.count('ttg.warp_specialize')}, setmaxnreg "
            f"{ptx.count('setmaxnreg')}, wgmma {ptx.count('wgmma.mma_async')}, wgmma waits "
            f"{ptx.count('wgmma.wait_group')}, TMA loads {ptx.count('cp.async.bulk.tensor')}")


def main() -> int:
    print(f"triton {triton.__version__}, sm_90")
    for warp_specialize in (False, True):
        for descriptors in (False, True):
            for num_warps in (4, 8):
                print(probe(warp_specialize, descriptors, num_warps), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

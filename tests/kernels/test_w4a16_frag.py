"""The fragment-order W4A16 layout (``kernels/w4a16_frag.py``): on the CPU, its round trip, its dequantization
(Triton, under the interpreter) against the passes' bit for bit, and a lane-level emulation of the kernel's K loop
written from the PTX ISA's definition of the ``mma.m16n8k16`` bf16 fragments (not from ``repack_frag``'s index
arithmetic), so the layout is checked against what the tensor cores will read. The kernel itself is inline PTX
and runs on CUDA only: the GPU test at the end (real shapes, 1-16 rows) is skipped here and runs through
``builder/devtools/check_kernels.py`` on the device."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.torch_quant import dequantize_weight, unpack_int4
from kernels.w4a16_frag import (
    FragConfig,
    dequantize_frag,
    repack_frag,
    supports,
    unrepack_frag,
    w4a16_frag,
)
from kernels.w4a16_gemm import ref_w4a16_linear
from passes.quant_math import QuantConfig, pack_int4, quantize_groups


def _weights(n: int, k: int, group_size: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : k // 4] += 0.03  # groups off-centre: zero points vary
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=4, group_size=group_size, symmetric=False))
    return {"qweight": pack_int4(codes), "scales": scales, "zeros": zeros, "group_size": group_size, "bits": 4,
            "layout": "passes"}


@pytest.mark.parametrize("n,k,group_size", [(32, 128, 128), (64, 256, 128), (96, 384, -1)])
def test_round_trip_and_dequantization(n, k, group_size):
    passes = _weights(n, k, group_size, seed=n + k)
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], group_size)
    assert packed["qweight"].shape == passes["qweight"].shape  # same bytes, another order
    assert not torch.equal(packed["qweight"], passes["qweight"])
    q, s, z = unrepack_frag(packed["qweight"], packed["scales"], packed["zeros"], group_size)
    assert torch.equal(q, passes["qweight"]) and torch.equal(s, passes["scales"]) and torch.equal(z, passes["zeros"])
    ref = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], 4, group_size, torch.float32)
    assert torch.equal(dequantize_frag(**packed, dtype=torch.float32), ref)
    # bf16: one rounding of the fp32 product (the interpreter's conversion may round the other way: one ulp)
    torch.testing.assert_close(dequantize_frag(**packed, dtype=torch.bfloat16).float(), ref, rtol=2**-7, atol=0)


def _lane_fragments(word: int) -> list[tuple[int, int]]:
    """The PTX unpacking of one 32-bit word into four bf16x2 registers: (low, high) code of each register.
    prmt 0x4140 / 0x4342 spread bytes 0, 1 / 2, 3 into the two halves, the LOP keeps the low nibble; after the
    4-bit shift, the high nibble."""
    b = [(word >> (8 * i)) & 0xFF for i in range(4)]
    return [(b[0] & 0xF, b[1] & 0xF), (b[2] & 0xF, b[3] & 0xF), (b[0] >> 4, b[1] >> 4), (b[2] >> 4, b[3] >> 4)]


def _emulate(x: torch.Tensor, packed: dict, n: int, k: int) -> torch.Tensor:
    """y [M, N] computed as the kernel's lanes do, from the PTX ISA's fragment definitions for mma.m16n8k16
    (.bf16, row.col): A register r of lane 4g + c holds A[g + 8 (r % 2)][2c + 8 (r // 2) + {0, 1}]; B register
    r holds B[2c + 8 r + {0, 1}][g]; C registers 0, 1 are C[g][2c + {0, 1}], 2, 3 C[g + 8][2c + {0, 1}]."""
    qw = packed["qweight"].reshape(-1).tolist()
    scales, zeros = packed["scales"], packed["zeros"]  # [G, N]
    one_group = scales.shape[0] == 1
    m = x.shape[0]
    xs = x.float()
    y = torch.zeros(m, n)
    for tile in range(n // 16):
        for it in range(k // 128):  # one group of 128 features per iteration
            grp = 0 if one_group else it
            acc = torch.zeros(16, 8)  # C of the tile for rows 0..7 of x
            for chunk in (2 * it, 2 * it + 1):
                base = (tile * (k // 64) + chunk) * 512
                for j in range(4):  # k16 step: features 64 chunk + 16 j ...
                    a = torch.zeros(16, 16)
                    for lane in range(32):
                        g, c = divmod(lane, 4)
                        w = int.from_bytes(bytes(qw[base + 16 * lane + 4 * j: base + 16 * lane + 4 * j + 4]), "little")
                        for r, (lo, hi) in enumerate(_lane_fragments(w)):
                            row, col = g + 8 * (r % 2), 2 * c + 8 * (r // 2)
                            zero = zeros[grp, tile * 16 + row].item()
                            a[row, col], a[row, col + 1] = lo - zero, hi - zero
                    k0 = 64 * chunk + 16 * j
                    bmat = torch.zeros(16, 8)
                    bmat[:, :m] = xs[:, k0: k0 + 16].t()
                    acc += a @ bmat
            s = scales[grp, tile * 16: tile * 16 + 16][:, None]
            y[:, tile * 16: tile * 16 + 16] += (acc * s).t()[:m]
    return y


@pytest.mark.parametrize("m,group_size", [(1, 128), (3, -1)])
def test_layout_is_the_mma_fragment_order(m, group_size):
    n, k = 32, 256
    passes = _weights(n, k, group_size, seed=7 + m)
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], group_size)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref = ref_w4a16_linear(x.float(), **passes)
    torch.testing.assert_close(_emulate(x, packed, n, k), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_refusals():
    assert supports(4, 128, 4096, 6144) and supports(4, -1, 256, 64)
    assert not supports(4, 64, 4096, 6144) and not supports(8, 128, 4096, 6144) and not supports(4, 128, 4096, 48)
    passes = _weights(48, 256, 128, seed=1)
    with pytest.raises(ValueError, match="multiple of 32"):
        repack_frag(passes["qweight"], passes["scales"], passes["zeros"], 128)
    passes = _weights(32, 256, 128, seed=1)
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], 128)
    with pytest.raises(ValueError, match="CUDA"):
        w4a16_frag(torch.randn(1, 256).to(torch.bfloat16), **packed)
    with pytest.raises(ValueError, match="'frag' layout"):
        dequantize_frag(**{**packed, "layout": "mma"}, dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="inline PTX: CUDA only (builder/devtools/check_kernels.py runs it on the device)")
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 17, 32, 45])
@pytest.mark.parametrize("n,k,group_size", [(6144, 4096, 128), (4096, 14336, 128), (512, 4096, -1)])
def test_kernel_on_cuda(m, n, k, group_size):
    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, group_size, seed=m + n).items()}
    packed = repack_frag(passes["qweight"], passes["scales"], passes["zeros"], group_size)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    ref = ref_w4a16_linear(x, **passes, bias=bias).float()
    for cfg in (None, FragConfig(split_k=1, depth=1), FragConfig(warps=2, split_k=3)):
        y = w4a16_frag(x, **packed, bias=bias, config=cfg).float()
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())

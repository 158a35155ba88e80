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

from kernels.torch_quant import dequantize_weight
from kernels.w4a16_frag import (
    FragConfig,
    GemmConfig,
    PendingNorm,
    ResidualSum,
    deinterleave_gate_up,
    dequantize_frag,
    frag_gemm,
    gate_up_order,
    interleave_gate_up,
    repack_frag,
    supports,
    unrepack_frag,
    w4a16_frag,
)
from kernels.w4a16_gemm import ref_w4a16_linear
from passes.quant_math import QuantConfig, pack_int4, quantize_groups


def _weights(n: int, k: int, group_size: int, seed: int, bits: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : k // 4] += 0.03  # groups off-centre: zero points vary
    codes, scales, zeros = quantize_groups(w, QuantConfig(bits=bits, group_size=group_size, symmetric=False))
    return {"qweight": pack_int4(codes) if bits == 4 else codes, "scales": scales, "zeros": zeros,
            "group_size": group_size, "bits": bits, "layout": "passes"}


def _repack(passes: dict) -> dict:
    return repack_frag(passes["qweight"], passes["scales"], passes["zeros"], passes["group_size"], passes["bits"])


@pytest.mark.parametrize("n,k,group_size,bits", [(32, 128, 128, 4), (64, 256, 128, 4), (96, 384, -1, 4),
                                                 (32, 64, -1, 8), (64, 192, -1, 8)])
def test_round_trip_and_dequantization(n, k, group_size, bits):
    passes = _weights(n, k, group_size, seed=n + k, bits=bits)
    packed = _repack(passes)
    assert packed["qweight"].shape == passes["qweight"].shape  # same bytes, another order
    assert not torch.equal(packed["qweight"], passes["qweight"])
    q, s, z = unrepack_frag(packed["qweight"], packed["scales"], packed["zeros"], group_size, bits)
    assert torch.equal(q, passes["qweight"]) and torch.equal(s, passes["scales"]) and torch.equal(z, passes["zeros"])
    ref = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], bits, group_size, torch.float32)
    assert torch.equal(dequantize_frag(**packed, dtype=torch.float32), ref)
    assert torch.equal(dequantize_frag(**packed, dtype=torch.float32, by_words=False), ref)
    # bf16: one rounding of the fp32 product (the interpreter's conversion may round the other way: one ulp)
    torch.testing.assert_close(dequantize_frag(**packed, dtype=torch.bfloat16).float(), ref, rtol=2**-7, atol=0)


def _lane_fragments(word: int) -> list[tuple[int, int]]:
    """The PTX unpacking of one 32-bit word into four bf16x2 registers: (low, high) code of each register.
    prmt 0x4140 / 0x4342 spread bytes 0, 1 / 2, 3 into the two halves, the LOP keeps the low nibble; after the
    4-bit shift, the high nibble."""
    b = [(word >> (8 * i)) & 0xFF for i in range(4)]
    return [(b[0] & 0xF, b[1] & 0xF), (b[2] & 0xF, b[3] & 0xF), (b[0] >> 4, b[1] >> 4), (b[2] >> 4, b[3] >> 4)]


def _b_operand(x: torch.Tensor, first: int, step: int) -> torch.Tensor:
    """The B operand [16, M] of k16 step ``step`` of the K iteration starting at feature ``first``, as the kernel's
    x loads fill it: lane 4b + c's registers 4q .. 4q + 3 are one 16-byte load of x[b, first + 32q + 8c ...]
    (register 4q + i: features + 2i, + 2i + 1), and B register h (0, 1) of step w is the lane's register 2w + h,
    holding B[2c + 8h + {0, 1}] (PTX ISA, mma.m16n8k16 B fragment)."""
    b = torch.zeros(16, x.shape[0])
    for c in range(4):
        for h in range(2):
            r = 2 * step + h
            f = first + 32 * (r // 4) + 8 * c + 2 * (r % 4)
            b[2 * c + 8 * h: 2 * c + 8 * h + 2] = x[:, f: f + 2].t()
    return b


def _lane_fragments8(wa: int, wb: int) -> list[tuple[int, int]]:
    """8-bit codes: a k16 step's two words -> the A fragment's four registers, (first, second) code of each; the
    kernel multiplies their nibbles separately (16 hi + lo), a pure identity: the byte placement is what counts."""
    a = [(wa >> (8 * i)) & 0xFF for i in range(4)]
    b = [(wb >> (8 * i)) & 0xFF for i in range(4)]
    return [(a[0], a[1]), (a[2], a[3]), (b[0], b[1]), (b[2], b[3])]


def _emulate8(x: torch.Tensor, packed: dict, n: int, k: int) -> torch.Tensor:
    """As :func:`_emulate`, for 8-bit codes: a 512-byte chunk of a tile is 32 input features, two k16 steps; lane
    4g + c's words 2s, 2s + 1 are step s's registers 0, 1 and 2, 3 (:func:`_lane_fragments8`)."""
    qw = packed["qweight"].reshape(-1).tolist()
    scales, zeros = packed["scales"], packed["zeros"]  # [1, N]
    m = x.shape[0]
    y = torch.zeros(m, n)
    for tile in range(n // 16):
        acc = torch.zeros(16, 8)
        for chunk in range(k // 32):
            base = (tile * (k // 32) + chunk) * 512
            for step in range(2):
                a = torch.zeros(16, 16)
                for lane in range(32):
                    g, c = divmod(lane, 4)
                    off = base + 16 * lane + 8 * step
                    wa = int.from_bytes(bytes(qw[off: off + 4]), "little")
                    wb = int.from_bytes(bytes(qw[off + 4: off + 8]), "little")
                    for r, (v0, v1) in enumerate(_lane_fragments8(wa, wb)):
                        row, col = g + 8 * (r % 2), 2 * c + 8 * (r // 2)
                        zero = zeros[0, tile * 16 + row].item()
                        a[row, col], a[row, col + 1] = v0 - zero, v1 - zero
                bmat = torch.zeros(16, 8)
                bmat[:, :m] = _b_operand(x.float(), 64 * (chunk // 2), 2 * (chunk % 2) + step)
                acc += a @ bmat
        y[:, tile * 16: tile * 16 + 16] = (acc * scales[0, tile * 16: tile * 16 + 16][:, None]).t()[:m]
    return y


def _emulate(x: torch.Tensor, packed: dict, n: int, k: int) -> torch.Tensor:
    """y [M, N] computed as the kernel's lanes do, from the PTX ISA's fragment definitions for mma.m16n8k16
    (.bf16, row.col): A register r of lane 4g + c holds A[g + 8 (r % 2)][2c + 8 (r // 2) + {0, 1}]; B register
    r holds B[2c + 8 r + {0, 1}][g]; C registers 0, 1 are C[g][2c + {0, 1}], 2, 3 C[g + 8][2c + {0, 1}]."""
    if packed["bits"] == 8:
        return _emulate8(x, packed, n, k)
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
                    bmat = torch.zeros(16, 8)
                    bmat[:, :m] = _b_operand(xs, 128 * it, 4 * (chunk % 2) + j)
                    acc += a @ bmat
            s = scales[grp, tile * 16: tile * 16 + 16][:, None]
            y[:, tile * 16: tile * 16 + 16] += (acc * s).t()[:m]
    return y


@pytest.mark.parametrize("m,group_size,bits", [(1, 128, 4), (3, -1, 4), (2, -1, 8)])
def test_layout_is_the_mma_fragment_order(m, group_size, bits):
    n, k = 32, 256
    passes = _weights(n, k, group_size, seed=7 + m, bits=bits)
    packed = _repack(passes)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref = ref_w4a16_linear(x.float(), **passes)
    torch.testing.assert_close(_emulate(x, packed, n, k), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_refusals():
    assert supports(4, 128, 4096, 6144) and supports(4, -1, 256, 64) and supports(8, -1, 4096, 6144)
    assert not supports(4, 64, 4096, 6144) and not supports(8, 128, 4096, 6144) and not supports(4, 128, 4096, 48)
    assert not supports(8, -1, 96, 64) and not supports(2, -1, 4096, 64)
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
@pytest.mark.parametrize("n,k,group_size,bits", [(6144, 4096, 128, 4), (4096, 14336, 128, 4), (512, 4096, -1, 4),
                                                 (6144, 4096, -1, 8), (4096, 14336, -1, 8)])
def test_kernel_on_cuda(m, n, k, group_size, bits):
    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, group_size, seed=m + n, bits=bits).items()}
    packed = _repack(passes)
    torch.testing.assert_close(dequantize_frag(**packed, dtype=torch.float32),
                               dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], bits,
                                                 group_size, torch.float32), rtol=0, atol=0)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    ref = ref_w4a16_linear(x, **passes, bias=bias).float()
    for cfg in (None, FragConfig(split_k=1, depth=1), FragConfig(warps=2, split_k=3), FragConfig(split_k=5, depth=3),
                FragConfig(warps=8, depth=4)):
        y = w4a16_frag(x, **packed, bias=bias, config=cfg).float()
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="inline PTX: CUDA only")
@pytest.mark.parametrize("m", [1, 9, 32])
def test_kernel_rounds_like_one_bf16_rounding_of_the_exact_sum(m):
    """Groups of 128: y within one bf16 ulp of the fp64 sum (each group's fp32 sum scaled once, the splits' partials
    added in fp32, rounded once), on x with a common offset (large sums: where an fp32 sum loses bits)."""
    n, k = 4096, 4096
    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, 128, seed=m + 17).items()}
    packed = _repack(passes)
    gen = torch.Generator(device="cuda").manual_seed(m + 5)
    x = (3.0 + torch.randn(m, k, generator=gen, device="cuda")).to(torch.bfloat16)
    w = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], 4, 128, torch.float64)
    ref = x.double() @ w.T
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)  # bf16: 8 significant bits
    for cfg in (None, FragConfig(split_k=1), FragConfig(warps=2, split_k=5, depth=2)):
        err = (w4a16_frag(x, **packed, config=cfg).double() - ref).abs()
        bad = err > ulp + 1e-5 * ref.abs().max()
        assert not bad.any(), (cfg, bad.sum().item(), (err / ulp).max().item())


def test_gate_up_order_pairs_each_gate_tile_with_its_up_tile():
    """The gated kernel's row order: a warp's two 16-row tiles are gate rows r..r+15 and up rows r..r+15 (the
    epilogue's reshape), the weights' rows (codes, scales, zeros, bias) move together, and deinterleave_gate_up
    brings the linear's output back to [gate | up] exactly."""
    order = gate_up_order(64)
    assert order.tolist() == list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
    with pytest.raises(ValueError, match="whole"):
        gate_up_order(48)
    passes = _weights(96, 256, 128, seed=3)
    bias = torch.randn(96)
    q, s, z, b = interleave_gate_up(passes["qweight"], passes["scales"], passes["zeros"], bias)
    w = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], 4, 128, torch.float32)
    w_i = dequantize_weight(q, s, z, 4, 128, torch.float32)
    x = torch.randn(5, 256)
    assert torch.equal(deinterleave_gate_up(x @ w_i.T + b), x @ w.T + bias)
    # the gated epilogue's view of one program's sums (warps x [gate 16 | up 16]) is the gate and up halves
    y = x @ w_i.T + b
    warps = 3
    v = y[:, : warps * 32].reshape(5, warps, 2, 16).permute(0, 1, 3, 2).reshape(5, warps * 16, 2)
    ref = x @ w.T + bias
    assert torch.equal(v[..., 0], ref[:, : warps * 16]) and torch.equal(v[..., 1], ref[:, 48: 48 + warps * 16])


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="inline PTX: CUDA only")
@pytest.mark.parametrize("m", [1, 16, 33])
@pytest.mark.parametrize("n,k,group_size,bits", [(28672, 4096, 128, 4), (1024, 512, -1, 4), (2048, 256, -1, 8)])
def test_gated_kernel_on_cuda(m, n, k, group_size, bits):
    """w4a16_frag(gated=True) on interleaved gate/up weights equals silu_mul of the plain kernel's output on the
    original weights, bit for bit (the same sums in the same order, rounded once, then silu_mul's numerics)."""
    from kernels.activation import silu_mul

    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, group_size, seed=m + n, bits=bits).items()}
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    plain = _repack(passes)
    q, s, z, b = interleave_gate_up(passes["qweight"], passes["scales"], passes["zeros"], bias)
    gated = repack_frag(q, s, z, group_size, bits)
    for cfg in (None, FragConfig(warps=2, split_k=3)):
        ref = silu_mul(w4a16_frag(x, **plain, bias=bias, config=cfg))
        y = w4a16_frag(x, **gated, bias=b, config=cfg, gated=True)
        assert y.shape == (m, n // 2)
        assert torch.equal(y, ref), (cfg, (y.float() - ref.float()).abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="inline PTX: CUDA only")
@pytest.mark.parametrize("m", [1, 16, 40])
@pytest.mark.parametrize("bits", [4, 8])
def test_residual_out_and_norm_in_on_cuda(m, bits):
    """The residual-add + RMSNorm between two frag linears, split across them: the first adds its output to the
    residual (ResidualSum.total equal to fused_add_rms_norm's total, bit for bit; row_ss its rows' sums of squares
    per program), the second applies the norm as it loads x (PendingNorm): equal to the plain kernel on
    fused_add_rms_norm's normed rows up to the rstd's rounding (the sums of squares added in another order)."""
    from kernels.fused_norm import fused_add_rms_norm

    group = 128 if bits == 4 else -1
    first = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
             _weights(4096, 1024, group, seed=m, bits=bits).items()}
    second = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(2048, 4096, group, seed=m + 1, bits=bits).items()}
    p1, p2 = _repack(first), _repack(second)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    # rows of very different scales: a row normalised with another row's rstd would be off by up to 16x
    res = (torch.randn(m, 4096, generator=gen, device="cuda")
           * torch.linspace(0.25, 4.0, m, device="cuda")[:, None]).to(torch.bfloat16)
    gain = (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).to(torch.bfloat16)
    for cfg in (None, FragConfig(warps=2, split_k=3)):
        y = w4a16_frag(x, **p1, config=cfg)
        normed, total = fused_add_rms_norm(y, res, gain, 1e-5)
        out = w4a16_frag(x, **p1, config=cfg, residual=res)
        assert isinstance(out, ResidualSum) and torch.equal(out.total, total)
        parts = out.row_ss.shape[1]
        want = total.float().pow(2).reshape(m, parts, -1).sum(-1)
        torch.testing.assert_close(out.row_ss, want, rtol=1e-5, atol=0)
        ref = w4a16_frag(normed, **p2, config=cfg).float()
        got = w4a16_frag(PendingNorm(out.total, out.row_ss, gain, 1e-5), **p2, config=cfg).float()
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        again = w4a16_frag(PendingNorm(out.total, out.row_ss, gain, 1e-5), **p2, config=cfg)
        assert torch.equal(again.float(), got)  # deterministic: the same sums on every launch


@pytest.mark.parametrize("m,n,k,group_size", [(37, 64, 256, 128), (16, 96, 384, -1), (5, 32, 128, 128),
                                              (20, 160, 256, 128)])
def test_frag_gemm_matches_the_dequantized_weights(m, n, k, group_size):
    """frag_gemm's unpacking (words -> nibbles -> the [N, 128] tile in natural feature order; under the interpreter
    the same index math as on the GPU, dots in fp32) and its zero points and scales applied to the groups' sums,
    against x @ the dequantized weights in fp32: groups of 128 and per channel, rows that do not fill a tile, N
    that does not fill a program's tiles (160 = 10 tiles), a bias, split-K, several configs."""
    passes = _weights(n, k, group_size, seed=m * n + k)
    packed = _repack(passes)
    g = torch.Generator().manual_seed(m + 11)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    w = dequantize_frag(**packed, dtype=torch.float32)
    ref = x.float() @ w.T + bias.float()
    for cfg in (None, GemmConfig(block_m=16, tiles_n=1, num_warps=4, num_stages=1, split_k=3),
                GemmConfig(block_m=32, tiles_n=4, num_warps=4, num_stages=2, split_k=1)):
        y = frag_gemm(x, **packed, bias=bias, config=cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # the fp32 sum rounded once to bf16: within one bf16 ulp of the reference
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)
    y = frag_gemm(x.reshape(1, m, k), **packed)  # leading dims kept, no bias
    torch.testing.assert_close(y.float(), (x.float() @ w.T).reshape(1, m, n), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("m,n,k", [(37, 64, 192), (5, 160, 128)])
def test_frag_gemm_8bit_matches_the_dequantized_weights(m, n, k):
    """8-bit codes (one group per channel): bytes unpacked in the words' own feature order, 64 features per
    iteration, the zero point and scale applied after the loop."""
    passes = _weights(n, k, -1, seed=m + n + k, bits=8)
    packed = _repack(passes)
    g = torch.Generator().manual_seed(m + 5)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    ref = x.float() @ dequantize_frag(**packed, dtype=torch.float32).T + bias.float()
    for cfg in (None, GemmConfig(block_m=16, tiles_n=4, num_warps=4, num_stages=1, split_k=2)):
        y = frag_gemm(x, **packed, bias=bias, config=cfg)
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="bf16 tensor cores: CUDA only (kernels.bench.gemm --frag-gemm runs it on the device)")
@pytest.mark.parametrize("m", [65, 128, 300, 1024])
@pytest.mark.parametrize("n,k,group_size,bits", [(6144, 4096, 128, 4), (4096, 14336, 128, 4), (512, 4096, -1, 4),
                                                 (160, 256, 128, 4), (6144, 4096, -1, 8), (4096, 14336, -1, 8)])
def test_frag_gemm_on_cuda(m, n, k, group_size, bits):
    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, group_size, seed=m + n, bits=bits).items()}
    packed = _repack(passes)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    ref = ref_w4a16_linear(x, **passes, bias=bias).float()
    for cfg in (None, GemmConfig(block_m=128, tiles_n=8, num_warps=8, num_stages=3, split_k=1),
                GemmConfig(block_m=64, tiles_n=4, num_warps=4, num_stages=2, split_k=5)):
        y = frag_gemm(x, **packed, bias=bias, config=cfg).float()
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA only (the interpreter runs both paths in test_round_trip_and_dequantization)")
@pytest.mark.parametrize("n,k,group_size,bits", [(6144, 4096, 128, 4), (4096, 14336, 128, 4), (512, 4096, -1, 4),
                                                 (160, 256, 128, 4), (6144, 4096, -1, 8), (4096, 14336, -1, 8),
                                                 (160, 192, -1, 8)])
def test_dequantize_frag_by_words_on_cuda(n, k, group_size, bits):
    passes = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in
              _weights(n, k, group_size, seed=n + k, bits=bits).items()}
    packed = _repack(passes)
    ref = dequantize_weight(passes["qweight"], passes["scales"], passes["zeros"], bits, group_size, torch.float32)
    assert torch.equal(dequantize_frag(**packed, dtype=torch.float32), ref)
    assert torch.equal(dequantize_frag(**packed, dtype=torch.bfloat16),
                       dequantize_frag(**packed, dtype=torch.bfloat16, by_words=False))


def test_env_config_parses_and_refuses():
    from kernels.w4a16_frag import _env_config

    assert _env_config(None) is None and _env_config("") is None
    assert _env_config("8/0/4") == FragConfig(warps=8, split_k=0, depth=4)
    for bad in ("4/0", "4/0/5", "3/0/1", "a/b/c", "4/99/1"):
        with pytest.raises(ValueError, match="KERNELS_FRAG_CONFIG"):
            _env_config(bad)

"""kernels.w8a8_frag: the FP8 W8A8 kernel on E4M3 ``mma.sync.m16n8k32`` reading the [N, K] weights as stored.

On the CPU the kernel's PTX cannot run; what can be checked is the argument it rests on. The lane-level emulation
below reads the generated PTX itself (which bytes each weight load puts in which register, which registers each
``mma`` line takes as its A and B fragments and accumulators, which x features each x register holds) and
multiplies the fragments as the PTX ISA defines them for m16n8k32 (A: row g in registers 0 and 2, row g + 8 in 1
and 3, k 4c.. in 0 and 1, 16 + 4c.. in 2 and 3; B: k 4c.. in register 0, 16 + 4c.. in 1, column g; C: rows g and
g + 8, columns 2c and 2c + 1): one warp's result must be W @ x.T for random W and x. On CUDA (sm_89+) the kernel
runs against ``ref_w8a8_linear`` at small and Llama-3-8B shapes, 1-40 rows, dynamic and static scales.
"""

from __future__ import annotations

import re

import pytest
import torch

from kernels import w8a8_frag
from kernels.torch_quant import quantize_weight_fp8
from kernels.w8a8_gemm import ref_w8a8_linear


def _weight_regs(j_chunks: int) -> dict[int, tuple[int, int]]:
    """Weight register index -> (row offset from the lane's row g, byte offset from 16 c), from the load PTX."""
    regs, rows = {}, None
    for line in w8a8_frag._load_weights_ptx(j_chunks).splitlines():
        if line.startswith("mov.u64 b, a;"):
            rows = 0
        elif line.startswith("add.u64 b, b, r8;"):
            rows += 8
        elif line.startswith("ld.global.nc.v4.b32"):
            ops = [int(t) for t in re.findall(r"\$(\d+)", line.split("[")[0])]
            off = int(re.search(r"\[b\+(\d+)\]", line).group(1))
            for w, op in enumerate(ops):
                regs[op] = (rows, off + 4 * w)
    return regs


def _x_regs(batch_tiles: int, j_chunks: int) -> dict[int, tuple[int, list[int]]]:
    """x register index -> (batch tile, the features of its 4 bytes relative to 16 c), from the x-load PTX."""
    regs, bt, word_base, half_words = {}, None, {}, {}
    last_word = None
    for line in w8a8_frag._load_x_ptx(batch_tiles, j_chunks).splitlines():
        m = re.match(r"add\.u32 b, g, (\d+);", line)
        if m:
            bt = int(m.group(1)) // 8
        m = re.match(r"ld\.global\.v4\.b32 \{w(\d), w\d, w\d, w\d\}, \[a\+(\d+)\];", line)
        if m:  # bf16 words: word i of the load holds features (off / 2) + 2i, + 1
            first, off = int(m.group(1)), int(m.group(2))
            for i in range(4):
                word_base[first + i] = off // 2 + 2 * i
        m = re.match(r"shl\.b32 lo, w(\d), 16;", line)
        if m:
            last_word = int(m.group(1))
        m = re.match(r"cvt\.rn\.satfinite\.e4m3x2\.f32 h(\d), hi, lo;", line)
        if m:  # low byte: the word's low bf16 (feature f), high byte its high one (f + 1)
            half_words[int(m.group(1))] = word_base[last_word]
        m = re.match(r"mov\.b32 \$(\d+), \{h0, h1\};", line)
        if m:
            f0, f1 = half_words[0], half_words[1]
            regs[int(m.group(1))] = (bt, [f0, f0 + 1, f1, f1 + 1])
    return regs


def _emulate_warp(w: torch.Tensor, x: torch.Tensor, batch_tiles: int, j_chunks: int) -> torch.Tensor:
    """One warp's 32 output features over one K iteration (64 J features), computed from the PTX's operand
    choices and the ISA's fragment definitions. w [32, 64 J], x [8 bt, 64 J] -> [8 bt, 32]."""
    n_out = 8 * batch_tiles
    w0 = n_out
    x0 = w0 + 16 * j_chunks
    wregs, xregs = _weight_regs(j_chunks), _x_regs(batch_tiles, j_chunks)
    acc = torch.zeros(n_out, 32, dtype=torch.float64)  # per accumulator register a_i, per lane

    def w_bytes(op: int, g: int, c: int) -> list[float]:
        rows, off = wregs[op - w0]
        return [w[g + rows, 16 * c + off + e].item() for e in range(4)]

    def x_bytes(op: int, g: int, c: int) -> list[float]:
        bt, feats = xregs[op - x0]
        return [x[g + 8 * bt, 16 * c + f].item() for f in feats]

    mma_lines = [ln for ln in w8a8_frag._compute_ptx(batch_tiles, j_chunks).splitlines() if ln.startswith("mma.")]
    assert len(mma_lines) == 2 * 2 * j_chunks * batch_tiles
    for line in mma_lines:
        groups = re.findall(r"\{([^}]*)\}", line)
        accs = [int(t.strip()[1:]) for t in groups[0].split(",")]  # a<i>
        a_ops = [int(t.strip()[1:]) for t in groups[1].split(",")]
        b_ops = [int(t.strip()[1:]) for t in groups[2].split(",")]
        a = torch.zeros(16, 32, dtype=torch.float64)
        b = torch.zeros(32, 8, dtype=torch.float64)
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for reg, (row, k0) in enumerate(((g, 4 * c), (g + 8, 4 * c), (g, 16 + 4 * c), (g + 8, 16 + 4 * c))):
                a[row, k0: k0 + 4] = torch.tensor(w_bytes(a_ops[reg], g, c), dtype=torch.float64)
            for reg, k0 in enumerate((4 * c, 16 + 4 * c)):
                b[k0: k0 + 4, g] = torch.tensor(x_bytes(b_ops[reg], g, c), dtype=torch.float64)
        d = a @ b  # [16 rows of the tile, 8 columns]
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for i, (row, col) in enumerate(((g, 2 * c), (g, 2 * c + 1), (g + 8, 2 * c), (g + 8, 2 * c + 1))):
                acc[accs[i], lane] += d[row, col]
    # accumulator (tile x bt + bt) x 4 + i of lane 4g + c: output feature 16 tile + g (+ 8), x row 8 bt + 2c (+ 1)
    out = torch.zeros(8 * batch_tiles, 32, dtype=torch.float64)
    for idx in range(n_out):
        tile, bt, i = idx // (4 * batch_tiles), (idx // 4) % batch_tiles, idx % 4
        for lane in range(32):
            g, c = lane // 4, lane % 4
            out[8 * bt + 2 * c + i % 2, 16 * tile + g + 8 * (i // 2)] = acc[idx, lane]
    return out


@pytest.mark.parametrize("batch_tiles", w8a8_frag.BATCH_TILE_COUNTS)
@pytest.mark.parametrize("j_chunks", w8a8_frag.J_CHOICES)
def test_ptx_operands_follow_the_fragment_layout(batch_tiles, j_chunks):
    gen = torch.Generator().manual_seed(10 * batch_tiles + j_chunks)
    w = torch.randn(32, 64 * j_chunks, generator=gen, dtype=torch.float64)
    x = torch.randn(8 * batch_tiles, 64 * j_chunks, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(_emulate_warp(w, x, batch_tiles, j_chunks), x @ w.T, rtol=1e-12, atol=1e-12)


def test_emulation_catches_a_swapped_fragment(monkeypatch):
    """The emulation is sensitive to the operand order it checks: swapping rows g and g + 8 of the A fragment
    (registers 0 and 1) must break it."""
    original = w8a8_frag._compute_ptx

    def swapped(bt, j):
        return re.sub(r"\{(\$\d+), (\$\d+), (\$\d+), (\$\d+)\}, \{\$", r"{\2, \1, \3, \4}, {$", original(bt, j))

    monkeypatch.setattr(w8a8_frag, "_compute_ptx", swapped)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=gen, dtype=torch.float64)
    x = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    assert not torch.allclose(_emulate_warp(w, x, 1, 1), x @ w.T)


def test_refusals_and_runtime_choice():
    qweight = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    scale = torch.ones(64)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    assert not w8a8_frag.runtime_applies(x, 1, qweight)  # CPU x
    with pytest.raises(ValueError, match="CUDA device of compute capability 8.9"):
        w8a8_frag.w8a8_frag(x, qweight, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a8_frag.w8a8_frag(x, qweight.view(torch.int8), scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a8_frag.w8a8_frag(x[:, :96], torch.zeros(48, 96, dtype=torch.float8_e4m3fn), torch.ones(48))
    assert w8a8_frag.supports(4096, 6144) and not w8a8_frag.supports(4000, 6144) and not w8a8_frag.supports(4096, 6000)


_CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _CUDA_FP8, reason="needs a CUDA GPU of compute capability 8.9+ (E4M3 mma.sync)")
@pytest.mark.parametrize("n,k", [(64, 128), (96, 192), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 23, 32, 40])
@pytest.mark.parametrize("static", [False, True])
def test_kernel_on_cuda(n, k, m, static):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    qweight, w_scale = quantize_weight_fp8(w, True)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    x[:, 5] *= 30  # an outlier channel
    input_scale = (x.float().abs().amax() / 448.0).reshape(1) if static else None
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) if m % 2 else None
    ref = ref_w8a8_linear(x, qweight, w_scale, input_scale, bias).float()
    for cfg in (None, w8a8_frag.Fp8FragConfig(warps=8, depth=2, j_chunks=2), w8a8_frag.Fp8FragConfig(split_k=3),
                w8a8_frag.Fp8FragConfig(warps=2, j_chunks=4)):
        y = w8a8_frag.w8a8_frag(x, qweight, w_scale, input_scale, bias, config=cfg).float()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (cfg, err)
        assert ((y - ref).abs().mean() / ref.abs().mean()).item() < 2e-3, cfg


@pytest.mark.skipif(not _CUDA_FP8, reason="needs a CUDA GPU of compute capability 8.9+ (E4M3 mma.sync)")
def test_kernel_in_a_cuda_graph_per_tensor_scale():
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(4096, 4096, generator=gen, device="cuda") * 0.02
    qweight, w_scale = quantize_weight_fp8(w, False)  # one scale for the tensor
    x = (torch.randn(4, 4096, generator=gen, device="cuda")).to(torch.bfloat16)
    w8a8_frag.w8a8_frag(x, qweight, w_scale)  # warm up (compiles; tile counters) before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a8_frag.w8a8_frag(x, qweight, w_scale)
    for _ in range(3):
        x.copy_(torch.randn(4, 4096, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        ref = ref_w8a8_linear(x, qweight, w_scale).float()
        assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2

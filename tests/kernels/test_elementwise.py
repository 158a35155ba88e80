"""RMSNorm, residual-add RMSNorm, LayerNorm, RoPE and SiLU-mul Triton kernels against the runtime's torch ops,
under the Triton interpreter on CPU (CI), or compiled on CUDA with TRITON_INTERPRET=0 (the device's check)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest
import torch

from kernels.activation import ref_silu_mul, silu_mul, silu_mul_tiles
from kernels.fused_norm import (
    fused_add_layer_norm,
    fused_add_rms_norm,
    layer_norm,
    ref_fused_add_layer_norm,
    ref_fused_add_rms_norm,
    ref_layer_norm,
    ref_rms_norm,
    rms_norm,
)
from kernels.rope import apply_rope_, ref_rope

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 runs these kernels on CUDA, and there is no CUDA device", allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16]
# bf16: a few rounding steps (the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest,
# and a norm rounds up to three times: the new residual, the normed row, the product with the gain)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cpu") * scale + shift).to(DEVICE, dtype)


@pytest.fixture(autouse=True)
def _on_device():
    """Every tensor a test makes is on DEVICE (the kernels refuse CPU tensors outside the interpreter)."""
    with torch.device(DEVICE):
        yield


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


# --- norms ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_quantized_out_equals_quantize_rows_of_the_norm(quant, residual, dtype):
    """quantize_to: the codes and scales are exactly quantize_rows of the kernel's own normed rows, the new residual
    is unchanged, and the dequantized rows are within a quantization step of the reference norm."""
    from kernels.w8a8_gemm import QuantizedRows, quantize_rows

    x, res = _randn(5, 200, dtype=dtype, seed=31, scale=3.0), _randn(5, 200, dtype=dtype, seed=32)
    weight = _randn(200, dtype=dtype, seed=33, shift=1.0)
    if residual:
        (qr, total), (normed, total2) = (fused_add_rms_norm(x, res, weight, 1e-6, quantize_to=quant),
                                         fused_add_rms_norm(x, res, weight, 1e-6))
        torch.testing.assert_close(total, total2, rtol=0, atol=0)
        ref = ref_fused_add_rms_norm(x, res, weight, 1e-6)[0]
    else:
        qr, normed = rms_norm(x, weight, 1e-6, quantize_to=quant), rms_norm(x, weight, 1e-6)
        ref = ref_rms_norm(x, weight, 1e-6)
    assert isinstance(qr, QuantizedRows) and qr.codes.dtype == quant and qr.shape == (5, 200)
    codes, scales = quantize_rows(normed, quant)
    torch.testing.assert_close(qr.scales, scales, rtol=0, atol=0)
    assert torch.equal(qr.codes.view(torch.uint8), codes.view(torch.uint8))
    # half a code's spacing at most: e4m3's is 32 at the top of its range (448), int8's 1
    half_step = scales * (16.0 if quant == torch.float8_e4m3fn else 0.5)
    err = (qr.codes.float() * qr.scales - ref.float()).abs()
    assert (err <= half_step + TOL[dtype] * (1 + ref.float().abs())).all()


@pytest.mark.parametrize("quant,qmin", [(torch.float8_e4m3fn, -127), (torch.int8, -127), (torch.int8, -128)],
                         ids=["fp8", "int8", "int8-128"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_static_codes_equal_quantize_rows_static_of_the_norm(quant, qmin, residual, dtype):
    """quantize_to with input_scale (a linear's calibrated scale): the codes are exactly quantize_rows_static of the
    kernel's own normed rows at that scale, values past the scale's range clamped, the rows' scales are the input
    scale, and the new residual is unchanged."""
    from kernels.w8a8_gemm import QuantizedRows, quantize_rows_static

    x, res = _randn(5, 200, dtype=dtype, seed=34, scale=3.0), _randn(5, 200, dtype=dtype, seed=35)
    weight = _randn(200, dtype=dtype, seed=36, shift=1.0)
    # a scale below the rows' largest values: some codes clamp at the range's ends (+-448, qmin / 127)
    input_scale = torch.tensor([1.7 / (448.0 if quant == torch.float8_e4m3fn else 127.0)])
    if residual:
        (qr, total), (normed, total2) = (
            fused_add_rms_norm(x, res, weight, 1e-6, quantize_to=quant, input_scale=input_scale, act_qmin=qmin),
            fused_add_rms_norm(x, res, weight, 1e-6))
        torch.testing.assert_close(total, total2, rtol=0, atol=0)
    else:
        qr = rms_norm(x, weight, 1e-6, quantize_to=quant, input_scale=input_scale, act_qmin=qmin)
        normed = rms_norm(x, weight, 1e-6)
    assert isinstance(qr, QuantizedRows) and qr.codes.dtype == quant and qr.shape == (5, 200)
    codes, scales = quantize_rows_static(normed, input_scale, quant, act_qmin=qmin)
    assert torch.equal(qr.scales, scales) and qr.scales.shape == (5, 1)
    assert torch.equal(qr.codes.view(torch.uint8), codes.view(torch.uint8))
    top = 448.0 if quant == torch.float8_e4m3fn else 127.0
    assert (qr.codes.float().abs() == top).any() and (qr.codes.float().abs() < top).any()  # clamped and not
    with pytest.raises(ValueError, match="input_scale"):
        rms_norm(x, weight, 1e-6, quantize_to=quant, input_scale=torch.ones(2))


def test_norm_quantized_out_refuses_what_it_cannot_quantize():
    x = _randn(2, 64, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="quantize_to"):
        rms_norm(x, None, 1e-6, quantize_to=torch.float16)
    with pytest.raises(ValueError, match="quantize_to"):
        rms_norm(x, _randn(64, dtype=torch.float32, seed=2), 1e-6, weight_offset=1.0, quantize_to=torch.int8)
    with pytest.raises(ValueError, match="quantize_to"):
        rms_norm(x, _randn(64, dtype=torch.bfloat16, seed=2), 1e-6, quantize_to=torch.int8)


@pytest.mark.parametrize("hidden", [96, 200, 64])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(hidden, weight_offset, dtype):
    x = _randn(7, hidden, dtype=dtype, seed=hidden, scale=3.0, shift=0.5)
    weight = _randn(hidden, dtype=dtype, seed=1, scale=0.2, shift=0.0 if weight_offset else 1.0)
    _assert_close(rms_norm(x, weight, 1e-6, weight_offset), ref_rms_norm(x, weight, 1e-6, weight_offset))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_and_without_weight(dtype):
    x = _randn(5, 4 * 24, dtype=dtype, seed=2, scale=2.0)
    weight = _randn(24, dtype=dtype, seed=3, scale=0.2, shift=1.0)
    _assert_close(rms_norm(x, weight, 1e-5, head_dim=24), ref_rms_norm(x, weight, 1e-5, head_dim=24))
    _assert_close(rms_norm(x, None, 1e-5), ref_rms_norm(x, None, 1e-5))


def test_rms_norm_strided_rows():
    qkv = _randn(6, 96 + 64, dtype=torch.float32, seed=4)
    k = qkv[:, 96:]  # a split of a merged projection: row stride 160
    weight = _randn(64, dtype=torch.float32, seed=5, shift=1.0)
    _assert_close(rms_norm(k, weight, 1e-6), ref_rms_norm(k, weight, 1e-6))


@pytest.mark.parametrize("hidden", [96, 200, 64])
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(hidden, affine, dtype):
    """LayerNorm with a gain and bias (GPT-2, Phi-2, ...), a gain only (Cohere) or neither (OLMo), on rows far from
    centred: the reference's fp32 statistics and one rounding."""
    x = _randn(7, hidden, dtype=dtype, seed=hidden + 3, scale=3.0, shift=2.5)
    weight = _randn(hidden, dtype=dtype, seed=8, scale=0.2, shift=1.0) if affine != "none" else None
    bias = _randn(hidden, dtype=dtype, seed=9, scale=0.5) if affine == "weight_bias" else None
    out = layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == x.dtype
    _assert_close(out, ref_layer_norm(x, weight, bias, 1e-5))
    k = _randn(6, hidden + 32, dtype=dtype, seed=10)[:, 32:]  # strided rows (a split of a merged projection)
    _assert_close(layer_norm(k, weight, bias, 1e-5), ref_layer_norm(k, weight, bias, 1e-5))
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, weight, torch.zeros(hidden + 1, dtype=dtype), 1e-5)


@pytest.mark.parametrize("hidden", [96, 200])
@pytest.mark.parametrize("affine", ["weight_bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_layer_norm(hidden, affine, dtype):
    """The residual add and the LayerNorm of its sum in one kernel: the sum as torch adds it, the norm of it."""
    x = _randn(9, hidden, dtype=dtype, seed=hidden + 11, scale=2.0)
    residual = _randn(9, hidden, dtype=dtype, seed=hidden + 12, scale=4.0, shift=1.5)
    weight = _randn(hidden, dtype=dtype, seed=13, scale=0.2, shift=1.0) if affine != "none" else None
    bias = _randn(hidden, dtype=dtype, seed=14, scale=0.5) if affine != "none" else None
    normed, total = fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    ref_normed, ref_total = ref_fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(total, ref_total)
    else:
        _assert_close(total, ref_total)  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
    _assert_close(normed, ref_normed)
    with pytest.raises(ValueError, match="differ in shape"):
        fused_add_layer_norm(x, residual[:, 1:], weight, bias, 1e-5)


@pytest.mark.parametrize("hidden", [96, 200])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(hidden, weight_offset, dtype):
    x = _randn(9, hidden, dtype=dtype, seed=hidden + 1, scale=2.0)
    residual = _randn(9, hidden, dtype=dtype, seed=hidden + 2, scale=4.0, shift=-0.3)
    weight = _randn(hidden, dtype=dtype, seed=6, scale=0.2, shift=0.0 if weight_offset else 1.0)
    normed, total = fused_add_rms_norm(x, residual, weight, 1e-6, weight_offset)
    ref_normed, ref_total = ref_fused_add_rms_norm(x, residual, weight, 1e-6, weight_offset)
    if dtype == torch.float32:
        assert torch.equal(total, ref_total)  # the new residual is x + residual, as torch computes it
    else:
        _assert_close(total, ref_total)  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
    _assert_close(normed, ref_normed)
    assert not torch.equal(normed, total)  # the outputs are not swapped


# --- rope -------------------------------------------------------------------------------------------
def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


POSITIONS = [0, 1, 2, 17, 130, 1023, 4097, 5000, 32767]


@pytest.mark.parametrize("num_heads,head_dim,theta,scaling", [(2, 32, 10000.0, 1.0), (8, 64, 500000.0, 1.0),
                                                              (8, 32, 10000.0, 0.75), (2, 64, 1e6, 1.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place(num_heads, head_dim, theta, scaling, dtype):
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    x = _randn(len(POSITIONS), num_heads * head_dim, dtype=dtype, seed=num_heads + head_dim)
    inv_freq = _inv_freq(head_dim, theta)
    expected = ref_rope(x, positions, inv_freq, num_heads, head_dim, scaling)
    before = x.clone()
    out = apply_rope_(x, positions, inv_freq, num_heads, head_dim, scaling)
    assert out.data_ptr() == x.data_ptr()
    assert not torch.equal(x[1:], before[1:])  # written in place (position 0 is the identity at scaling 1)
    _assert_close(x, expected)


def test_rope_on_a_split_view_leaves_the_rest():
    num_heads, head_dim = 2, 32
    qkv = _randn(5, 3 * num_heads * head_dim, dtype=torch.float32, seed=7)
    positions = torch.tensor([3, 4, 5, 6000, 7000])
    inv_freq = _inv_freq(head_dim, 10000.0)
    k = qkv[:, num_heads * head_dim: 2 * num_heads * head_dim]  # row stride 3 * 64
    expected = ref_rope(k, positions, inv_freq, num_heads, head_dim)
    before = qkv.clone()
    apply_rope_(k, positions, inv_freq, num_heads, head_dim)
    _assert_close(qkv[:, num_heads * head_dim: 2 * num_heads * head_dim], expected)
    assert torch.equal(qkv[:, : num_heads * head_dim], before[:, : num_heads * head_dim])
    assert torch.equal(qkv[:, 2 * num_heads * head_dim:], before[:, 2 * num_heads * head_dim:])


@pytest.mark.parametrize("head_dim,rotary_dim,interleaved", [(32, 8, False), (64, 32, False), (32, 32, True),
                                                             (64, 16, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_partial_and_interleaved(head_dim, rotary_dim, interleaved, dtype):
    """Rotary on the first rotary_dim features of each head (StableLM, Phi-2, GPT-NeoX), the rest untouched, and the
    interleaved (GPT-J) pairs (Cohere): the torch reference's results, in place."""
    num_heads = 3
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    x = _randn(len(POSITIONS), num_heads * head_dim, dtype=dtype, seed=head_dim + rotary_dim + interleaved)
    inv_freq = _inv_freq(rotary_dim, 10000.0)
    expected = ref_rope(x, positions, inv_freq, num_heads, head_dim, 1.0, rotary_dim, interleaved)
    before = x.clone().view(len(POSITIONS), num_heads, head_dim)
    apply_rope_(x, positions, inv_freq, num_heads, head_dim, 1.0, rotary_dim, interleaved)
    _assert_close(x, expected)
    heads = x.view(len(POSITIONS), num_heads, head_dim)
    assert torch.equal(heads[..., rotary_dim:], before[..., rotary_dim:])  # passed through, bit for bit
    assert not torch.equal(heads[1:, :, :rotary_dim], before[1:, :, :rotary_dim])


@pytest.mark.parametrize("rotary_dim, interleaved", [(32, False), (16, False), (32, True)])
def test_rope_two_tables_by_offset_positions(rotary_dim, interleaved):
    """LongRoPE: inv_freq [2, rotary_dim / 2] and long_from; a position p + long_from rotates as the second table alone
    does at p, a position below long_from as the first alone does (bit for bit), and both match the torch
    reference."""
    num_heads, head_dim, long_from = 3, 32, 1 << 24
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    long = torch.arange(len(POSITIONS)) % 2 == 1
    offset = torch.where(long, positions + long_from, positions)
    x = _randn(len(POSITIONS), num_heads * head_dim, dtype=torch.float32, seed=rotary_dim + interleaved)
    short = _inv_freq(rotary_dim, 10000.0)
    tables = torch.stack([short, short / torch.linspace(1.0, 8.0, rotary_dim // 2)])
    args = (num_heads, head_dim, 1.19, rotary_dim, interleaved)
    out = apply_rope_(x.clone(), offset, tables, *args, long_from)
    _assert_close(out, ref_rope(x, offset, tables, *args, long_from))
    assert torch.equal(out[~long], apply_rope_(x.clone(), positions, short, *args)[~long])
    assert torch.equal(out[long], apply_rope_(x.clone(), positions, tables[1], *args)[long])
    with pytest.raises(ValueError, match=rf"\[2, {rotary_dim // 2}\] \(two tables\) with long_from >= 0"):
        apply_rope_(x.clone(), positions, tables, *args)  # two tables without long_from
    with pytest.raises(ValueError, match="two frequency tables"):
        ref_rope(x, positions, tables, *args)


def test_rope_rejects_bad_shapes():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        apply_rope_(x, torch.arange(3), _inv_freq(32, 1e4), 3, 32)
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope_(x, torch.arange(3), _inv_freq(64, 1e4), 2, 32)
    with pytest.raises(ValueError, match="inv_freq"):  # partial rotary: rotary_dim / 2 frequencies
        apply_rope_(x, torch.arange(3), _inv_freq(32, 1e4), 2, 32, rotary_dim=16)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope_(x, torch.arange(3), _inv_freq(40, 1e4), 2, 32, rotary_dim=40)


# --- silu_mul ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("intermediate", [96, 200, 1500])  # 1500: more than one column block
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(intermediate, dtype):
    gate_up = _randn(4, 2 * intermediate, dtype=dtype, seed=intermediate, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -20.0, 30.0], dtype=dtype)  # saturated sigmoid
    _assert_close(silu_mul(gate_up), ref_silu_mul(gate_up))


@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_quantized_out_equals_quantize_rows_of_it(quant, dtype):
    """quantize_to: the codes and scales are exactly quantize_rows of the kernel's own silu(gate) * up rows."""
    from kernels.w8a8_gemm import QuantizedRows, quantize_rows

    gate_up = _randn(6, 2 * 300, dtype=dtype, seed=41, scale=2.0)
    qr = silu_mul(gate_up, quantize_to=quant)
    assert isinstance(qr, QuantizedRows) and qr.shape == (6, 300)
    codes, scales = quantize_rows(silu_mul(gate_up), quant)
    torch.testing.assert_close(qr.scales, scales, rtol=0, atol=0)
    assert torch.equal(qr.codes.view(torch.uint8), codes.view(torch.uint8))
    with pytest.raises(ValueError, match="quantize_to"):
        silu_mul(gate_up, quantize_to=torch.float16)


@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_static_codes_equal_quantize_rows_static_of_it(quant, dtype):
    """quantize_to with input_scale: exactly quantize_rows_static of the kernel's own silu(gate) * up rows at that
    scale (1,536 columns: two column blocks of the elementwise grid), the rows' scales the input scale."""
    from kernels.w8a8_gemm import QuantizedRows, quantize_rows_static

    gate_up = _randn(3, 2 * 1536, dtype=dtype, seed=42, scale=3.0)
    input_scale = torch.tensor([2.5 / (448.0 if quant == torch.float8_e4m3fn else 127.0)])
    qr = silu_mul(gate_up, quantize_to=quant, input_scale=input_scale)
    assert isinstance(qr, QuantizedRows) and qr.shape == (3, 1536)
    codes, scales = quantize_rows_static(silu_mul(gate_up), input_scale, quant)
    assert torch.equal(qr.scales, scales)
    assert torch.equal(qr.codes.view(torch.uint8), codes.view(torch.uint8))
    top = 448.0 if quant == torch.float8_e4m3fn else 127.0
    assert (qr.codes.float().abs() == top).any() and (qr.codes.float() != 0).sum() > 1000
    with pytest.raises(ValueError, match="input_scale"):
        silu_mul(gate_up, quantize_to=quant, input_scale=torch.ones(3))


def test_silu_mul_separate_gate_and_up():
    gate = _randn(3, 200, dtype=torch.bfloat16, seed=8, scale=3.0)
    up = _randn(3, 200, dtype=torch.bfloat16, seed=9)
    out = silu_mul(gate, up)
    _assert_close(out, ref_silu_mul(gate, up))
    assert not torch.allclose(out.float(), ref_silu_mul(up, gate).float(), atol=1e-2)  # gate is the first


@pytest.mark.parametrize("intermediate,tile", [(96, 16), (1536, 16), (64, 8)])  # 1536: several column blocks
def test_silu_mul_tiles_reads_the_interleaved_rows(intermediate, tile):
    """silu_mul_tiles of a row interleaved per tile (gate tile, its up tile, ...) equals silu_mul of the same row
    in [gate | up] order, bit for bit (the same values through the same arithmetic)."""
    gate_up = _randn(3, 2 * intermediate, dtype=torch.bfloat16, seed=intermediate, scale=3.0)
    tiles = gate_up.reshape(3, 2, intermediate // tile, tile).transpose(1, 2).reshape(3, 2 * intermediate)
    assert torch.equal(silu_mul_tiles(tiles, tile), silu_mul(gate_up))
    with pytest.raises(ValueError, match="whole pairs"):
        silu_mul_tiles(gate_up[:, :-tile], tile)



@pytest.mark.parametrize("chunk", [32, 128])
@pytest.mark.parametrize("quant", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_silu_mul_quantized_in_two_passes_equals_one(chunk, quant, monkeypatch):
    """KERNELS_SILU_QUANT_CHUNK: the two-pass kernel (the row's max over chunks, then its codes) gives the one-pass
    kernel's scales and codes bit for bit, rows of several chunks and a partial last one included."""
    gate_up = _randn(5, 2 * 300, dtype=torch.bfloat16, seed=43, scale=3.0)
    gate_up[2, 290] = 40.0  # the row's max in its last, partial chunk
    one = silu_mul(gate_up, quantize_to=quant)
    monkeypatch.setenv("KERNELS_SILU_QUANT_CHUNK", str(chunk))
    two = silu_mul(gate_up, quantize_to=quant)
    torch.testing.assert_close(two.scales, one.scales, rtol=0, atol=0)
    assert torch.equal(two.codes.view(torch.uint8), one.codes.view(torch.uint8))
    monkeypatch.setenv("KERNELS_SILU_QUANT_CHUNK", "100")
    with pytest.raises(ValueError, match="KERNELS_SILU_QUANT_CHUNK"):
        silu_mul(gate_up, quantize_to=quant)

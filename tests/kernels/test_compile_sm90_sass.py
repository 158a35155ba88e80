"""kernels.bench.compile_sm90 --sass: the loop opcode counts read off nvdisasm's text; and with them the fused MoE's
W4A16 K loop against the bf16 experts' one, compiled for sm_90 (no GPU: Triton's own ptxas and nvdisasm).

NOTE: triton is imported in the tests, not at collection: the kernels' test modules set TRITON_INTERPRET=1 before
they first import it, and triton.language's own helpers are interpreted only if it is first imported after that.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R12, R8 ;
        /*0030*/              @!P0 LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R4, R14, R8 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   STG.E desc[UR4][R2.64], R8 ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   EXIT ;
"""


def test_counts_the_opcodes_of_each_backward_branch_only():
    from kernels.bench.compile_sm90 import _loop_opcodes

    loops = _loop_opcodes(SASS)
    assert len(loops) == 1, "the forward branch to .L_x_3 is not a loop"
    assert loops[0] == {"LDG": 1, "HMMA": 2, "LOP3": 1, "BRA": 1}


def _sass_dir(tmp_path_factory, *only: str, exact: bool = False) -> str:
    """``compile_sm90 --sass DIR --only ONLY... [--exact]`` in a process of its own (in this one a test module that
    set TRITON_INTERPRET=1 before importing the kernels made them the interpreter's functions); returns DIR."""
    from kernels.bench.compile_sm90 import _binary

    if not os.path.exists(_binary("nvdisasm")):
        pytest.skip("no nvdisasm beside Triton's ptxas")
    out = str(tmp_path_factory.mktemp("sass"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.compile_sm90", "--sass", out, "--only", *only,
                           *(["--exact"] if exact else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def moe_sass(tmp_path_factory) -> str:
    """The fused MoE variants of ``compile_sm90 --sass``."""
    return _sass_dir(tmp_path_factory, "fused MoE")


def _k_loop(sass_dir: str, name: str) -> collections.Counter:
    from kernels.bench.compile_sm90 import _loop_opcodes, dump_stem

    with open(dump_stem(sass_dir, name) + ".sass") as f:
        loops = [ops for ops in _loop_opcodes(f.read()) if sum(ops.values()) > 1]
    assert len(loops) == 1, f"{name}: {len(loops)} loops; expected the K loop alone"
    return loops[0]


# codes per thread and K step at compile_sm90's MoE tiles (BLOCK_N 64, BLOCK_K 128, 4 warps); the up GEMM has two
# weight tiles (gate and up)
W4A16_CODES_PER_THREAD = {"up": 2 * 64 * 128 // 128, "down": 64 * 128 // 128}
# the W4A16 K step's instructions over the bf16 experts' (Triton 3.9: up 400 / 155, down 251 / 113; Triton 3.6: 508 /
# 150 and 297 / 110); the per-code fp32 dequantization the kernels had before took 1,701 and 843 (11.0x, 7.5x)
MAX_W4A16_OVER_BF16 = 3.5


@pytest.mark.parametrize("gemm", ["up", "down"])
def test_moe_w4a16_k_loop(moe_sass, gemm):
    """The W4A16 experts' K step at the bf16 experts' tiles: the same MMAs, one packed bf16 add (minus 128 + zero)
    per two codes, no code converted to float or rounded one at a time, at most MAX_W4A16_OVER_BF16 times the
    instructions."""
    bf16 = _k_loop(moe_sass, f"fused MoE {gemm} GEMM, bf16 experts")
    int4 = _k_loop(moe_sass, f"fused MoE {gemm} GEMM, W4A16 experts, groups of 128")
    assert int4["HMMA"] == bf16["HMMA"]
    assert int4["HADD2"] + int4["HFMA2"] == W4A16_CODES_PER_THREAD[gemm] // 2, int4
    assert not [op for op in ("I2F", "I2FP", "F2FP", "FMUL", "FADD") if int4[op]], int4
    ratio = sum(int4.values()) / sum(bf16.values())
    assert ratio <= MAX_W4A16_OVER_BF16, f"{sum(int4.values())} instructions per K step, {ratio:.2f}x the bf16 loop's"


def test_layer_norm_rope_partial_rotary_attention_and_silu_quant_compile_for_sm90():
    """The LayerNorm (with and without the residual add), RoPE (partial, interleaved), partial / interleaved rotary
    attention and quantized SiLU-mul (one pass, two passes) variants compile for sm_90 with Triton's own ptxas (the
    interpreter accepts code compiled Triton refuses), in a process of its own (see ``moe_sass``)."""
    from kernels.bench.compile_sm90 import _binary

    if not os.path.exists(_binary("ptxas")):
        pytest.skip("no ptxas beside Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    only = ["partial RoPE", "interleaved RoPE", "rope + KV write", "layer_norm", "rope, head_dim", "silu_mul quantized"]
    proc = subprocess.run([sys.executable, "-m", "kernels.bench.compile_sm90", "--only", *only], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    # 2 attention, 7 rope + KV write (3 into an FP8 cache, one of them q into a copy; 1 into an INT8 one), 4 LayerNorm,
    # 4 RoPE, 2 quantized SiLU-mul variants
    assert len(compiled) == 19, proc.stdout


@pytest.fixture(scope="module")
def decode_sass(tmp_path_factory) -> str:
    """The FP8-cache decode attention variants of ``compile_sm90 --sass``."""
    return _sass_dir(tmp_path_factory, "paged decode attention, fp8 cache")


def _key_loop(sass_dir: str, name: str) -> collections.Counter:
    """The largest loop of variant ``name``: the decode attention's loop over key tiles (the other is the merge's)."""
    from kernels.bench.compile_sm90 import _loop_opcodes, dump_stem

    with open(dump_stem(sass_dir, name) + ".sass") as f:
        return max(_loop_opcodes(f.read()), key=lambda ops: sum(ops.values()))


def test_fp8_decode_attention_key_loop(decode_sass):
    """Per 64-key tile of an FP8 cache: the value tile is neither selected nor repacked element by element (its
    masked rows are zero-filled by the load; pairs convert in one instruction each: 64 F2FP for 8 KB of keys and
    values over 128 threads, and 4 more for the probabilities), and with 64-token blocks the tile's keys come from
    one block id (one load) and one base address. On sm_90 the loop had 792 instructions (SEL 72, PRMT 75, 8 block-id
    loads) before; 520 after, 409-415 with 64-token blocks (Triton 3.6 / 3.9)."""
    plain = _key_loop(decode_sass, "paged decode attention, fp8 cache")
    whole = _key_loop(decode_sass, "paged decode attention, fp8 cache, 64-token blocks")
    for loop in (plain, whole):
        assert loop["PRMT"] == 0 and loop["SEL"] <= 16 and loop["F2FP"] == 68, loop
    assert whole["LDG"] == 1 and plain["LDG"] > 1, (whole, plain)
    assert sum(whole.values()) <= 0.85 * sum(plain.values()) and sum(plain.values()) <= 600, (whole, plain)


@pytest.fixture(scope="module")
def prefill_sass(tmp_path_factory) -> str:
    """The two FP8-cache prefill attention variants the test reads, of ``compile_sm90 --sass``."""
    return _sass_dir(tmp_path_factory, "paged prefill attention, fp8 cache",
                     "paged prefill attention, fp8 cache, 64-token blocks", exact=True)


def test_fp8_prefill_attention_key_loops(prefill_sass):
    """The prefill attention's three key loops (masked, unmasked, masked) over an FP8 cache: the masked tiles' values
    are zero-filled by their load and convert by pairs (no per-element select and repack: SEL 80 and PRMT 88 before,
    session 41), and with 64-token blocks a key tile's keys and values come from one block id and one base (the
    unmasked loop 557 -> 459 instructions with Triton 3.6, 549 -> 480 with 3.9)."""
    from kernels.bench.compile_sm90 import _loop_opcodes, dump_stem

    def loops(name: str) -> list[collections.Counter]:
        with open(dump_stem(prefill_sass, name) + ".sass") as f:
            return [ops for ops in _loop_opcodes(f.read()) if sum(ops.values()) > 100]

    plain = loops("paged prefill attention, fp8 cache")
    whole = loops("paged prefill attention, fp8 cache, 64-token blocks")
    assert len(plain) == len(whole) == 3, (plain, whole)
    for loop in plain + whole:
        assert loop["PRMT"] == 0 and loop["SEL"] <= 16 and loop["F2FP"] == 80, loop
    unmasked = [min(ls, key=lambda ops: sum(ops.values())) for ls in (plain, whole)]
    assert sum(unmasked[1].values()) <= 0.9 * sum(unmasked[0].values()), unmasked
    assert unmasked[1]["LDGSTS"] < unmasked[0]["LDGSTS"], unmasked  # one block id a tile, not one a key row


@pytest.fixture(scope="module")
def w4a8_sass(tmp_path_factory) -> str:
    """The W4A8 GEMM's 128 x 128 variants of ``compile_sm90 --sass`` (plain Triton codes and inline PTX)."""
    return _sass_dir(tmp_path_factory, "W4A8 GEMM, groups, 128 x 128")


def test_w4a8_k_loop_runs_the_e4m3_mma_on_codes_formed_in_registers(w4a8_sass):
    """frag_mm_fp8's K step at 128 features x 128 rows on 8 warps: four e4m3 wgmmas (m64n128k32, the weights as the
    register operand), no shared-memory store of the code tile (the reshape lands on the MMA's fragment layout),
    one fp32 FMA per accumulator element for the group's scale (64 a thread); the inline PTX makes each code less its
    zero point two at a time (one packed fp16 op per two codes: 32 a thread) in fewer instructions than the plain
    Triton form (283 against 406 with Triton 3.9, 275 against 401 with 3.6)."""
    plain = _k_loop(w4a8_sass, "frag_mm_fp8 W4A8 GEMM, groups, 128 x 128, 8 warps")
    asm = _k_loop(w4a8_sass, "frag_mm_fp8 W4A8 GEMM, groups, 128 x 128, 8 warps, asm")
    for ops in (plain, asm):
        assert ops["QGMMA"] == 4 and not ops["STS"] and not ops["STSM"] and not ops["HGMMA"], ops
    assert asm["HADD2"] + asm["HFMA2"] == 32 and asm["FFMA"] == 64 and not asm["I2F"], asm
    assert sum(asm.values()) < sum(plain.values()), (sum(asm.values()), sum(plain.values()))

"""Programmatic dependent launch (PDL, Hopper and later) and L2 prefetch of weights for the decode kernels.

A decode step at small batch is a chain of short kernels (per Llama layer: norm, QKV, RoPE, KV write, attention,
output projection, norm, gate/up, SwiGLU, down), each of which waits for the last one's final block to finish,
then for its own launch and ramp-up. Launched with PDL (``launch_pdl=True``, cudaLaunchAttributeProgrammatic-
StreamSerialization; CUDA graphs capture it as a programmatic edge) a kernel's blocks may start while its
predecessor still runs, and each program first executes ``griddepcontrol.wait`` (:func:`wait_prior`), which returns
once the predecessor has completed and its memory is visible. So the launch and the block scheduling overlap the
predecessor's tail, and nothing a program does before the wait may read what the predecessor writes or write what
it reads.

What a weight-reading kernel may do before the wait is read its weights: they are constants of the model.
:func:`prefetch_l2` asks the L2 for a program's first weight bytes (``prefetch.global.L2``, no registers, no
result), so a linear behind a norm, RoPE or attention kernel (which leave the HBM mostly idle) starts with its
first K steps already on chip.

Correctness rests on two rules, kept by every kernel that takes ``PDL``:
- every program executes :func:`wait_prior` (then ``griddepcontrol.launch_dependents``) on every path, before its
  first read of an activation and its first store: a kernel's completion then implies its predecessors', so
  ordering stays transitive along the chain. (The decode attention's splits past a short sequence's keys exit
  without reading or storing anything; its split 0 always waits, which keeps the chain.) What a kernel reads
  before the wait must not be written by the kernel launched just before it;
- only :func:`launch_kwargs` turns the launch attribute on (CUDA, compute capability 9.0+, ``KERNELS_PDL`` not 0),
  and ``PDL`` is passed as ``bool(launch_kwargs(t))``: the wait is compiled in exactly when the launch overlaps.

Kernels that precede a PDL kernel need not know about it: without an explicit trigger their dependents start when
their blocks exit. Under TRITON_INTERPRET nothing here runs (``PDL`` False).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("KERNELS_PDL", "1") != "0"  # KERNELS_PDL=0: every kernel waits for its predecessor
PREFETCH = os.environ.get("KERNELS_PREFETCH", "1") != "0"  # KERNELS_PREFETCH=0: no L2 prefetch before the wait
LINE = 128  # bytes per L2 prefetch request (the L2's line)
# per program, KERNELS_PREFETCH_KB (default 32 KB, 256 lines; rounded down to a power of 2): a full wave of 528
# programs asks for ~17 MB of the 50 MB L2
_KB = os.environ.get("KERNELS_PREFETCH_KB", "32")
if not _KB.isdigit():
    raise ValueError(f"KERNELS_PREFETCH_KB={_KB!r} is not a whole number of kilobytes (e.g. 32)")
MAX_PREFETCH_LINES = 1 << (max(int(_KB) * 1024 // LINE, 1).bit_length() - 1)
# Range prefetch: a GEMV program asks the L2 before the wait for its whole K range (every step's weights, up to a
# budget per program, rounded down to a power of 2 of lines per row), not only its first step's tile, so that a
# linear behind a kernel that leaves the HBM idle (the attention) streams its weights during it. Measured on the
# H200 at batch 1 (docs/BENCHMARKS.md, session 55): the int4 o_proj (8.4 MB, behind the attention) gains (AWQ decode
# 452.4 -> 458.5 / 459.3 tok/s), but every larger linear loses (int4 with every linear: 399; bf16 with o_proj,
# 33.5 MB: 243.9 -> 241.0; with qkv too: 234.3; int8 weight-only's o_proj, 16.8 MB: 353.9 -> 351.9), and so did the
# bf16 o_proj's first 32 MB asked for by the attention's idle splits instead (241.3 -> 235.7, not kept). Why was not
# measured apart (perhaps the issue loop at the HBM's rate delaying the asking kernel, or lines evicted before use).
# So a shape table entry turns it on (``kernels.w4a16_frag``: FragConfig.prefetch_range), at RANGE_DEFAULT_KB a
# program.
RANGE_DEFAULT_KB = 128
# KERNELS_PREFETCH_RANGE_KB (A/B runs; default 0): every GEMV (frag, dense, W8A8) prefetches its range, with this
# budget per program (also the budget of the table's entries when set); KERNELS_PREFETCH_RANGE_MAX_MB (default 0: no
# limit) keeps that to linears of at most this many MB of weights
_RANGE_KB = os.environ.get("KERNELS_PREFETCH_RANGE_KB", "0")
if not _RANGE_KB.isdigit():
    raise ValueError(f"KERNELS_PREFETCH_RANGE_KB={_RANGE_KB!r} is not a whole number of kilobytes (e.g. 256)")
RANGE_LINES = int(_RANGE_KB) * 1024 // LINE if PREFETCH else 0
_RANGE_MAX_MB = os.environ.get("KERNELS_PREFETCH_RANGE_MAX_MB", "0")
if not _RANGE_MAX_MB.isdigit():
    raise ValueError(f"KERNELS_PREFETCH_RANGE_MAX_MB={_RANGE_MAX_MB!r} is not a whole number of megabytes (e.g. 16)")
RANGE_MAX_BYTES = int(_RANGE_MAX_MB) << 20


def range_applies(weight_bytes: int) -> bool:
    """Whether KERNELS_PREFETCH_RANGE_KB asks a linear of ``weight_bytes`` bytes of weights to prefetch its programs'
    whole ranges."""
    return bool(RANGE_LINES) and (not RANGE_MAX_BYTES or weight_bytes <= RANGE_MAX_BYTES)


@functools.cache
def _supported(device_index: int) -> bool:
    """Compute capability 9.0+ and a Triton that has both the launch option and the wait."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (torch.cuda.get_device_capability(device_index) >= (9, 0) and hasattr(tl.extra.cuda, "gdc_wait")
            and "launch_pdl" in CUDAOptions.__dataclass_fields__)


def launch_kwargs(t: torch.Tensor) -> dict[str, bool]:
    """``{"launch_pdl": True}`` for a kernel whose tensors live on ``t``'s device when PDL applies there, else
    ``{}``; pass ``PDL=bool(kwargs)`` to the kernel with it."""
    if not ENABLED or not t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return {}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return {"launch_pdl": True} if _supported(index) else {}


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """The keyword arguments of a launch of a kernel taking ``PDL``: the constexpr and the launch attribute."""
    launch = launch_kwargs(t)
    return {"PDL": bool(launch), **launch}


def prefetch_lines(nbytes: int) -> int:
    """The power-of-2 count of L2 lines :func:`prefetch_l2` covers for a program that reads ``nbytes`` of
    contiguous weights (at most MAX_PREFETCH_LINES)."""
    return min(triton.next_power_of_2(max(triton.cdiv(nbytes, LINE), 1)), MAX_PREFETCH_LINES)


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """With PDL: wait until the preceding kernel has completed (its stores visible), then let the next kernel
    launch. Without: nothing (the stream already ordered this launch after the last one)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch(ptrs):
    """``prefetch.global.L2`` for each address of ``ptrs`` (no result, no registers held)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(base, nbytes, LINES: tl.constexpr):
    """Ask the L2 for the first ``LINES`` 128-byte lines of the ``nbytes`` contiguous bytes at ``base`` (uint8
    pointer; lines past the range are clamped onto its last byte). No result, no registers held."""
    _prefetch(base + tl.minimum(tl.arange(0, LINES) * 128, nbytes - 1))


@triton.jit
def prefetch_l2_rows(base, row_stride, num_rows, row_elems, ROWS: tl.constexpr, LINES_PER_ROW: tl.constexpr,
                     ELEMS_PER_LINE: tl.constexpr):
    """Ask the L2 for the first ``LINES_PER_ROW`` 128-byte lines of each of the first ``ROWS`` rows of a row-major
    tile at ``base`` (element pointer; ``row_stride`` elements apart, ``row_elems`` elements per row, ``num_rows``
    rows, offsets past them clamped onto the last). For weights whose program tile is not one contiguous block."""
    rows = tl.minimum(tl.arange(0, ROWS), num_rows - 1)
    cols = tl.minimum(tl.arange(0, LINES_PER_ROW) * ELEMS_PER_LINE, row_elems - 1)
    _prefetch(base + rows[:, None] * row_stride + cols[None, :])


def prefetch_rows_plan(block_rows: int, row_bytes: int, range_bytes: int = 0) -> tuple[int, int]:
    """(ROWS, LINES_PER_ROW) for :func:`prefetch_l2_rows` over a program's first [block_rows, row_bytes] tile: whole
    rows' lines, at most MAX_PREFETCH_LINES in all; ROWS 0 (nothing asked) when KERNELS_PREFETCH=0. With
    KERNELS_PREFETCH_RANGE_KB and ``range_bytes`` (the bytes of each row the program reads over all its K steps):
    all ``block_rows`` rows, as many lines of each as that budget allows (at least the first tile's)."""
    lines_per_row = max(1, min(triton.next_power_of_2(max(row_bytes // LINE, 1)), MAX_PREFETCH_LINES))
    rows = (min(block_rows, max(1, MAX_PREFETCH_LINES // lines_per_row)) if PREFETCH else 0)
    if RANGE_LINES and range_bytes > row_bytes and rows:
        wide = range_lines(range_bytes, block_rows)
        if block_rows * wide > rows * lines_per_row:
            return block_rows, wide
    return rows, lines_per_row


def range_lines(row_bytes: int, rows: int, asked: bool = False) -> int:
    """LINES_PER_ROW for :func:`prefetch_l2_rows` over ``rows`` rows of ``row_bytes`` bytes a program reads: the
    power of 2 that covers them, within the budget over all rows (KERNELS_PREFETCH_RANGE_KB, else RANGE_DEFAULT_KB
    where a shape table's entry ``asked`` for it); 0 when neither asks or KERNELS_PREFETCH=0."""
    budget = RANGE_LINES or (RANGE_DEFAULT_KB * 1024 // LINE if asked and PREFETCH else 0)
    if not budget or row_bytes <= 0:
        return 0
    return min(triton.next_power_of_2(triton.cdiv(row_bytes, LINE)), _floor_pow2(max(budget // rows, 1)))


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)

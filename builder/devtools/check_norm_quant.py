"""GPU check of the kernels that quantize the rows they make (``kernels.fused_norm`` and ``kernels.activation``'s
``quantize_to``): against ``quantize_rows`` of their unquantized rows and against the torch reference
(``quantize_activation_fp8``, run on the CPU: on CUDA torch divides by a scalar through its reciprocal, so its
scales are not the IEEE quotients the kernels take), at Llama-3-8B widths (4,096; the SwiGLU's 14,336) and 17, 512
and 8,192 rows, fresh random inputs: ``python -m builder.devtools.check_norm_quant``. Prints the codes that differ
and whether the scales (and the norm's new residual) are equal; exits 1 when a scale differs or more than one code
in a million does."""

from __future__ import annotations

import sys

import torch

from kernels.activation import silu_mul
from kernels.fused_norm import fused_add_rms_norm, rms_norm
from kernels.torch_quant import quantize_activation_fp8
from kernels.w8a8_gemm import quantize_rows

FP8 = torch.float8_e4m3fn


def _compare(name: str, rows: int, qr, plain: torch.Tensor) -> bool:
    ok = True
    for ref_name, (codes, scales) in (("quantize_rows", quantize_rows(plain, FP8)),
                                      ("torch reference (CPU)", quantize_activation_fp8(plain.cpu(), None))):
        diff = (qr.codes.view(torch.uint8).cpu() != codes.view(torch.uint8).cpu()).sum().item()
        same_scales = torch.equal(qr.scales.cpu(), scales.cpu())
        print(f"{name} rows {rows} vs {ref_name}: codes differing {diff} of {codes.numel()}, scales equal "
              f"{same_scales}")
        ok &= diff <= codes.numel() * 1e-6 and same_scales
    return ok


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for rows in (17, 512, 8192):
        x = (torch.randn(rows, 4096, device="cuda", generator=gen) * 3).bfloat16()
        r = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(4096, device="cuda", generator=gen) * 0.1 + 1).bfloat16()
        ok &= _compare("rms_norm", rows, rms_norm(x, w, 1e-5, quantize_to=FP8), rms_norm(x, w, 1e-5))
        (qr, total), (normed, total2) = (fused_add_rms_norm(x, r, w, 1e-5, quantize_to=FP8),
                                         fused_add_rms_norm(x, r, w, 1e-5))
        print(f"fused_add_rms_norm rows {rows}: residual equal {torch.equal(total, total2)}")
        ok &= torch.equal(total, total2) & _compare("fused_add_rms_norm", rows, qr, normed)
        gate_up = (torch.randn(rows, 2 * 14336, device="cuda", generator=gen) * 2).bfloat16()
        ok &= _compare("silu_mul", rows, silu_mul(gate_up, quantize_to=FP8), silu_mul(gate_up))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the norms that quantize their rows (``kernels.fused_norm``'s ``quantize_to``) against
``quantize_rows`` of the normed rows, at the Llama-3-8B width and 17, 512 and 8,192 rows, fresh random inputs:
``python -m builder.devtools.check_norm_quant``. Prints the codes that differ (the fast division may round a value
to its neighbouring code) and whether the scales and the new residual are equal; exits 1 on a larger mismatch."""

from __future__ import annotations

import sys

import torch

from kernels.fused_norm import fused_add_rms_norm, rms_norm
from kernels.w8a8_gemm import quantize_rows


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = False
    for rows in (17, 512, 8192):
        x = (torch.randn(rows, 4096, device="cuda", generator=gen) * 3).bfloat16()
        r = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(4096, device="cuda", generator=gen) * 0.1 + 1).bfloat16()
        for name in ("rms_norm", "fused_add_rms_norm"):
            if name == "rms_norm":
                qr, n, total_same = rms_norm(x, w, 1e-5, quantize_to=torch.float8_e4m3fn), rms_norm(x, w, 1e-5), True
            else:
                (qr, t), (n, t2) = (fused_add_rms_norm(x, r, w, 1e-5, quantize_to=torch.float8_e4m3fn),
                                    fused_add_rms_norm(x, r, w, 1e-5))
                total_same = torch.equal(t, t2)
            codes, scales = quantize_rows(n, torch.float8_e4m3fn)
            diff = (qr.codes.view(torch.uint8) != codes.view(torch.uint8)).sum().item()
            same_scales = torch.equal(qr.scales, scales)
            print(f"{name} rows {rows}: codes differing {diff} of {codes.numel()}, scales equal {same_scales}, "
                  f"residual equal {total_same}")
            bad |= diff > codes.numel() * 1e-4 or not same_scales or not total_same
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

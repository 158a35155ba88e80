"""Static SmoothQuant's clip choice (``static_scale``): "mse" takes the clip ratio of least output error on the
calibration rows; "auto" (default) the least clipping within one standard error of it (passes/smoothquant.py)."""

from __future__ import annotations

import torch

from passes.smoothquant import CLIP_RATIOS, SmoothQuant, within_standard_errors


def _method(static_scale: str) -> SmoothQuant:
    m = SmoothQuant()
    m.configure({"activations": "static", "static_scale": static_scale})
    return m


def _ratio(static_scale: str, x: torch.Tensor, w: torch.Tensor) -> float:
    m = _method(static_scale)
    scale = m._static_scale(x.abs().amax(), x, w)
    return float(scale) * 127 / float(x.abs().amax())


def test_within_standard_errors_is_a_paired_test():
    best = torch.ones(100)
    assert within_standard_errors(best, best, 1.0)  # a candidate is within any bound of itself
    assert not within_standard_errors(best + 0.1, best, 1.0)  # worse on every row: no spread, not within
    noisy = best + torch.linspace(-1.0, 1.1, 100)  # a total 5 worse, per-row spread ~0.6: SE ~6
    assert within_standard_errors(noisy, best, 1.0) and not within_standard_errors(noisy, best, 0.5)


def test_auto_clips_less_where_the_gain_rests_on_few_rows():
    """A heavy tail: most rows gain a little from a clip, the rows it clamps lose a lot. "mse" clips; "auto" takes a
    ratio at least as large, within one standard error of the least error."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    x[:24] *= torch.rand(24, 1, generator=gen) * 3 + 2  # 5% of rows 2-5x wider: the range's tail
    w = torch.randn(32, 64, generator=gen) / 8
    mse, auto = _ratio("mse", x, w), _ratio("auto", x, w)
    assert mse < 1.0
    assert auto > mse, (auto, mse)


def test_auto_still_clips_where_every_row_gains():
    """One value far outside every other row's range, over many rows: clipping it shortens every row's rounding step,
    a gain that outweighs the one clamped row by many standard errors, so "auto" clips too (if a little less)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8192, 64, generator=gen)
    x[7, 3] = 40.0  # 10x the next largest
    w = torch.randn(32, 64, generator=gen) / 8
    mse, auto = _ratio("mse", x, w), _ratio("auto", x, w)
    assert mse <= 0.3 + 1e-6 and mse <= auto < 0.6, (mse, auto)
    assert CLIP_RATIOS[0] == 1.0  # the candidates run from no clipping down


def test_static_scale_stays_on_the_calibration_device():
    """The input scale is made where the statistics are (a GPU calibration's device), beside the weights it scales:
    a later segment's calibration forward runs the quantized linear there (a CPU scale beside CUDA activations stopped
    a static build calibrated on the GPU). The meta device stands in for the GPU: a copy to the host fails there."""
    amax = torch.tensor(3.0, device="meta")
    assert _method("max")._static_scale(amax, None, None).device == amax.device

"""Static SmoothQuant on an outlier model: alpha searched per group, the down projection smoothed through the up
projection, the output projection through the v projection, and (without smoothing) static input scales clipped by
the calibration-error search, against naive static W8A8 and against each part left out.

The fixture is the bundled model (GQA, 6 query heads on 2 kv heads) with fixed-channel activation outliers where
large real models have them: on channels of the normed inputs of q/k/v and gate/up
(``conftest.make_outlier_variant``), of the down projection's input (the up projection's rows scaled up, the down
projection's columns down: the same function) and of the output projection's input (v rows up, o columns down)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from builder.gates import GateThresholds, compare
from builder.quality import GraphModel
from conftest import BUNDLED, hf_logits, make_outlier_variant, memo_logits, quantization_setup
from passes import PassContext, run_passes
from passes import smoothquant as sq


def make_down_outliers(path: Path, factor: float = 40.0, num_channels: int = 4, seed: int = 1) -> Path:
    """Scale a few intermediate channels of every up projection by ``factor`` and the matching down projection
    columns by 1 / factor: the same function, with outliers in the down projection's input."""
    tensors = load_file(path / "model.safetensors")
    layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    size = tensors["model.layers.0.mlp.up_proj.weight"].shape[0]
    channels = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:num_channels]
    for i in layers:
        tensors[f"model.layers.{i}.mlp.up_proj.weight"][channels] *= factor
        tensors[f"model.layers.{i}.mlp.down_proj.weight"][:, channels] /= factor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def make_v_outliers(path: Path, factor: float = 40.0, num_channels: int = 3, seed: int = 2) -> Path:
    """Scale a few rows (kv head g, d) of every v projection by ``factor`` and the output projection's columns of
    every query head of group g at d by 1 / factor: the same function (attention is linear in v), with outliers in
    the output projection's input that one scale per group can flatten."""
    import json

    config = json.loads((path / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    tensors = load_file(path / "model.safetensors")
    layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    rows = torch.randperm(kv * dim, generator=torch.Generator().manual_seed(seed))[:num_channels]
    group = heads // kv
    cols = torch.tensor([(int(r) // dim * group + j) * dim + int(r) % dim for r in rows for j in range(group)])
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.v_proj.weight"][rows] *= factor
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"][:, cols] /= factor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """16 calibration windows (with 8, alpha searched per group no longer beats 0.5 for every group: KL 2.62e-4
    vs 2.60e-4) and 1,275 eval positions (5 windows): the KL ratios the test checks are within 5% of those on
    2,295 positions (the closest, 0.5 for every group over alpha searched: 1.42 here, 1.34 there)."""
    path = make_v_outliers(make_down_outliers(make_outlier_variant(tmp_path_factory.mktemp("sq") / "ckpt")))
    graph, calib, eval_set = quantization_setup(path, 16, num_positions=1024)
    return path, graph, calib, eval_set, memo_logits(GraphModel(graph).logits)


def _kl(setup, **options) -> tuple[float, dict]:
    _, graph, calib, eval_set, reference = setup
    quantized, records = run_passes(graph.copy(), ["smoothquant", "dce"],
                                    PassContext(calibration=calib, options={"smoothquant": options}))
    report = compare(reference, GraphModel(quantized).logits, eval_set, GateThresholds())
    return report.metric("kl").value, records[0].details


def test_fixture_computes_the_bundled_function(setup):
    ids = torch.randint(7, 4096, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    assert (hf_logits(setup[0], ids) - hf_logits(BUNDLED, ids)).abs().max() < 1e-4


def test_static_smoothquant_beats_naive_static_and_each_part_counts(setup, monkeypatch):
    naive, _ = _kl(setup, activations="static", smoothing=False, static_scale="max")
    full, details = _kl(setup, activations="static", smooth_output=True)  # alpha searched, down and o smoothed
    assert details["alpha"] == "search" and details["smoothed_down_projections"] == details["smoothed_groups"] // 2
    assert details["smoothed_down_projections"] > 0  # one per layer: the fixture has outliers there
    assert details["smoothed_output_projections"] == sum(1 for n in setup[1].nodes if n.op == "attention")
    assert full * 3 <= naive, f"static SmoothQuant KL {full:.3e} vs naive static {naive:.3e}"
    fixed, _ = _kl(setup, activations="static", alpha=0.5)
    assert full < fixed, f"alpha searched {full:.3e} vs 0.5 for every group {fixed:.3e}"
    clipped, details = _kl(setup, activations="static", smoothing=False)  # auto: clipped without smoothing
    assert details["clip_ratio_mean"] < 1.0 and clipped < naive, f"clipped {clipped:.3e} vs max {naive:.3e}"
    monkeypatch.setattr(sq.SmoothQuant, "_v_rows", staticmethod(lambda *args: None))
    without_out, details = _kl(setup, activations="static", smooth_output=True)
    assert details["smoothed_output_projections"] == 0
    assert full * 1.5 < without_out, f"output projection smoothed {full:.3e} vs not {without_out:.3e}"
    monkeypatch.setattr(sq.SmoothQuant, "_up_rows", staticmethod(lambda *args: None))
    without_down, details = _kl(setup, activations="static", smooth_output=True)
    assert details["smoothed_down_projections"] == 0
    assert without_out < without_down, f"down projection smoothed {without_out:.3e} vs not {without_down:.3e}"


def test_down_smoothing_keeps_the_function_in_float(setup):
    """Before rounding: dividing the up rows by s and multiplying the down columns by s is exact."""
    _, graph, calib, _, _ = setup
    from passes.smoothquant import SmoothQuant

    g = graph.copy()
    method = SmoothQuant()
    producers, users = g.producers(), g.users()
    downs = [n for n in g.nodes if n.op == "linear" and method._up_rows(producers, users, n.inputs[0])]
    assert len(downs) == sum(1 for n in g.nodes if n.op == "attention")
    ids = torch.tensor(calib[0][:32])
    before = GraphModel(graph).logits(ids.tolist())
    for down in downs:
        lin, rows, _ = method._up_rows(producers, users, down.inputs[0])
        s = torch.rand(rows.stop - rows.start, generator=torch.Generator().manual_seed(0)) + 0.5
        up = g.params[lin.weights["weight"]].clone()  # the copy's tensors are the original graph's
        up[rows] /= s[:, None]
        g.params[lin.weights["weight"]] = up
        g.params[down.weights["weight"]] = g.params[down.weights["weight"]] * s[None, :]
    after = GraphModel(g).logits(ids.tolist())
    assert (after - before).abs().max() < 1e-3
    assert not torch.equal(g.params[downs[0].weights["weight"]], graph.params[downs[0].weights["weight"]])


def test_output_smoothing_keeps_the_function_in_float(setup):
    """Before rounding: dividing v's row (kv head g, d) by s and multiplying the output projection's columns of every
    query head of group g at d by s is exact, with the heads as the v projection and attention lay them out."""
    _, graph, calib, _, _ = setup
    from passes.smoothquant import SmoothQuant

    g = graph.copy()
    method = SmoothQuant()
    producers, users = g.producers(), g.users()
    outs = [n for n in g.nodes if n.op == "linear" and method._v_rows(g, producers, users, n.inputs[0])]
    assert len(outs) == sum(1 for n in g.nodes if n.op == "attention")
    ids = torch.tensor(calib[0][:32])
    before = GraphModel(graph).logits(ids.tolist())
    for out in outs:
        lin, rows, (kv, group, dim) = method._v_rows(g, producers, users, out.inputs[0])
        assert (kv, group) == (2, 3)  # the bundled model: 6 query heads on 2 kv heads
        s_kv = torch.rand(kv, dim, generator=torch.Generator().manual_seed(0)) + 0.5
        w = g.params[lin.weights["weight"]].clone()
        w[rows] /= s_kv.reshape(-1, 1)
        g.params[lin.weights["weight"]] = w
        s = s_kv[:, None, :].expand(kv, group, dim).reshape(-1)
        g.params[out.weights["weight"]] = g.params[out.weights["weight"]] * s[None, :]
    after = GraphModel(g).logits(ids.tolist())
    assert (after - before).abs().max() < 1e-3
    shuffled = g.copy()  # the same scales on the wrong query heads change the function
    for out in outs:
        w = shuffled.params[out.weights["weight"]].reshape(-1, kv, group * dim)
        shuffled.params[out.weights["weight"]] = w.flip(1).reshape(w.shape[0], -1)
    assert (GraphModel(shuffled).logits(ids.tolist()) - before).abs().max() > 1e-2


def test_static_alpha_search_holds_out_the_sampled_windows():
    """Static: the windows the search samples rows from are kept out of the maxima its candidates are built from, so
    a candidate fitted tightly to those maxima pays for the sampled rows beyond them; the winner's scales come from
    every window. Here the sampled windows carry channel-0 outliers (12) the other windows never reach (3): alpha
    0.9 equalises the held-out maxima and clamps the outliers, so the held-out search picks a lower alpha than the
    search on every window's maxima does. Dynamic keeps its grid and no held-out maxima."""
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randn(256, 16, generator=gen) for _ in range(12)]
    for k, w in enumerate(windows):
        w[::37, 0] = 12.0 if k < 8 else 3.0
    weights = [torch.randn(24, 16, generator=gen)]

    def observed(options: dict, held_out: bool = True) -> sq.SmoothQuant:
        method = sq.SmoothQuant()
        method.configure(options)
        for w in windows:
            method.observe(0, None, w)
        if not held_out:
            method.fit_max.clear()
        return method

    static = observed({"activations": "static"})
    assert static.alphas == sq.STATIC_ALPHA_GRID and max(static.alphas) > max(sq.ALPHA_GRID)
    assert static.samples[0].shape[0] == sq.SAMPLE_ROWS  # 64 rows from each of the first 8 windows
    assert torch.equal(static.fit_max[0], torch.stack([w.abs().amax(0) for w in windows[8:]]).amax(0))
    assert torch.equal(static.stats[0], torch.stack([w.abs().amax(0) for w in windows]).amax(0))
    s = static._search(static.stats[0], weights, [0])
    everywhere = observed({"activations": "static"}, held_out=False)
    everywhere._search(everywhere.stats[0], weights, [0])
    assert static.chosen_alphas[0] < everywhere.chosen_alphas[0], (static.chosen_alphas, everywhere.chosen_alphas)
    assert torch.allclose(s, sq.smoothing_scales(static.stats[0], weights, static.chosen_alphas[0]))
    dynamic = observed({})
    assert dynamic.alphas == sq.ALPHA_GRID and not dynamic.fit_max

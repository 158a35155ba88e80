"""fp8_block linears (e4m3 codes with one scale per [bn, bk] block) through the passes that stack or cut weights:
the merges stack block scales by rows only where every member but the last holds whole row blocks; the shard pass
cuts them by whole blocks (rows for column splits, columns for row splits) and refuses a split inside a block, the
block-FP8 experts of a mixture of experts too.

The tiny Llama's linears are block-quantized here by this file's own rounding (amax / 448 per block); the MoE is a
fine-grained FP8 checkpoint written by ``make_checkpoint --fp8-blocks``."""

from __future__ import annotations

import pytest
import torch

from builder.checkpoint import attach_weights, open_checkpoint
from conftest import make_checkpoint
from passes import PassContext, PassError, run_passes
from passes.quantize import replace_weight
from passes.trace import trace
from runtime.executor import Executor
from test_shard import PIPELINE, PROMPTS, _logits, _shard, run_ranks

MERGES = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes, fp32 scales [ceil(N / bn), ceil(K / bk)]), each block scaled by its amax / 448."""
    (n, k), (bn, bk) = w.shape, block
    scales = torch.zeros(-(-n // bn), -(-k // bk))
    codes = torch.zeros(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scales[i, j] = part.abs().max() / 448
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = part / scales[i, j]
    return codes.to(torch.float8_e4m3fn), scales


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fp8_block") / "llama", "llama", seed=4)


def quantized_graph(path, block: tuple[int, int], merges: bool = True):
    """The traced tiny Llama with every linear block-quantized (before the merges, as an import does)."""
    ckpt = open_checkpoint(path)
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    for node in [n for n in graph.nodes if n.op == "linear"]:
        codes, scales = block_quantize(graph.params[node.weights["weight"]], block)
        replace_weight(graph, node, "fp8_block", {"qweight": codes, "weight_scale": scales},
                       {"block_size": list(block), "activations": "dynamic"})
    graph.check()
    return run_passes(graph, MERGES if merges else ["dce"], PassContext())[0]


def test_merged_members_stack_their_block_rows(llama):
    """q (64 rows), k and v (32 each) hold whole blocks of 16 rows: one q+k+v linear whose scales are the members'
    scale rows stacked, computing what the three did. Blocks of 48 rows would cut q's last block: no merge."""
    plain = quantized_graph(llama, (16, 16), merges=False)
    merged = quantized_graph(llama, (16, 16))
    qkv = [n for n in merged.nodes if n.op == "linear" and "q_proj+k_proj+v_proj" in n.weights["qweight"]]
    assert len(qkv) == 2 and qkv[0].attrs["split_sizes"] == [64, 32, 32]
    parts = [plain.params[f"model.layers.0.self_attn.{p}.weight_scale"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(merged.params[qkv[0].weights["weight_scale"]], torch.cat(parts))
    assert merged.params[qkv[0].weights["weight_scale"]].shape == (8, 4)
    ours = _logits(Executor(merged.to_dict(), merged.params), PROMPTS)
    for a, b in zip(ours, _logits(Executor(plain.to_dict(), plain.params), PROMPTS)):
        assert a.abs().max() > 0 and (a - b).abs().max().item() < 1e-4
    unmerged = quantized_graph(llama, (48, 16))
    assert not any("+" in n.weights.get("qweight", "") for n in unmerged.nodes)


def test_ranks_cut_whole_blocks_and_match_one_device(llama, monkeypatch):
    """tp_size 2 with 8 x 8 blocks: q/k/v and gate/up rows, o_proj / down_proj columns (56 per rank) and their scales
    are cut by whole blocks; each activation group lies on one rank, so the ranks' logits are one device's."""
    graph = quantized_graph(llama, (8, 8))
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, record = _shard(graph, 2)
    down = next(n for n in sharded.nodes if n.source.endswith("down_proj"))
    qkv = next(n for n in sharded.nodes if "q_proj+k_proj+v_proj" in n.weights.get("qweight", ""))
    assert list(sharded.params[down.weights["qweight"]].shape) == [64, 56]
    assert list(sharded.params[down.weights["weight_scale"]].shape) == [8, 7]
    assert list(sharded.params[qkv.weights["weight_scale"]].shape) == [8, 8]  # (32 + 16 + 16) / 8 rows of blocks
    full = graph.params[qkv.weights["weight_scale"]]  # [q 8 | k 4 | v 4] block rows
    rank1 = sharded.shards.tensor(qkv.weights["weight_scale"], 1)
    assert torch.equal(rank1, torch.cat([full[4:8], full[10:12], full[14:16]]))
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("block, message", [
    ((8, 16), r"tp_size 2 splits the input columns of model\.layers\.0\.mlp\.down_proj into pieces of 56 \(from 0\), "
              r"which cut its fp8_block scale blocks of 16 input columns"),
    ((32, 8), r"tp_size 2 splits the output rows of model\.layers\.0\.self_attn into pieces of 16 \(from 64\), "
              r"which cut its fp8_block scale blocks of 32 output rows"),
])
def test_a_split_inside_a_block_is_an_error(llama, block, message):
    graph = quantized_graph(llama, block)
    with pytest.raises(PassError, match=message):
        _shard(graph, 2)


def test_block_fp8_experts_shard_by_whole_blocks_and_match_one_device(tmp_path, monkeypatch):
    """tp_size 2 over a fine-grained FP8 tiny MoE (make_checkpoint --fp8-blocks 16: 32 intermediate features per
    expert): each rank takes 16 of every expert's gate and up rows and down columns, and their block scales; the
    ranks' logits (threads, test_shard's runner) are one device's. Blocks of 32 would be cut: refused by name."""
    from builder.devtools.make_checkpoint import main as make

    def graph_of(block: int):
        path = tmp_path / f"b{block}"
        assert make(["--preset", "tiny-moe", "--out", str(path), "--dtype", "float32", "--device", "cpu",
                     "--fp8-blocks", str(block)]) == 0
        ckpt = open_checkpoint(path)
        graph, meta_model = trace(ckpt.hf_config())
        attach_weights(graph, ckpt, meta_model, torch.float32)
        return run_passes(graph, PIPELINE, PassContext())[0]

    graph = graph_of(16)
    moe = next(n for n in graph.nodes if n.op == "moe")
    assert moe.attrs["quant"]["scheme"] == "fp8_block"
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, _ = _shard(graph, 2)
    scale = moe.weights["w_gate_up_scale"]  # [E, 2I / 16 = 4 row blocks (gate 2, up 2), hidden / 16 = 4]
    full = graph.params[scale]
    assert torch.equal(sharded.shards.tensor(scale, 1), torch.cat([full[:, 1:2], full[:, 3:4]], dim=1))
    down = moe.weights["w_down_scale"]  # [E, hidden / 16, I / 16 = 2 column blocks]
    assert torch.equal(sharded.shards.tensor(down, 0), graph.params[down][:, :, :1])
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4
    with pytest.raises(PassError, match=r"block-FP8 experts have blocks of 32 x 32; tp_size 2 gives each rank 16 .* "
                                        r"cuts a block"):
        _shard(graph_of(32), 2)

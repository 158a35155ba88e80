"""shard: structure before/after, what it matched, per-rank weights, and logits of the ranks run together
(in threads over an in-process stand-in for torch.distributed) against the unsharded graph.

The real multi-process run (gloo) is tests/runtime/test_tensor_parallel.py."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import make_checkpoint
from builder.checkpoint import open_checkpoint
from builder.checkpoint import attach_weights
from passes import PassContext, PassError, run_passes
from passes.ir import Graph
from passes.shard import check_tp_groups, check_tp_size
from passes.trace import trace
from runtime.executor import Executor, SeqSlice, StepInput
from runtime.kv_cache import SequenceKV

PIPELINE = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]
LAYERS = 2
PROMPTS = [[5, 9, 11, 40, 7, 3, 99, 12, 8], [17, 4]]


_GRAPHS: dict[str, Graph] = {}


def _graph(path) -> Graph:
    """The checkpoint traced and through the default graph passes (cached; a copy each call)."""
    if str(path) not in _GRAPHS:
        ckpt = open_checkpoint(path)
        graph, meta_model = trace(ckpt.hf_config())
        attach_weights(graph, ckpt, meta_model, torch.float32)
        _GRAPHS[str(path)], _ = run_passes(graph, PIPELINE, PassContext())
    return _GRAPHS[str(path)].copy()


def _shard(graph: Graph, tp_size: int, vocab_parallel: bool = False):
    ctx = PassContext(options={"shard": {"tp_size": tp_size, "vocab_parallel": vocab_parallel}})
    sharded, records = run_passes(graph.copy(), ["shard"], ctx)
    return sharded, records[0]


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """4 heads over a single KV head, intermediate size 102 (divisible by 2, not by 4)."""
    return make_checkpoint(tmp_path_factory.mktemp("kv1") / "llama", "llama", seed=5, num_key_value_heads=1,
                           intermediate_size=102)


# --- running the ranks together ------------------------------------------------------------------------
class _ThreadGroup:
    """torch.distributed's default group as the executor uses it, for ranks that are threads of this process."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.barrier = threading.Barrier(tp_size)
        self.slots: list[torch.Tensor | None] = [None] * tp_size
        self.local = threading.local()

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_reduce(self, t: torch.Tensor) -> None:
        parts = self._exchange(t)
        t.copy_(sum(parts[1:], parts[0]))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        for o, p in zip(out, self._exchange(t)):
            o.copy_(p)

    def install(self, monkeypatch) -> None:
        import torch.distributed as dist

        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: True,
                         "get_world_size": lambda: self.tp_size, "get_rank": lambda: self.local.rank,
                         "get_backend": lambda: "gloo", "all_reduce": self.all_reduce,
                         "all_gather": self.all_gather}.items():
            monkeypatch.setattr(dist, name, fn)


def _logits(executor: Executor, prompts) -> list[torch.Tensor]:
    outs = []
    for ids in prompts:
        kv = SequenceKV(executor.kv_layout(), len(ids))
        outs.append(executor.forward(StepInput(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])))
    return outs


def run_ranks(graph: Graph, prompts, monkeypatch) -> list[list[torch.Tensor]]:
    """Each rank's logits for ``prompts``, every rank running its shard of ``graph`` in its own thread."""
    group = _ThreadGroup(graph.shards.tp_size)
    group.install(monkeypatch)
    results: list = [None] * group.tp_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        group.local.rank = rank
        try:
            params = {name: graph.shards.tensor(name, rank) for name in graph.params}
            results[rank] = _logits(Executor(graph.to_dict(), params), prompts)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(group.tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


# --- structure ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_structure_before_and_after(family, checkpoints):
    graph = _graph(checkpoints[family])
    before = graph.count_ops()
    sharded, rec = _shard(graph, 2)
    after = sharded.count_ops()
    assert rec.matched == rec.changed == 4 * LAYERS  # qkv + gate_up column, o_proj + down_proj row, per layer
    assert rec.details["column_linears"] == rec.details["row_linears"] == 2 * LAYERS
    assert after["all_reduce"] == 2 * LAYERS and "all_gather" not in after
    assert {k: v for k, v in after.items() if k != "all_reduce"} == before
    head_dim = 24 if family == "qwen3" else 16
    qkv = next(n for n in sharded.nodes if n.op == "linear" and len(n.outputs) == 3)
    assert qkv.attrs["split_sizes"] == [2 * head_dim, head_dim, head_dim]  # 2 of 4 q heads, 1 of 2 kv heads
    attn = next(n for n in sharded.nodes if n.op == "attention")
    assert (attn.attrs["num_heads"], attn.attrs["num_kv_heads"]) == (2, 1)
    assert sorted(n.attrs["num_heads"] for n in sharded.nodes if n.op == "rope")[:2] == [1, 1]
    o_proj = next(n for n in sharded.nodes if n.op == "linear" and n.inputs == attn.outputs)
    assert o_proj.attrs["in_features"] == 2 * head_dim and o_proj.outputs[0].endswith("_partial")
    reduce = sharded.nodes[sharded.nodes.index(o_proj) + 1]
    assert reduce.op == "all_reduce" and reduce.inputs == o_proj.outputs and reduce.attrs == {"tp_size": 2}
    # q/k/v biases (qwen2) follow their rows; per-head norm weights (qwen3) stay whole
    if family == "qwen2":
        assert list(sharded.params[qkv.weights["bias"]].shape) == [4 * head_dim]
    # the pass copies nothing: the full tensors are the graph's, params only describe one rank
    assert all(sharded.shards.full[k] is graph.params[k] for k in sharded.shards.full)
    assert all(t.is_meta for t in sharded.params.values())
    assert sharded.meta["tensor_parallel"]["tp_size"] == 2


def test_each_member_of_a_merged_linear_is_split_separately(checkpoints):
    graph = _graph(checkpoints["llama"])
    sharded, _ = _shard(graph, 2)
    qkv = next(n for n in graph.nodes if n.op == "linear" and len(n.outputs) == 3)
    name = qkv.weights["weight"]
    full = graph.params[name]  # [q 64 | k 32 | v 32] rows
    q, k, v = full.split([64, 32, 32])
    for r in range(2):
        expect = torch.cat([q[32 * r:32 * (r + 1)], k[16 * r:16 * (r + 1)], v[16 * r:16 * (r + 1)]])
        assert torch.equal(sharded.shards.tensor(name, r), expect)
    gate_up = next(n for n in graph.nodes if n.op == "linear" and n.outputs[0] in
                   {i for m in graph.nodes if m.op == "silu_mul" for i in m.inputs})
    gate, up = graph.params[gate_up.weights["weight"]].chunk(2)
    for r in range(2):
        expect = torch.cat([gate[56 * r:56 * (r + 1)], up[56 * r:56 * (r + 1)]])
        assert torch.equal(sharded.shards.tensor(gate_up.weights["weight"], r), expect)
        down = next(n for n in graph.nodes if n.source.endswith("down_proj")).weights["weight"]
        shard = sharded.shards.tensor(down, r)
        assert shard.data_ptr() == graph.params[down][:, 56 * r:].data_ptr()  # a view, no copy


# --- numerics -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,tp_size,vocab_parallel", [
    ("llama", 2, False),  # tied embedding / lm_head
    ("qwen2", 2, True),  # q/k/v biases; vocab-parallel embedding and logits
    ("qwen3", 2, False),  # per-head q/k norms, head_dim 24
    ("mistral", 4, False),  # 4 ranks over 2 kv heads: each kv head on two ranks
])
def test_ranks_together_match_the_unsharded_graph(family, tp_size, vocab_parallel, checkpoints, monkeypatch):
    graph = _graph(checkpoints[family])
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, rec = _shard(graph, tp_size, vocab_parallel)
    assert rec.details["kv_heads_replicated"] == (tp_size > 2)
    if vocab_parallel:
        assert sharded.count_ops()["all_gather"] == 1
        assert next(n for n in sharded.nodes if n.op == "embedding").attrs["vocab_parallel"]
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4


def test_unmerged_projections_are_split_too(checkpoints, monkeypatch):
    """Straight from tracing: separate q/k/v and gate/up linears, act(gate) * up as two nodes."""
    ckpt = open_checkpoint(checkpoints["qwen2"])
    graph, meta_model = trace(ckpt.hf_config())
    attach_weights(graph, ckpt, meta_model, torch.float32)
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, rec = _shard(graph, 2)
    assert rec.details["column_linears"] == 5 * LAYERS and rec.details["row_linears"] == 2 * LAYERS
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4


def test_kv_heads_replicated_when_ranks_outnumber_them(one_kv_head, monkeypatch):
    graph = _graph(one_kv_head)
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, rec = _shard(graph, 2)
    assert rec.details["kv_heads_replicated"]
    attn = next(n for n in sharded.nodes if n.op == "attention")
    assert (attn.attrs["num_heads"], attn.attrs["num_kv_heads"]) == (2, 1)
    qkv = next(n for n in graph.nodes if n.op == "linear" and len(n.outputs) == 3)
    k_rows = graph.params[qkv.weights["weight"]][64:80]  # the single kv head's k rows
    for r in range(2):  # both ranks hold it
        assert torch.equal(sharded.shards.tensor(qkv.weights["weight"], r)[32:48], k_rows)
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < 1e-4


def _quantized(path, algo: str, group_size: int | None = None) -> Graph:
    graph = _graph(path)
    g = torch.Generator().manual_seed(0)
    ctx = PassContext(calibration=[torch.randint(3, 300, (32,), generator=g).tolist() for _ in range(4)])
    ctx.options[algo] = {} if group_size is None else {"group_size": group_size}
    graph, _ = run_passes(graph, [algo, "dce"], ctx)
    return graph


@pytest.mark.parametrize("algo,group_size", [("gptq", 8), ("int8_wo", None), ("smoothquant", None)])
def test_quantized_weights_shard_with_their_scales(algo, group_size, checkpoints, monkeypatch):
    graph = _quantized(checkpoints["llama"], algo, group_size)
    refs = _logits(Executor(graph.to_dict(), graph.params), PROMPTS)
    sharded, _ = _shard(graph, 2)
    down = next(n for n in sharded.nodes if n.source.endswith("down_proj"))
    q = down.attrs["quant"]
    if algo == "gptq":  # 4-bit codes two per byte, one scale per 8 input columns: 56 columns per rank
        assert list(sharded.params[down.weights["qweight"]].shape) == [64, 28]
        assert list(sharded.params[down.weights["scales"]].shape) == [64, 7]
    elif algo == "int8_wo":  # per output channel: scales whole on every rank
        assert q["group_size"] == -1 and list(sharded.params[down.weights["scales"]].shape) == [64, 1]
    else:  # W8A8: per-channel weight scales whole; activations quantized per token on each rank's columns
        assert list(sharded.params[down.weights["weight_scale"]].shape) == [64]
    # dynamic per-token activation scales see only a rank's columns: close to, not equal to, one device
    tol = 5e-2 if algo == "smoothquant" else 1e-4
    for rank_logits in run_ranks(sharded, PROMPTS, monkeypatch):
        for ours, ref in zip(rank_logits, refs):
            assert (ours - ref).abs().max().item() < tol


# --- errors -------------------------------------------------------------------------------------------
def test_a_split_that_cuts_a_quantization_group_is_an_error(checkpoints):
    graph = _quantized(checkpoints["llama"], "gptq", 16)  # down_proj: 112 columns, 56 per rank, groups of 16
    with pytest.raises(PassError, match=r"down_proj \(112\) into 56 columns per rank, which cuts its "
                                        r"quantization groups of 16; build with a group_size dividing 56 \(8\)"):
        _shard(graph, 2)


def test_a_recipe_whose_groups_the_split_would_cut_fails_before_calibration(checkpoints, one_kv_head, tmp_path,
                                                                             monkeypatch):
    """The same groups asked for by a recipe at tp_size 2 stop the build right after tracing, naming the recipe's
    key and the sizes that fit, before any calibration text is read (the shard pass alone would refuse them only
    after calibration, quantization and the gates)."""
    import builder.pipeline as pipeline
    from builder.recipe import validate_recipe

    monkeypatch.setattr(pipeline, "calibration_data", lambda *a, **k: pytest.fail("calibration text was read"))
    sections = {"name": "cut", "model": {"checkpoint": str(checkpoints["llama"]), "dtype": "float32"},
                "output_dir": str(tmp_path / "cut"), "parallel": {"tp_size": 2}, "runtime": {"max_seq_len": 128},
                "quantization": [{"algo": "gptq", "group_size": 16}], "gates": {"enabled": False}}
    with pytest.raises(PassError, match=r"down_proj \(112\) into 56 columns per rank, which cuts the quantization "
                                        r"groups of 16 that quantization\[0\] asks for; set "
                                        r"quantization\[0\]\.group_size to one dividing 56 \(8\) or -1"):
        pipeline.build(validate_recipe(sections))
    assert not (tmp_path / "cut").exists()
    graph = _graph(checkpoints["llama"])
    check_tp_groups(graph, 2, list(range(len(graph.nodes))), 8, 4, "quantization")  # groups of 8 fit 56 columns
    odd = _graph(one_kv_head)  # intermediate 102: 51 columns per rank, an odd number for 4-bit codes, any group size
    with pytest.raises(PassError, match=r"down_proj \(102\) into 51 columns per rank, an odd number: packed 4-bit "
                                        r"codes \(quantization\) hold two columns per byte"):
        check_tp_groups(odd, 2, list(range(len(odd.nodes))), -1, 4, "quantization")
    check_tp_groups(odd, 2, list(range(len(odd.nodes))), -1, 8, "quantization")  # 8-bit codes per channel: fine


def test_tp_sizes_that_do_not_fit_the_model(checkpoints, one_kv_head):
    graph = _graph(checkpoints["llama"])  # 4 heads, 2 kv heads, intermediate 112, vocab 320
    with pytest.raises(PassError, match=r"tp_size 3 does not divide num_attention_heads 4 .*; pick tp_size 1, 2 or 4"):
        check_tp_size(graph, 3)
    with pytest.raises(PassError, match="tp_size 8 does not divide num_attention_heads 4"):
        _shard(graph, 8)
    odd = _graph(one_kv_head)  # intermediate 102
    with pytest.raises(PassError, match=r"tp_size 4 does not divide the intermediate size 102 .*; pick tp_size 1 or 2"):
        check_tp_size(odd, 4)
    check_tp_size(odd, 2)  # 4 heads over 1 kv head: replicated
    table = next(n for n in graph.nodes if n.op == "embedding").weights["weight"]
    graph.params[table] = torch.empty(321, 64)  # an odd vocabulary (shapes are all the check reads)
    with pytest.raises(PassError, match=r"does not divide the vocabulary size 321 .*vocab_parallel: false"):
        check_tp_size(graph, 2, vocab_parallel=True)
    check_tp_size(graph, 2)  # replicated embedding and lm_head: any vocabulary


def test_tp_size_1_changes_nothing(checkpoints):
    graph = _graph(checkpoints["llama"])
    text = str(graph)
    same, rec = _shard(graph, 1)
    assert str(same) == text and same.shards is None and rec.matched == 0

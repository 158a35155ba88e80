"""Tensor parallelism on CPU: a TP=2 artifact run by two gloo ranks (this process and a spawned worker)
against the TP=1 artifact of the same checkpoint, for bf16 and GPTQ 4-bit; steps carrying prefill through every
rank's StepGraphs (the kernels under TRITON_INTERPRET=1); the manifest; a killed worker; the step message's wire
format and its malformed headers and payloads; torchrun over two nodes (two launchers on this host); the memory
plan's least block count across ranks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the step graphs' padded steps run the kernels (spawned ranks too)

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from builder.pipeline import build  # noqa: E402
from builder.recipe import validate_recipe  # noqa: E402
from conftest import make_checkpoint  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from runtime.artifact import ArtifactError, open_artifact  # noqa: E402
from runtime.cuda_graphs import PackedStep, StepGraphs  # noqa: E402
from runtime.executor import SeqSlice, StepInput  # noqa: E402
from runtime.kv_cache import KVLayout  # noqa: E402
from runtime.memory import MemoryPlanError, least_kv_blocks, plan_kv_blocks  # noqa: E402
from runtime.paged_kv import PagedKVStorage  # noqa: E402
from runtime.serving import ServingConfig, ServingEngine  # noqa: E402
from runtime.tensor_parallel import (FIRST_INTS, HEADER, MAGIC, StepMessage, StepMessageError,  # noqa: E402
                                     TPStepGraphs, WorkerFailure, _check_header, _decode, _encode, _WorkerState,
                                     check_devices)

PASSES = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce"]
PROMPTS = ["def fibonacci(n):", "import os\nclass Config:"]
GPTQ = {"quantization": {"algo": "gptq", "group_size": 8}, "calibration": {"num_samples": 8, "seq_len": 32, "dataset": "bundled"},
        "gates": {"enabled": False}}
# (dtype, recipe sections, max |logit difference| between one rank and two)
METHODS = {"bf16": ("bfloat16", {}, 0.05), "gptq": ("float32", GPTQ, 1e-4)}


def _build(checkpoint: Path, out: Path, dtype: str, tp_size: int, **sections) -> Path:
    recipe = validate_recipe({
        "name": out.name, "model": {"checkpoint": str(checkpoint), "dtype": dtype}, "output_dir": str(out),
        "passes": PASSES, "runtime": {"max_seq_len": 128, "max_num_tokens": 32}, "parallel": {"tp_size": tp_size},
        **sections})
    return build(recipe).output_dir


@pytest.fixture(scope="module")
def built(checkpoints, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """(method, tp_size) -> artifact of the tiny Llama (4 heads, 2 kv heads, intermediate 112)."""
    root = tmp_path_factory.mktemp("tp")
    return {(m, tp): _build(checkpoints["llama"], root / f"{m}-tp{tp}", dtype, tp, **sections)
            for m, (dtype, sections, _) in METHODS.items() for tp in (1, 2)}


@contextlib.contextmanager
def loaded(path: Path):
    engine = Engine.load(path)
    try:
        yield engine
    finally:
        engine.close()


def test_manifest_records_tp_size_and_each_ranks_tensors(built):
    path = built[("bf16", 2)]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tensor_parallel"]["tp_size"] == 2 and not manifest["tensor_parallel"]["vocab_parallel"]
    weights = manifest["weights"]
    assert weights["tp_size"] == 2
    assert weights["files"] == ["weights-rank0.safetensors", "weights-rank1.safetensors"]
    assert not (path / "weights.safetensors").exists()
    graph = json.loads((path / "graph.json").read_text())
    one = json.loads((built[("bf16", 1)] / "manifest.json").read_text())
    for rank, entry in enumerate(weights["ranks"]):
        assert entry["rank"] == rank and entry["file"] == weights["files"][rank]
        assert entry["file"] in manifest["files"]  # hashed like every other file
        with safe_open(path / entry["file"], "pt") as f:
            assert sorted(f.keys()) == entry["tensors"] == sorted(graph["params"])
            for name in f.keys():
                assert list(f.get_slice(name).get_shape()) == graph["params"][name]["shape"]
    # each rank holds half of the split weights and all of the replicated ones (embedding = lm_head, tied)
    assert one["weights"]["bytes"] < weights["ranks"][0]["bytes"] * 2
    assert manifest["model"]["num_parameters"] == one["model"]["num_parameters"]
    shard = next(p for p in manifest["build"]["passes"] if p["name"] == "shard")
    assert shard["details"]["row_linears"] == 4 and shard["details"]["collectives"] == 4


def test_a_sharded_artifact_loads_per_rank(built):
    art = open_artifact(built[("bf16", 2)])
    with pytest.raises(ArtifactError, match="sharded for tp_size 2: load one rank's weights"):
        art.load_weights()
    rank1 = art.load_weights(rank=1)
    assert list(rank1["model.layers.0.self_attn.o_proj.weight"].shape) == [64, 32]


@pytest.mark.parametrize("method", list(METHODS))
def test_two_gloo_ranks_match_one_rank(method, built):
    atol = METHODS[method][2]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with loaded(built[(method, 1)]) as one:
        prompts = [one.tokenizer.encode(p) for p in PROMPTS]
        ref_logits = [one.logits(p) for p in prompts]
        ref_tokens = [one.generate(p, params).token_ids for p in prompts]
    with loaded(built[(method, 2)]) as two:
        assert two.executor.tp_size == 2 and two.kv_layout.num_kv_heads == [1, 1]  # this rank's kv heads
        for p, ref in zip(prompts, ref_logits):
            assert (two.logits(p) - ref).abs().max().item() < atol
        assert [two.generate(p, params).token_ids for p in prompts] == ref_tokens
        # the serving path: paged KV per rank, batched steps, block tables broadcast by rank 0
        serving = ServingEngine(two, ServingConfig(num_blocks=16, max_num_seqs=2))
        assert [o.token_ids for o in serving.run(prompts, params)] == ref_tokens
        assert serving.kv.pool.num_free == serving.kv.pool.num_blocks
        assert serving.memory_plan.rank_num_blocks == (16, 16)  # each rank's own figure, gathered
        if method == "bf16":  # a byte budget: each rank divides it by its own block size (the same here)
            plan = ServingEngine(two, ServingConfig(kv_cache_bytes=1 << 20, max_num_seqs=2)).memory_plan
            assert plan.rank_num_blocks == (plan.num_blocks,) * 2
            assert plan.num_blocks == (1 << 20) // plan.bytes_per_block
            # the memory plan's profiling step (measured on every rank on CUDA) is a step like any other
            ids = torch.tensor(prompts[0])
            steps = [StepInput(ids, torch.arange(len(ids)), [SeqSlice(two._new_cache(len(ids)), 0, len(ids))])
                     for _ in range(2)]
            assert torch.equal(two.executor.profile_forward(steps[0]), two.executor.forward(steps[1]))


@pytest.fixture(scope="module")
def kernel_built(tmp_path_factory) -> dict[int, Path]:
    """tp_size -> fp32 artifact of a one-layer Llama with head_dim 32 (the kernels take 32 and up): two heads and two
    kv heads, one of each per rank at TP=2. One layer: every step's kernels run under the interpreter, on both ranks."""
    root = tmp_path_factory.mktemp("tp-kernels")
    checkpoint = make_checkpoint(root / "ckpt", "llama", seed=2, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2)  # seed 2: greedy tokens that change along the way
    return {tp: _build(checkpoint, root / f"tp{tp}", "float32", tp) for tp in (1, 2)}


class _NoDecodeGraphs:
    """No decode graphs (they need a GPU), yet the overlapped pipeline on: every step goes through the step graphs,
    and steps launched ahead take the tokens the step in flight sampled from the device (StepGraphs.run's feed)."""

    def bucket_for(self, num_seqs: int) -> None:
        return None

    def close(self) -> None:
        pass


def test_steps_carrying_prefill_replay_every_ranks_step_graphs_as_one_rank(kernel_built, monkeypatch, capfd):
    """A TP=2 serving engine whose steps go through TPStepGraphs (each rank's StepGraphs runs its padded step
    eagerly here; on CUDA it replays the captured graph of exactly that step) gives the TP=1 reference path's greedy
    tokens and logprobs: prompts padded to their token and sequence buckets, one prefilled in chunks; without logprobs
    the steps run ahead and decodes are fed the tokens in flight. Every step is one 'step_replay' message, after one
    'step_graphs'; then a replay naming a block past the pool makes the worker exit, naming the field, and fails the
    engine."""
    import runtime.tensor_parallel as tp

    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    with loaded(kernel_built[1]) as one:
        texts = ["def fibonacci(n):", "import os\nclass Config:", "x = [1, 2, 3]\nfor i in x:\n    print(i)\n" * 2]
        prompts = [one.tokenizer.encode(p) for p in texts]
        assert max(map(len, prompts)) > 32, "one prompt must be prefilled in chunks"
        wants = [one.generate(p, params) for p in prompts]
    engine = Engine.load(kernel_built[2], use_kernels=True)
    try:
        serving = ServingEngine(engine, ServingConfig(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32))
        kinds: list[str] = []
        real_send = tp._send
        monkeypatch.setattr(tp, "_send", lambda msg, data, spec: (kinds.append(msg.kind), real_send(msg, data, spec)))
        serving.step_graphs = graphs = TPStepGraphs(engine.executor, serving.storage, 32, 4, 128,
                                                    token_buckets=(8, 16, 32), capture=False)
        assert (graphs.token_buckets, graphs.seq_buckets) == ([8, 16, 32], [1, 4])
        serving.graphs = _NoDecodeGraphs()
        runs, real_run = [], graphs.run

        def spy(step, feed=None):
            runs.append((step.num_tokens, step.num_seqs, len(step.logits_rows), 0 if feed is None else len(feed[1])))
            return real_run(step, feed)

        graphs.run = spy
        outs = serving.run(prompts, params)
        for out, want in zip(outs, wants):
            assert out.token_ids == want.token_ids
            got = torch.tensor([lp.logprob for lp in out.logprobs])
            assert torch.allclose(got, torch.tensor(want.logprobs), atol=1e-4)
        assert kinds == ["step_graphs"] + ["step_replay"] * len(runs), kinds  # no eager "step" message
        assert any(t > s and t not in graphs.token_buckets for t, s, _, _ in runs), runs  # prefill, padded
        assert any(s not in graphs.seq_buckets for _, s, _, _ in runs), runs  # sequences padded too
        assert (32, 3, 2, 0) in runs  # the first step: two prompts whole, the third's first chunk (no logits row)
        assert serving.kv.pool.num_free == serving.kv.pool.num_blocks
        runs.clear()  # without logprobs the steps run ahead of the host: decodes take their tokens from the device
        plain = SamplingParams(max_tokens=6, ignore_eos=True)
        assert [o.token_ids for o in serving.run(prompts, plain)] == [w.token_ids for w in wants]
        assert max(fed for _, _, _, fed in runs) > 1, runs
        assert kinds == ["step_graphs"] + ["step_replay"] * (len(kinds) - 1)
        assert serving.kv.pool.num_free == serving.kv.pool.num_blocks

        # a step replay that passes rank 0's checks of the message but names a block past the worker's pool
        step = PackedStep([5, 6], [0, 1], [0, 1], [0, 2], [0], [[16]], [1])
        engine.executor.locked(lambda: real_send(StepMessage("step_replay", packed=step), [], engine.executor.spec),
                               "a malformed step replay")
        deadline = time.monotonic() + 30
        while engine.executor.failure is None and time.monotonic() < deadline:  # the sentinel thread sees it exit
            time.sleep(0.02)
        with pytest.raises(WorkerFailure, match=r"worker rank 1 \(pid \d+\) exited with exit code 1"):
            engine.generate("def", SamplingParams(max_tokens=2))
        assert "tensor-parallel rank 1: malformed message from tensor-parallel rank 0: a block of a step replay's " \
               "sequence 0's table is 16 (must be in 0..15); exiting" in capfd.readouterr().err
    finally:
        engine.close()


def test_under_torchrun_rank_0_generates_and_the_others_serve_steps(built, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(f"""
import json, os
from runtime import Engine, SamplingParams
if __name__ == "__main__":
    engine = Engine.load({str(built[("gptq", 2)])!r})  # ranks > 0 run steps in here, then exit
    out = engine.generate({PROMPTS[0]!r}, SamplingParams(max_tokens=8, ignore_eos=True))
    print("TOKENS", json.dumps(out.token_ids), os.environ["RANK"])
    engine.close()
""")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("TOKENS")]
    with loaded(built[("gptq", 1)]) as one:
        ref = one.generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    assert line == f"TOKENS {json.dumps(ref)} 0"


def test_more_ranks_than_gpus_is_refused():
    count = torch.cuda.device_count()
    with pytest.raises(ArtifactError, match=rf"sharded for tp_size {count + 1}: one rank per GPU.*this host has "
                                            rf"{count} GPU\(s\)"):
        check_devices(torch.device("cuda"), count + 1)


def test_a_worker_killed_mid_request_fails_health_instead_of_hanging(built, caplog):
    import threading

    from fastapi.testclient import TestClient

    from runtime.async_engine import AsyncEngine
    from runtime.server import create_app

    with loaded(built[("bf16", 2)]) as engine:
        serving = ServingEngine(engine, ServingConfig(num_blocks=16))
        with TestClient(create_app(AsyncEngine(serving), "tp", api_key=None)) as client:
            assert client.get("/health").status_code == 200
            body = {"model": "tp", "prompt": "def", "max_tokens": 3}
            assert client.post("/v1/completions", json=body).status_code == 200
            long = {**body, "max_tokens": 120, "ignore_eos": True}
            answer: list = []
            request = threading.Thread(target=lambda: answer.append(client.post("/v1/completions", json=long)))
            (worker,) = engine.executor._workers
            step = serving.step

            def slow_step():  # 120 steps of at least 10 ms: the request is still in flight when the worker dies
                outputs = step()
                time.sleep(0.01)
                return outputs

            serving.step = slow_step
            with caplog.at_level(logging.ERROR):
                steps = serving.num_steps
                request.start()
                while serving.num_steps < steps + 3:  # killed while the request is being generated
                    time.sleep(0.005)
                os.kill(worker.pid, signal.SIGKILL)
                request.join(10)
                assert not request.is_alive(), "the request in flight hung after its worker died"
            died = f"worker rank 1 (pid {worker.pid}) exited with signal SIGKILL"
            assert answer[0].status_code in (500, 503) and died in answer[0].json()["error"]["message"]
            assert any(died in r.getMessage() and r.name == "runtime.tensor_parallel" for r in caplog.records)
            assert client.get("/health").status_code == 503
            assert client.post("/v1/completions", json=body).status_code == 503
            start = time.monotonic()
            with pytest.raises(WorkerFailure, match="worker rank 1"):
                engine.generate("def", SamplingParams(max_tokens=2))
            assert time.monotonic() - start < 5  # at once, not after a hang guard's timeout


# --- the step message on the wire ------------------------------------------------------------------
def _wire(msg: StepMessage, data: list[torch.Tensor]) -> tuple[list[int], list[int], torch.Tensor]:
    """What ``_send`` broadcasts for ``msg``: (header, meta, data as one int64 tensor)."""
    flat = torch.cat([t.reshape(-1).long() for t in data]) if data else torch.empty(0, dtype=torch.long)
    header, meta = _encode(msg, flat.numel())
    return header, meta, flat


def _received(header: list[int], meta: list[int], flat: torch.Tensor) -> tuple[StepMessage, dict]:
    return _decode(_check_header(header), meta, flat)


def _step_message() -> tuple[StepMessage, list[torch.Tensor]]:
    tensors = {"input_ids": torch.tensor([5, 6, 7]), "positions": torch.tensor([3, 0, 1]),
               "slot_mapping": torch.tensor([35, 64, 65]),
               "block_tables": torch.tensor([[2, 0], [4, 5]], dtype=torch.int32),
               "cu_seqlens_q": torch.tensor([0, 1, 3], dtype=torch.int32)}
    msg = StepMessage("step", tensors=[(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
                      seqs=[(3, 1, ("paged", [2])), (0, 2, ("paged", [4, 5])), (7, 1, ("seq", 12, 64))],
                      paged_pool=(16, 16), decode_only=False, freed=[3, 9])
    return msg, list(tensors.values())


def _packed_step() -> PackedStep:
    """A step of a 5-token prompt chunk (after 16 cached tokens) beside two decodes, the second's token in flight."""
    return PackedStep(input_ids=[9, 8, 7, 6, 5, 41, 0], positions=[16, 17, 18, 19, 20, 3, 30],
                      slots=[48, 49, 50, 51, 52, 67, 94], cu_seqlens_q=[0, 5, 6, 7], context_lens=[16, 3, 30],
                      block_tables=[[2, 3], [4], [1, 5]], logits_rows=[4, 5, 6])


def test_every_message_kind_round_trips_through_ints():
    msg, data = _step_message()
    header, meta, flat = _wire(msg, data)
    assert len(header) == len(HEADER) and header[0] == MAGIC and all(isinstance(v, int) for v in header + meta)
    got, tensors = _received(header, meta, flat)
    assert (got.kind, got.seqs, got.paged_pool, got.freed, got.decode_only) == \
        ("step", msg.seqs, (16, 16), [3, 9], False)
    assert got.tensors == msg.tensors
    for name, t in zip([n for n, _, _ in msg.tensors], data):
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)
    msg.decode_only, msg.profile = True, True
    got, _ = _received(*_wire(msg, data))
    assert got.decode_only and got.profile

    ids = torch.tensor([11, 12])
    got, _ = _received(*_wire(StepMessage("replay", replay=(ids, [4, 9], [68, 9], [[4], [0, 3]])), [ids]))
    assert torch.equal(got.replay[0], ids) and got.replay[1:] == ([4, 9], [68, 9], [[4], [0, 3]])
    for msg in (StepMessage("heartbeat"), StepMessage("stop"),
                StepMessage("graphs", paged_pool=(40, 16), graphs=(8, 128)),
                StepMessage("plan", plan=(0.85, None, 24, 16)), StepMessage("plan", plan=(1.0, 1 << 30, None, 32))):
        header, meta, flat = _wire(msg, [])
        assert not meta and not flat.numel()  # a header alone: one broadcast
        got, _ = _received(header, meta, flat)
        assert (got.kind, got.paged_pool, got.graphs, got.plan) == (msg.kind, msg.paged_pool, msg.graphs, msg.plan)

    for capture in (True, False):
        msg = StepMessage("step_graphs", paged_pool=(40, 16), graphs=(8, 128), buckets=([16, 32, 48], [1, 4, 8]),
                          capture=capture)
        header, meta, flat = _wire(msg, [])
        assert meta == [16, 32, 48, 1, 4, 8] and not flat.numel()
        got, _ = _received(header, meta, flat)
        assert (got.kind, got.paged_pool, got.graphs, got.buckets, got.capture) == \
            ("step_graphs", (40, 16), (8, 128), ([16, 32, 48], [1, 4, 8]), capture)
    step, tokens = _packed_step(), torch.tensor([70, 71, 72])
    for feed in (None, (tokens, [2], [6])):
        msg = StepMessage("step_replay", packed=step, feed=feed)
        got, _ = _received(*_wire(msg, [tokens] if feed else []))
        assert got.kind == "step_replay" and got.packed == step
        if feed is None:
            assert got.feed is None
        else:
            assert torch.equal(got.feed[0], tokens) and got.feed[1:] == ([2], [6])


def test_send_and_receive_over_a_loopback_broadcast(monkeypatch):
    """``_send``'s broadcasts, replayed into ``_receive``: one of FIRST_INTS for a heartbeat, a step and a replay (its
    input ids in the payload, whether host ints or a tensor); a second of the rest for a replay whose block tables
    (meta) or input ids (data) run past it."""
    import runtime.tensor_parallel as tp

    spec = tp.RankSpec(0, 2, torch.device("cpu"), "gloo")
    msg, data = _step_message()
    ids = torch.tensor([11, 12])
    replay = ([4, 9], [68, 9], [[4], [0, 3]])
    n = tp.FIRST_INTS // 3  # past the first broadcast with their meta (3n) alone
    gen = torch.Generator().manual_seed(0)
    long_tables = [torch.randint(0, 40, (2,), generator=gen).tolist() for _ in range(n)]
    long_replay = (list(range(n)), list(range(n)), long_tables)
    long_ids = torch.randint(0, 500, (n,), generator=gen)
    # tables of t blocks: the meta (6 + t) and the first input id fill the first broadcast, the second id is past it
    t = tp.FIRST_INTS - len(HEADER) - 6 - 1
    wide_ids = torch.randint(0, 500, (2,), generator=gen)
    # a step replay: with its fed tokens (the data), and a prompt whose ids, positions and slots alone run past it
    step, fed = _packed_step(), torch.tensor([70, 71, 72])
    m = tp.FIRST_INTS // 2
    long_step = PackedStep(list(range(m)), list(range(m)), list(range(m)), [0, m], [0], [[1] * (m // 16)], [m - 1])
    for sent_msg, sent_data, count in [(StepMessage("heartbeat"), [], 1), (msg, data, 1),
                                       (StepMessage("replay", replay=(ids, *replay)), [ids], 1),
                                       (StepMessage("replay", replay=([11, 12], *replay)), [[11, 12]], 1),
                                       (StepMessage("replay", replay=(long_ids, *long_replay)), [long_ids], 2),
                                       (StepMessage("replay", replay=(wide_ids, [4, 9], [68, 9],
                                                                      [[1] * (t // 2), [2] * (t - t // 2)])),
                                        [wide_ids], 2),
                                       (StepMessage("step_replay", packed=step, feed=(fed, [2], [6])), [fed], 1),
                                       (StepMessage("step_replay", packed=long_step), [], 2)]:
        wire: list[torch.Tensor] = []
        monkeypatch.setattr(tp.dist, "broadcast", lambda t, src: wire.append(t.clone()))
        tp._send(sent_msg, sent_data, spec)
        assert len(wire) == count and wire[0].numel() == tp.FIRST_INTS and all(t.dtype == torch.int64 for t in wire)
        feed = iter(wire)
        monkeypatch.setattr(tp.dist, "broadcast", lambda t, src: t.copy_(next(feed)))
        got, tensors = tp._receive(spec)
        assert got.kind == sent_msg.kind
        if got.kind == "step":
            assert got.seqs == msg.seqs and got.freed == msg.freed
            assert all(torch.equal(tensors[n], t) for (n, _, _), t in zip(msg.tensors, data))
        if got.kind == "replay":
            sent_ids = sent_data[0] if isinstance(sent_data[0], torch.Tensor) else torch.tensor(sent_data[0])
            assert torch.equal(got.replay[0], sent_ids) and got.replay[1:] == sent_msg.replay[1:]
        if got.kind == "step_replay":
            assert got.packed == sent_msg.packed
            assert (got.feed is None) == (sent_msg.feed is None)
            if got.feed is not None:
                assert torch.equal(got.feed[0], fed) and got.feed[1:] == ([2], [6])


def _field(header: list[int], name: str, value: int) -> list[int]:
    return [value if f == name else v for f, v in zip(HEADER, header)]


@pytest.mark.parametrize("name, value, error", [
    ("magic", 1234, r"'magic' is 0x4d2 \(expected 0x54504d31: the ranks' messages are out of step"),
    ("kind", 17, r"'kind' is 17 \(not a message kind: 0\.\.7 for heartbeat, stop, step, graphs, replay, plan, "
                 r"step_graphs, step_replay\)"),
    ("kind", -1, r"'kind' is -1"),
    ("flags", 8, r"'flags' is 8 \(a 'step' message takes bits 1 and 2\)"),
    ("num_seqs", -3, r"'num_seqs' is -3 \(must be in 0\.\.134217728\)"),
    ("data_len", 1 << 40, r"'data_len' is 1099511627776 \(must be in 0\.\.134217728\)"),
    ("num_tensors", 9, r"'num_tensors' is 9 \(a step packs at most 8 tensors\)"),
    ("num_seqs", 100, r"'meta_len' is \d+ \(its tensor, sequence and freed-cache records alone take \d+\)"),
])
def test_a_malformed_header_is_refused_naming_the_field(name, value, error):
    header, _, _ = _wire(*_step_message())
    with pytest.raises(StepMessageError, match=r"malformed message from tensor-parallel rank 0: header field " + error):
        _check_header(_field(header, name, value))


def test_malformed_headers_of_each_kind_and_payloads_that_disagree_with_them():
    stop, _, _ = _wire(StepMessage("stop"), [])
    with pytest.raises(StepMessageError, match=r"'meta_len' is 4 \(a 'stop' message has no payload\)"):
        _check_header(_field(stop, "meta_len", 4))
    with pytest.raises(StepMessageError, match=r"'flags' is 1 \(a 'stop' message takes none\)"):
        _check_header(_field(stop, "flags", 1))
    graphs, _, _ = _wire(StepMessage("graphs", paged_pool=(40, 16), graphs=(8, 128)), [])
    with pytest.raises(StepMessageError, match=r"'max_num_seqs' is 0 \(a 'graphs' message needs it >= 1\)"):
        _check_header(_field(graphs, "max_num_seqs", 0))
    plan, _, _ = _wire(StepMessage("plan", plan=(0.9, None, None, 16)), [])
    with pytest.raises(StepMessageError, match=r"'gpu_memory_utilization' is 0\.0 \(must be in \(0, 1\]\)"):
        _check_header(_field(plan, "gpu_memory_utilization", 0))
    with pytest.raises(StepMessageError, match=r"'num_blocks' is -5 \(-1 \(not given\) or >= 1\)"):
        _check_header(_field(plan, "num_blocks", -5))
    ids = torch.tensor([1])
    replay, meta, flat = _wire(StepMessage("replay", replay=(ids, [0], [0], [[0]])), [ids])
    with pytest.raises(StepMessageError, match=r"'num_seqs', 'data_len', 'meta_len' is \(2, 1, 4\)"):
        _check_header(_field(replay, "num_seqs", 2))

    msg, data = _step_message()
    header, meta, flat = _wire(msg, data)
    bad = list(meta)
    bad[0] = 42  # the first tensor record's name index
    with pytest.raises(StepMessageError, match=r"tensor record 0's name index is 42 \(must be in 0\.\.7\)"):
        _received(header, bad, flat)
    bad = list(meta)
    bad[-1] = 16  # the last block of the last paged table: past the pool of 16 blocks
    with pytest.raises(StepMessageError, match=r"a block of sequence 1's table is 16 \(must be in 0\.\.15\)"):
        _received(header, bad, flat)
    bad = list(meta)
    bad[5 * 5 + 2] = 7  # the first sequence record's kv kind
    with pytest.raises(StepMessageError, match=r"sequence 0's kv kind is 7 \(0 \(paged\) or 1 \(contiguous"):
        _received(header, bad, flat)
    with pytest.raises(StepMessageError, match=r"'data_len' is 15 \(the step's tensors hold 16 values\)"):
        _received(_field(header, "data_len", 15), meta, flat[:15])
    with pytest.raises(StepMessageError, match=r"the payload's sequence 1's block table is past its end \(44 meta"):
        _received(_field(header, "meta_len", len(meta) - 1), meta[:-1], flat)


def _fed_replay() -> tuple[list[int], list[int], torch.Tensor]:
    step, tokens = _packed_step(), torch.tensor([70, 71, 72])
    return _wire(StepMessage("step_replay", packed=step, feed=(tokens, [2], [6])), [tokens])


def _meta_field(meta: list[int], at: int, value: int) -> list[int]:
    return [value if i == at else v for i, v in enumerate(meta)]


def test_malformed_step_graphs_and_step_replay_messages_are_refused_naming_the_field():
    header, meta, flat = _wire(StepMessage("step_graphs", paged_pool=(40, 16), graphs=(8, 128),
                                           buckets=([16, 32], [1, 4, 8]), capture=True), [])
    with pytest.raises(StepMessageError, match=r"'flags' is 1 \(a 'step_graphs' message takes bit 4\)"):
        _check_header(_field(header, "flags", 1))
    with pytest.raises(StepMessageError, match=r"'num_seqs' is 0 \(a 'step_graphs' message needs it >= 1\)"):
        _check_header(_field(header, "num_seqs", 0))
    with pytest.raises(StepMessageError, match=r"'meta_len', 'data_len' is \(5, 1\) \(a 'step_graphs' message has "
                                               r"its 2 token and 3 sequence buckets in its meta, and no data\)"):
        _check_header(_field(header, "data_len", 1))
    with pytest.raises(StepMessageError, match=r"the token buckets is \[32, 16\] \(must increase strictly\)"):
        _received(header, [32, 16, 1, 4, 8], flat)
    with pytest.raises(StepMessageError, match=r"one of the sequence buckets is 0 \(must be in 1\.\.134217728\)"):
        _received(header, [16, 32, 0, 4, 8], flat)
    with pytest.raises(StepMessageError, match=r"the largest sequence bucket is 16 \(must be min\(max_num_seqs 8, the "
                                               r"largest token bucket 32\) = 8\)"):
        _received(header, [16, 32, 1, 4, 16], flat)

    header, meta, flat = _fed_replay()
    assert _received(header, meta, flat)[0].packed == _packed_step()
    with pytest.raises(StepMessageError, match=r"'num_tokens', 'num_seqs' is \(0, 3\) \(a step replay has at least "
                                               r"one token and one sequence\)"):
        _check_header(_field(header, "num_tokens", 0))
    with pytest.raises(StepMessageError, match=r"'num_fed', 'data_len' is \(0, 3\) \(fed rows take their tokens from "
                                               r"the data, and only they do"):
        _check_header(_field(header, "num_fed", 0))
    with pytest.raises(StepMessageError, match=r"'meta_len' is 20 \(a step replay's records before its block tables "
                                               r"alone take 36\)"):
        _check_header(_field(header, "meta_len", 20))
    # meta: ids [0, 7), positions [7, 14), slots [14, 21), cu_seqlens_q [21, 25), context lengths [25, 28), table
    # lengths [28, 31), logits rows [31, 34), fed row 34, fed target 35, tables [36, 41)
    for at, value, error in [
        (22, 8, r"a step replay's cu_seqlens_q is \[0, 8, 6, 7\] \(must rise from 0 to its 7 tokens, never falling\)"),
        (24, 6, r"a step replay's cu_seqlens_q is \[0, 5, 6, 6\] \(must rise from 0 to its 7 tokens"),
        (8, -1, r"a step replay's position is -1 \(must be in 0\.\.134217727\)"),
        (33, 7, r"a step replay's logits row is 7 \(must be in 0\.\.6\)"),
        (34, 3, r"a step replay's fed row \(an index into its data's fed tokens\) is 3 \(must be in 0\.\.2\)"),
        (35, 7, r"a step replay's fed target \(a packed row\) is 7 \(must be in 0\.\.6\)"),
        (28, 3, r"the payload's sequence 2's block table is past its end \(41 meta ints\)"),
    ]:
        with pytest.raises(StepMessageError, match=error):
            _received(header, _meta_field(meta, at, value), flat)
    with pytest.raises(StepMessageError, match=r"'meta_len' is 41 \(the 'step_replay' message's records take 40\)"):
        _received(header, _meta_field(meta, 28, 1), flat)


def _worker_state(no_logits: bool = True) -> _WorkerState:
    """A worker's state over a CPU pool of 16 blocks of 4 tokens, as rank 0's 'step_graphs' message left it (the
    padded steps eager: no executor runs in these checks)."""
    state = _WorkerState.__new__(_WorkerState)
    state.executor, state.spec = None, None
    state.storage = PagedKVStorage(KVLayout(num_kv_heads=[1], head_dim=[8], dtype=torch.float32), 16, 4, "cpu")
    state.graphs = state.step_graphs = None
    state.no_logits, state.vocab_size = no_logits, 100
    return state


def test_a_worker_captures_rank_0s_step_buckets_and_checks_each_replay_against_them_and_its_pool():
    rank0 = StepGraphs(None, _worker_state().storage, 24, 6, 32, token_buckets=(8, 16), capture=False)
    msg = StepMessage("step_graphs", paged_pool=(16, 4), graphs=(6, 32),
                      buckets=(rank0.token_buckets, rank0.seq_buckets), capture=False)
    msg, _ = _received(*_wire(msg, []))
    for no_logits in (True, False):  # a replicated lm_head: no logits rows; vocab-parallel: every rank gathers them
        state = _worker_state(no_logits)
        with pytest.raises(StepMessageError, match="a 'step_replay' message before any 'step_graphs' message"):
            state.step_replay(StepMessage("step_replay", packed=_packed_step()))
        storage = state.storage
        state.capture_step_graphs(msg)
        graphs = state.step_graphs
        assert state.storage is storage  # the same pool: kept
        assert (graphs.token_buckets, graphs.seq_buckets) == (rank0.token_buckets, rank0.seq_buckets) == \
            ([8, 16, 24], [1, 4, 6])
        assert graphs.wants_logits is not no_logits and graphs.max_blocks == 8

    ran = []
    state.step_graphs.run = lambda step, feed: ran.append((step, feed))
    tables = [[2, 3, 12, 13, 14, 15], [4], [1, 5, 6, 7, 8, 9, 10, 11]]  # blocks of 4 tokens: 21, 4 and 31 tokens
    good = PackedStep(**{**_packed_step().__dict__, "block_tables": tables, "slots": [56, 57, 58, 59, 60, 19, 46]})
    feed = (torch.tensor([70, 71, 72]), [2], [6])
    state.step_replay(StepMessage("step_replay", packed=good, feed=feed))
    assert ran == [(good, feed)]

    def bad(**fields) -> StepMessage:
        step = PackedStep(**{**good.__dict__, **fields})
        return StepMessage("step_replay", packed=step)

    for msg, error in [
        (bad(input_ids=list(range(30)), positions=[0] * 30, slots=[0] * 30, cu_seqlens_q=[0, 28, 29, 30]),
         r"a step replay's \(num_tokens, num_seqs, num_rows\) is \(30, 3, 3\) \(no captured bucket holds it: token "
         r"buckets \[8, 16, 24\], sequence buckets \[1, 4, 6\]"),
        (bad(logits_rows=[0] * 7), r"is \(7, 3, 7\) \(no captured bucket holds it"),
        (bad(input_ids=[9, 8, 7, 6, 5, 100, 0]), r"a step replay's input id is 100 \(must be in 0\.\.99\)"),
        (bad(positions=[16, 17, 18, 19, 20, 3, 32]), r"a step replay's position is 32 \(must be in 0\.\.31\)"),
        (bad(slots=[56, 57, 58, 59, 64, 19, 46]), r"a step replay's slot is 64 \(must be in 0\.\.63\)"),
        (bad(block_tables=[[2, 3, 12, 13, 14, 15], [16], [1]]),
         r"a block of a step replay's sequence 1's table is 16 \(must be in 0\.\.15\)"),
        (bad(block_tables=[[2, 3, 12, 13, 14, 15], [4], [0] * 9]),
         r"a step replay's sequence 2's block table length is 9 \(must be in 0\.\.8\)"),
        (bad(block_tables=[[2, 3, 12, 13], [4], [1]]),
         r"a step replay's sequence 0's length \(context \+ new tokens\) is 21 \(its table of 4 blocks holds 16 "
         r"tokens\)"),
    ]:
        with pytest.raises(StepMessageError, match=error):
            state.step_replay(msg)
    assert len(ran) == 1


def test_a_worker_takes_longrope_offset_positions_and_checks_them_without_the_offset():
    """With LongRoPE (the worker's executor has a switch), a step replay's positions may carry LONG_ROPE_OFFSET (a
    sequence on the second rotary table): the worker checks them without it against its pool, and refuses a position
    past one offset."""
    from types import SimpleNamespace

    from runtime.executor import LONG_ROPE_OFFSET

    rank0 = StepGraphs(None, _worker_state().storage, 24, 6, 32, token_buckets=(8, 16), capture=False)
    msg, _ = _received(*_wire(StepMessage("step_graphs", paged_pool=(16, 4), graphs=(6, 32),
                                          buckets=(rank0.token_buckets, rank0.seq_buckets), capture=False), []))
    state = _worker_state()
    state.executor = SimpleNamespace(long_rope_from=16)
    state.capture_step_graphs(msg)
    ran = []
    state.step_graphs.run = lambda step, feed: ran.append(step)
    tables = [[2, 3, 12, 13, 14, 15], [4], [1, 5, 6, 7, 8, 9, 10, 11]]
    good = PackedStep(**{**_packed_step().__dict__, "block_tables": tables, "slots": [56, 57, 58, 59, 60, 19, 46]})
    offset = PackedStep(**{**good.__dict__, "positions": [p + LONG_ROPE_OFFSET for p in good.positions]})
    state.step_replay(StepMessage("step_replay", packed=offset))
    assert ran == [offset]
    for positions, error in [([LONG_ROPE_OFFSET + 32] + good.positions[1:], r"a step replay's position is 32 "),
                             ([2 * LONG_ROPE_OFFSET] + good.positions[1:],
                              r"a step replay's position \(with LongRoPE's offset\) is 33554432")]:
        with pytest.raises(StepMessageError, match=error):
            state.step_replay(StepMessage("step_replay", packed=PackedStep(**{**good.__dict__,
                                                                               "positions": positions})))


def test_a_worker_sent_a_malformed_header_exits_and_the_engine_fails(built):
    import torch.distributed as dist

    with loaded(built[("bf16", 2)]) as engine:
        assert engine.generate("def", SamplingParams(max_tokens=2)).token_ids
        header, _, _ = _wire(StepMessage("heartbeat"), [])
        bad = torch.zeros(FIRST_INTS, dtype=torch.int64)  # a message's first broadcast, its header's kind unknown
        bad[:len(header)] = torch.tensor(_field(header, "kind", 99))
        engine.executor.locked(lambda: dist.broadcast(bad, src=0), "a malformed message")
        deadline = time.monotonic() + 30
        while engine.executor.failure is None and time.monotonic() < deadline:  # the sentinel thread sees it exit
            time.sleep(0.02)
        # its log: "tensor-parallel rank 1: malformed message from tensor-parallel rank 0: header field 'kind' is 99
        # (not a message kind: 0..7 for heartbeat, stop, step, graphs, replay, plan, step_graphs, step_replay); exiting"
        with pytest.raises(WorkerFailure, match=r"worker rank 1 \(pid \d+\) exited with exit code 1"):
            engine.generate("def", SamplingParams(max_tokens=2))


# --- the memory plan across ranks ------------------------------------------------------------------
def _plan(num_blocks: int) -> object:
    layout = KVLayout(num_kv_heads=[1, 1], head_dim=[8, 8], dtype=torch.float32)
    per_block = layout.bytes_per_token() * 16
    return plan_kv_blocks(device="cpu", budget_bytes=num_blocks * per_block, weights_bytes=0, workspace_bytes=0,
                          other_bytes=0, layout=layout, block_size=16, max_seq_len=128)


def test_the_least_of_the_ranks_block_counts_sizes_every_pool():
    plan = _plan(40)
    assert least_kv_blocks(plan, [40, 40]).num_blocks == 40
    least = least_kv_blocks(plan, [40, 25, 31])
    assert (least.num_blocks, least.rank_num_blocks, least.budget_bytes) == (25, (40, 25, 31), plan.budget_bytes)
    assert "the least of the ranks' [40, 25, 31] blocks" in least.describe()
    with pytest.raises(MemoryPlanError, match=r"tensor-parallel rank 2 has room for 5 KV blocks of 16 tokens \(rank 0: "
                                              r"40\) but one request of max_seq_len 128 needs 8"):
        least_kv_blocks(plan, [40, 12, 5, 5])


# --- torchrun across nodes -------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_over_two_nodes_matches_one_rank_and_plans_the_least_memory(built, tmp_path):
    """Two torchrun launchers, one per "node" (--nnodes 2 --node-rank 0/1, gloo over 127.0.0.1), serve the
    TP=2 artifact: rank 0's greedy tokens (offline and served) are the TP=1 artifact's; rank 1 runs the
    worker side of ``torchrun ... -m runtime.serve ARTIFACT`` and, given less room for KV blocks than rank 0,
    sizes every rank's pool, or stops a plan that cannot hold a request; no rank broadcasts a Python object."""
    import subprocess
    import sys

    script = tmp_path / "node.py"
    script.write_text(f"""
import json, os
import torch.distributed as dist

def forbidden(*args, **kwargs):
    raise AssertionError("a Python object was broadcast")

dist.broadcast_object_list = forbidden  # the step messages are int64 tensors only
from runtime import Engine, SamplingParams
from runtime.memory import MemoryPlanError
from runtime.serving import ServingConfig, ServingEngine
import runtime.tensor_parallel as tp

if __name__ == "__main__":
    print("NODE", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"], flush=True)
    if os.environ["RANK"] == "1":  # this rank has room for fewer KV blocks than rank 0, then for too few
        figures = iter([12, 3])
        tp._WorkerState.kv_blocks = lambda self, msg: next(figures)
        from runtime.serve import main
        raise SystemExit(main([{str(built[("gptq", 2)])!r}, "--device", "cpu"]))  # runs steps until rank 0 stops
    engine = Engine.load({str(built[("gptq", 2)])!r})
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = {{"rank": os.environ["RANK"], "local": os.environ["LOCAL_RANK"],
            "tokens": engine.generate({PROMPTS[0]!r}, params).token_ids}}
    serving = ServingEngine(engine, ServingConfig(num_blocks=32, max_num_seqs=2))
    out["plan"] = [serving.memory_plan.num_blocks, list(serving.memory_plan.rank_num_blocks)]
    out["served"] = [o.token_ids for o in serving.run([engine.tokenizer.encode(p) for p in {PROMPTS!r}], params)]
    try:
        ServingEngine(engine, ServingConfig(num_blocks=32, max_num_seqs=2))
    except MemoryPlanError as e:
        out["error"] = str(e)
    print("RESULT", json.dumps(out))
    engine.close()
""")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:  # a launcher still waiting (a failed peer): its whole session, the ranks included
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    # one process per node, global ranks 0 and 1, each its node's local rank 0; rank 1 only served steps
    assert [[x for x in out.splitlines() if x.startswith(("NODE", "RESULT"))][0] for out, _ in outs] == \
        ["NODE 0 0 0", "NODE 1 0 1"]
    assert not [x for x in outs[1][0].splitlines() if x.startswith("RESULT")]
    (line,) = [x for x in outs[0][0].splitlines() if x.startswith("RESULT")]
    out = json.loads(line.removeprefix("RESULT "))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with loaded(built[("gptq", 1)]) as one:
        ref = [one.generate(p, params).token_ids for p in PROMPTS]
    assert (out["rank"], out["local"], out["tokens"], out["served"]) == ("0", "0", ref[0], ref)
    assert out["plan"] == [12, [32, 12]]
    assert "tensor-parallel rank 1 has room for 3 KV blocks of 16 tokens (rank 0: 32)" in out["error"]


# --- a rank that dies while rank 0's GPU waits in a step ----------------------------------------------
class _NeverDone:
    """A CUDA event of a step whose collectives wait for a dead rank: never done."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return False

    def synchronize(self) -> None:
        raise AssertionError("a blocking wait would never return")


def test_a_wait_for_a_step_raises_the_engine_failure_instead_of_waiting_forever():
    from runtime.serving import wait_for_device

    event, polls = _NeverDone(), []
    failure = WorkerFailure("tensor-parallel worker rank 1 (pid 7) exited with signal SIGKILL")

    def seen() -> WorkerFailure | None:
        polls.append(1)
        return failure if len(polls) > 3 else None  # the sentinel thread marks the engine failed a moment later

    with pytest.raises(WorkerFailure, match="rank 1"):
        wait_for_device(event, seen)
    assert event.queries == 4 and len(polls) == 4


def test_a_wait_without_a_failure_to_poll_blocks_and_one_that_finishes_returns():
    from runtime.serving import wait_for_device

    class Done:
        synchronized = False

        def __init__(self, after: int) -> None:
            self.left = after

        def query(self) -> bool:
            self.left -= 1
            return self.left < 0

        def synchronize(self) -> None:
            self.synchronized = True

    plain = Done(0)
    wait_for_device(plain, None)  # one rank: a plain synchronize
    assert plain.synchronized
    polled = Done(5)
    wait_for_device(polled, lambda: None)
    assert polled.left == -1 and not polled.synchronized

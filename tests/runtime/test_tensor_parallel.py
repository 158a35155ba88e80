"""Tensor parallelism on CPU: a TP=2 artifact run by two gloo ranks (this process and a spawned worker)
against the TP=1 artifact of the same checkpoint, for bf16 and GPTQ 4-bit; the manifest; a killed worker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from builder.pipeline import build
from builder.recipe import validate_recipe
from runtime import Engine, SamplingParams
from runtime.artifact import ArtifactError, open_artifact
from runtime.serving import ServingConfig, ServingEngine
from runtime.tensor_parallel import WorkerFailure, check_devices

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
            assert time.monotonic() - start < 1

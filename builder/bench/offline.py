"""Latency and throughput benchmarks of an artifact on the runtime (``builder bench latency|throughput``).

    latency     batch-1: time to first token for a prompt of --input-len random tokens, then decode
                tokens/s over --output-len tokens, and that as a share of the memory-bandwidth roofline:
                each decode step reads every weight once plus the KV cache so far, so
                roofline tok/s = measured bandwidth / (weight bytes + mean KV bytes per step);
                the bandwidth is measured in the same run (a device-to-device copy).
    throughput  --num-prompts requests of --input-len random tokens, --output-len tokens each (EOS
                ignored), all submitted at once to the serving engine with max_num_seqs = --concurrency;
                output tokens/s from the first admission to the last token.

Prompts are random token ids (speed does not depend on the text). Figures are printed and returned as a
dict (``--json`` writes them too); nothing here asserts a target.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from runtime.memory import tensor_bytes
from runtime.sampling import SamplingParams
from runtime.serving import ServingConfig, ServingEngine


@dataclass
class LatencyResult:
    device: str
    input_len: int
    output_len: int
    ttft_ms: float  # median over repeats
    decode_tok_s: float  # median over repeats, batch 1
    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth_gb_s: float  # measured device-to-device copy
    roofline_tok_s: float
    roofline_pct: float
    peak_memory_gib: float


@dataclass
class ThroughputResult:
    device: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    output_tok_s: float
    total_tok_s: float  # (input + output) tokens / s
    elapsed_s: float
    num_preemptions: int
    peak_memory_gib: float
    num_steps: int = 0
    decode_steps: int = 0  # steps that left a CUDA-graph decode step in flight (the overlapped pipeline)
    decode_s: float = 0.0  # wall time inside those steps
    other_s: float = 0.0  # wall time inside every other step (prefill-bearing, draining, eager)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of ``repeats``."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def _random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=g).tolist()


def latency(engine: ServingEngine, input_len: int = 128, output_len: int = 128, repeats: int = 3,
            seed: int = 0) -> LatencyResult:
    device = engine.device
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    prompt = _random_prompts(1, input_len, vocab, seed)[0]
    engine.run([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up (compiles, autotunes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ttfts, rates = [], []
    for r in range(repeats):
        engine.kv.pool.reset_prefix_cache()  # every repeat prefills from scratch
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True), request_id=f"lat{r}")
        _sync(device)
        t0 = time.perf_counter()
        t_first, n = None, 0
        while engine.has_unfinished:
            for out in engine.step():
                n += len(out.token_ids)
                if t_first is None and out.token_ids:
                    _sync(device)
                    t_first = time.perf_counter()
        _sync(device)
        t_end = time.perf_counter()
        ttfts.append((t_first - t0) * 1e3)
        rates.append((n - 1) / (t_end - t_first))
    weights = tensor_bytes(engine.executor.params.values())
    kv_per_token = engine.engine.kv_layout.bytes_per_token()
    bandwidth = measure_bandwidth(device)
    mean_context = input_len + output_len / 2
    roofline = bandwidth / (weights + kv_per_token * mean_context)
    decode = statistics.median(rates)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return LatencyResult(str(device), input_len, output_len, statistics.median(ttfts), decode, weights,
                         kv_per_token, bandwidth / 1e9, roofline, 100 * decode / roofline, peak)


def throughput(engine: ServingEngine, input_len: int, output_len: int, num_prompts: int,
               seed: int = 0) -> ThroughputResult:
    device = engine.device
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    prompts = _random_prompts(num_prompts, input_len, vocab, seed)
    # warm up with a full wave of other prompts: Triton compiles a kernel once per specialisation (argument
    # divisibility), and the prefill chunks of a wave reach shapes a single prompt does not
    concurrency = engine.scheduler_config.max_num_seqs
    engine.run(_random_prompts(concurrency, input_len, vocab, seed + 1), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.pool.reset_prefix_cache()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    preempted = engine.scheduler.num_preemptions
    steps = engine.num_steps
    split = {"decode": [0, 0.0], "other": [0, 0.0]}
    step = engine.step

    def timed_step():  # where the wall time goes: overlapped decode steps vs the rest
        t = time.perf_counter()
        out = step()
        kind = "decode" if engine._inflight is not None else "other"
        split[kind][0] += 1
        split[kind][1] += time.perf_counter() - t
        return out

    engine.step = timed_step
    _sync(device)
    t0 = time.perf_counter()
    try:
        outs = engine.run(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    finally:
        del engine.step
    _sync(device)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return ThroughputResult(str(device), input_len, output_len, num_prompts, engine.scheduler_config.max_num_seqs,
                            generated / elapsed, (generated + input_len * num_prompts) / elapsed, elapsed,
                            engine.scheduler.num_preemptions - preempted, peak, engine.num_steps - steps,
                            split["decode"][0], split["decode"][1], split["other"][1])


def load_for_bench(artifact: str, device: str, *, max_num_seqs: int, max_seq_len: int | None,
                   max_num_batched_tokens: int | None, cuda_graphs: bool, check_hashes: bool = False,
                   gpu_memory_utilization: float = 0.9) -> ServingEngine:
    config = ServingConfig(max_num_seqs=max_num_seqs, max_seq_len=max_seq_len,
                           max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs,
                           max_waiting=1 << 20, gpu_memory_utilization=gpu_memory_utilization)
    return ServingEngine.load(artifact, device, config, check_hashes=check_hashes, allow_failed_gate=True)


def report(results: list, path: str | None = None) -> None:
    rows = [asdict(r) for r in results]
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

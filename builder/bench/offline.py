"""Latency and throughput benchmarks of an artifact on the runtime (``builder bench latency|throughput``).

    latency     batch-1: time to first token for a prompt of --input-len random tokens, then decode
                tokens/s over --output-len tokens, and that as a share of the memory-bandwidth roofline:
                each decode step reads every weight once plus the KV cache so far, so
                roofline tok/s = measured bandwidth / (weight bytes + mean KV bytes per step);
                of a mixture of experts, the token's top_k experts' weights only (decode_weight_bytes);
                the bandwidth is measured in the same run (a device-to-device copy).
    decode step  batch N (``bench latency --batch-size N``): N prompts of --input-len random tokens admitted
                together, then decoded together for --output-len steps (greedy, EOS ignored); the median wall
                time of one decode step of all N over the steady-state steps (prefill and the first decode
                step left out), and N / that as tokens/s.
    throughput  --num-prompts requests of --input-len random tokens, --output-len tokens each (EOS
                ignored), all submitted at once to the serving engine with max_num_seqs = --concurrency;
                output tokens/s from the first admission to the last token.

Prompts are random token ids (speed does not depend on the text). Figures are printed and returned as a
dict (``--json`` writes them too); nothing here asserts a target.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from runtime.memory import tensor_bytes
from runtime.outputs import RequestOutput
from runtime.sampling import SamplingParams
from runtime.serving import ServingConfig, ServingEngine


@dataclass
class LatencyResult:
    device: str
    input_len: int
    output_len: int
    ttft_ms: float  # median over repeats
    decode_tok_s: float  # median over repeats, batch 1
    weight_bytes: int  # read by one decode step (decode_weight_bytes)
    kv_bytes_per_token: int
    bandwidth_gb_s: float  # measured device-to-device copy
    roofline_tok_s: float
    roofline_pct: float
    peak_memory_gib: float


@dataclass
class DecodeStepResult:
    device: str
    batch_size: int  # sequences decoded together in every measured step
    input_len: int
    output_len: int
    decode_step_ms: float  # median wall time of one decode step over the steady-state steps of every repeat
    tok_s: float  # batch_size tokens per decode_step_ms
    num_steps: int  # steady-state steps the median is over
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
    # steps that left a step in flight (the overlapped pipeline: CUDA-graph decode steps and, since the pipeline
    # takes prompts too, prefill-bearing steps; the name is kept for the JSON's readers)
    decode_steps: int = 0
    decode_s: float = 0.0  # wall time inside those steps
    other_s: float = 0.0  # wall time inside every other step (synchronous: draining, preemption, logprobs)
    # speculative decoding (0 when off): draft tokens proposed and accepted, and decodes verified with drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verified: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepTiming:
    """One ``engine.step()`` call, on the host's clock (``time.perf_counter``)."""

    start: float
    end: float
    overlapped: bool  # it left a CUDA-graph decode step in flight (the overlapped pipeline)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@contextlib.contextmanager
def timed_steps(engine: ServingEngine) -> Iterator[list[StepTiming]]:
    """Time every ``engine.step()`` call made inside the block, whoever makes it (``engine.run`` included);
    yields the list the timings are appended to.

    NOTE: a step call returns once its tokens are on the host (the CPU path and the eager CUDA path copy
    them synchronously; an overlapped call waits on the CUDA event of the step it reads back), so the
    time between two calls' ends is the time between two steps' results, GPU work included."""
    timings: list[StepTiming] = []
    step = engine.step
    wrapped = "step" in vars(engine)  # another wrapper's (builder.bench.structured.host_stages): put it back

    def timed_step() -> list[RequestOutput]:
        start = time.perf_counter()
        out = step()
        timings.append(StepTiming(start, time.perf_counter(), engine._inflight is not None))
        return out

    engine.step = timed_step
    try:
        yield timings
    finally:
        if wrapped:
            engine.step = step
        else:
            del engine.step


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


# A moe node's weights stacked per expert [num_experts, ...], of which a token reads its top_k experts' rows; the
# router (gate_weight, gate_bias) is read whole. FP8 experts' per-channel scales, and W4A16 experts' group scales and
# zero points, are stacked per expert too.
EXPERT_ROLES = ("w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale", "w_gate_up_scales", "w_gate_up_zeros",
                "w_down_scales", "w_down_zeros")


def decode_weight_bytes(graph: dict[str, Any], params: dict[str, torch.Tensor]) -> int:
    """The weight bytes one batch-1 decode step reads: every weight once (the embedding table and the lm_head
    whole, as the dense figures have always counted them), except the experts of a mixture of experts, of which
    the token's top_k only: top_k / num_experts of each stacked expert tensor."""
    total = tensor_bytes(params.values())
    for node in graph["nodes"]:
        if node["op"] != "moe":
            continue
        num_experts, top_k = node["attrs"]["num_experts"], node["attrs"]["top_k"]
        for role in (r for r in EXPERT_ROLES if r in node["weights"]):
            t = params[node["weights"][role]]
            assert t.shape[0] == num_experts, f"{node['weights'][role]}: {tuple(t.shape)} is not stacked per expert"
            total -= tensor_bytes([t]) // num_experts * (num_experts - top_k)
    return total


def check_lengths(engine: ServingEngine, input_len: int, output_len: int) -> None:
    """Refuse (RequestError) prompts and outputs that do not fit the engine's max_seq_len together: the requests
    would stop early at the context's end, and the figures, named after ``output_len``, would be of fewer tokens."""
    from runtime.engine import RequestError

    limit = engine.scheduler_config.max_seq_len
    if input_len + output_len > limit:
        raise RequestError(f"the prompt has {input_len} tokens and {output_len} are to be generated: "
                           f"{input_len + output_len} is past max_seq_len {limit}; the requests would stop early, "
                           f"so lower --input-len or --output-len (or raise --max-seq-len up to the artifact's)")


def latency(engine: ServingEngine, input_len: int = 128, output_len: int = 128, repeats: int = 3,
            seed: int = 0) -> LatencyResult:
    check_lengths(engine, input_len, output_len)
    if output_len < 2:
        raise ValueError(f"output_len {output_len}: a decode rate needs at least 2 tokens (the first is the prefill's)")
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
                if t_first is None and out.token_ids:  # on the host now (the step after it may be in flight)
                    t_first = time.perf_counter()
        _sync(device)
        t_end = time.perf_counter()
        ttfts.append((t_first - t0) * 1e3)
        rates.append((n - 1) / (t_end - t_first))
    weights = decode_weight_bytes(engine.executor.graph, engine.executor.params)
    kv_per_token = engine.engine.kv_layout.bytes_per_token()
    bandwidth = measure_bandwidth(device)
    mean_context = input_len + output_len / 2
    roofline = bandwidth / (weights + kv_per_token * mean_context)
    decode = statistics.median(rates)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return LatencyResult(str(device), input_len, output_len, statistics.median(ttfts), decode, weights,
                         kv_per_token, bandwidth / 1e9, roofline, 100 * decode / roofline, peak)


def steady_step_seconds(calls: list[tuple[float, list[RequestOutput]]], num_seqs: int) -> list[float]:
    """The wall time of every steady-state decode step among ``calls``: (end time, outputs) of each
    ``step()`` call, in order, of ``num_seqs`` requests decoded together and nothing else.

    A call is a full decode call when it hands every request exactly one token, finishes none, and each
    request had its first token (the prefill's) before it. A step's time is the time between the ends of
    two consecutive full decode calls, so the prefill steps, chunked or mixed steps, the first decode step
    (the first full call has no full call before it) and the finishing call are all left out:

        call      prefill  launch  decode 1  decode 2  decode 3  ...  last (finishes)
        tokens    1 each   none    2nd each  3rd each  4th each       last each
        measured  -        -       -         yes       yes            -

    (the call that only launches the first CUDA-graph step exists with the overlapped pipeline alone)."""
    seconds: list[float] = []
    num_tokens: Counter[str] = Counter()  # tokens each request had before the call
    previous_end: float | None = None  # end of the call before, when that was a full decode call
    for end, outputs in calls:
        got: Counter[str] = Counter()
        for o in outputs:
            got[o.request_id] += len(o.token_ids)
        full = (len(got) == num_seqs and set(got.values()) == {1} and not any(o.finished for o in outputs)
                and all(num_tokens[r] >= 1 for r in got))
        if full and previous_end is not None:
            seconds.append(end - previous_end)
        previous_end = end if full else None
        num_tokens.update(got)
    return seconds


def decode_steps(engine: ServingEngine, batch_size: int, input_len: int = 128, output_len: int = 128,
                 repeats: int = 3, seed: int = 0) -> DecodeStepResult:
    """Decode step time at ``batch_size``: that many random prompts are admitted together (all added before
    the first step), prefilled, then decoded together for ``output_len`` tokens (greedy, EOS ignored); the
    figure is the median over every repeat's steady-state steps (see ``steady_step_seconds``).

    The engine's max_num_seqs must be at least ``batch_size``: on CUDA every measured step is then one
    replay of the decode graph of the smallest captured bucket >= ``batch_size``."""
    max_num_seqs = engine.scheduler_config.max_num_seqs
    if not 1 <= batch_size <= max_num_seqs:
        raise ValueError(f"batch size {batch_size} is not in [1, max_num_seqs {max_num_seqs}]: the sequences "
                         f"would not decode in one step")
    if output_len < 4:
        raise ValueError(f"output_len {output_len}: a decode step figure needs at least 4 tokens (the prefill's, "
                         f"the first decode step's, a steady-state step's and the last, which is not timed)")
    check_lengths(engine, input_len, output_len)
    device = engine.device
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    prompts = _random_prompts(batch_size, input_len, vocab, seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    # warm up at this batch size: the prefill of batch_size prompts and this bucket's decode (compiles, autotunes)
    engine.run(_random_prompts(batch_size, input_len, vocab, seed + 1), SamplingParams(max_tokens=4, ignore_eos=True))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds: list[float] = []
    for r in range(repeats):
        engine.kv.pool.reset_prefix_cache()  # every repeat prefills from scratch
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"step-b{batch_size}-{r}-{i}")
        outputs: list[list[RequestOutput]] = []
        _sync(device)
        with timed_steps(engine) as timings:
            while engine.has_unfinished:
                outputs.append(engine.step())
        _sync(device)
        seconds += steady_step_seconds([(t.end, o) for t, o in zip(timings, outputs)], batch_size)
    if not seconds:
        raise RuntimeError(f"no decode step of all {batch_size} sequences together was measured (preempted? "
                           f"{engine.scheduler.num_preemptions} preemptions so far)")
    step = statistics.median(seconds)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return DecodeStepResult(str(device), batch_size, input_len, output_len, step * 1e3, batch_size / step,
                            len(seconds), peak)


def step_table(results: list[DecodeStepResult], baseline_ms: dict[tuple[int, int], float] | None = None) -> str:
    """Decode step figures as a text table, one block per prompt length; ``baseline_ms``: the stock-PyTorch
    baseline's ms per step by (batch_size, input_len). ratio = baseline ms / ours (above 1: ours is faster,
    the same sense as the batch-1 ratio of tokens/s)."""
    baseline_ms = baseline_ms or {}
    lines = []
    for input_len in dict.fromkeys(r.input_len for r in results):
        rows = [r for r in results if r.input_len == input_len]
        lines += [f"decode step, {input_len}-token prompts, {rows[0].output_len} tokens out "
                  f"(median over steady-state steps)",
                  f"{'batch':>5}  {'ms/step':>9}  {'tok/s':>9}  {'baseline ms/step':>16}  {'ratio':>6}"]
        for r in rows:
            base = baseline_ms.get((r.batch_size, input_len))
            lines.append(f"{r.batch_size:>5}  {r.decode_step_ms:>9.3f}  {r.tok_s:>9.1f}  "
                         + (f"{base:>16.3f}  {base / r.decode_step_ms:>6.2f}" if base else f"{'-':>16}  {'-':>6}"))
    return "\n".join(lines)


def throughput(engine: ServingEngine, input_len: int, output_len: int, num_prompts: int,
               seed: int = 0) -> ThroughputResult:
    check_lengths(engine, input_len, output_len)
    concurrency, pool, block = engine.scheduler_config.max_num_seqs, engine.kv.pool.num_blocks, engine.kv.block_size
    reachable = pool // -(-(input_len + 1) // block)  # sequences the pool holds at their smallest (prompt + 1 token)
    if concurrency > reachable:
        from runtime.engine import RequestError

        raise RequestError(f"concurrency {concurrency}: the KV pool's {pool} blocks of {block} tokens hold at most "
                           f"{reachable} sequences of {input_len} + 1 tokens at once, so the point would not run "
                           f"{concurrency} together; give a concurrency of at most {reachable}")
    device = engine.device
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    prompts = _random_prompts(num_prompts, input_len, vocab, seed)
    # warm up with a full wave of other prompts: Triton compiles a kernel once per specialisation (argument
    # divisibility), and the prefill chunks of a wave reach shapes a single prompt does not
    engine.run(_random_prompts(concurrency, input_len, vocab, seed + 1), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.pool.reset_prefix_cache()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    preempted = engine.scheduler.num_preemptions
    steps = engine.num_steps
    spec0 = engine.stats()
    _sync(device)
    t0 = time.perf_counter()
    with timed_steps(engine) as timings:  # where the wall time goes: overlapped decode steps vs the rest
        outs = engine.run(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    _sync(device)
    elapsed = time.perf_counter() - t0
    decode = [t.seconds for t in timings if t.overlapped]
    other = [t.seconds for t in timings if not t.overlapped]
    generated = sum(len(o.token_ids) for o in outs)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    spec = engine.stats()
    return ThroughputResult(str(device), input_len, output_len, num_prompts, engine.scheduler_config.max_num_seqs,
                            generated / elapsed, (generated + input_len * num_prompts) / elapsed, elapsed,
                            engine.scheduler.num_preemptions - preempted, peak, engine.num_steps - steps,
                            len(decode), sum(decode, 0.0), sum(other, 0.0),
                            spec.spec_num_draft_tokens - spec0.spec_num_draft_tokens,
                            spec.spec_num_accepted_tokens - spec0.spec_num_accepted_tokens,
                            spec.spec_num_verified - spec0.spec_num_verified)


def load_for_bench(artifact: str, device: str, *, max_num_seqs: int, max_seq_len: int | None,
                   max_num_batched_tokens: int | None, cuda_graphs: bool, check_hashes: bool = False,
                   gpu_memory_utilization: float = 0.9, speculative: dict | None = None,
                   tokens_per_block: int | None = None) -> ServingEngine:
    """A serving engine for the benches; ``tokens_per_block`` None: $RUNTIME_TOKENS_PER_BLOCK, else the artifact's."""
    config = ServingConfig(max_num_seqs=max_num_seqs, max_seq_len=max_seq_len,
                           max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs,
                           max_waiting=1 << 20, gpu_memory_utilization=gpu_memory_utilization,
                           speculative=speculative if speculative is not None else {"method": None},  # plain: off
                           **({} if tokens_per_block is None else {"tokens_per_block": tokens_per_block}))
    return ServingEngine.load(artifact, device, config, check_hashes=check_hashes, allow_failed_gate=True)


def report(results: list, path: str | None = None) -> None:
    rows = [asdict(r) for r in results]
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

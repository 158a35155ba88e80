"""What the HTTP server costs over the offline engine, with the model's forward simulated: the scheduler, sampling,
detokenization, the server and the benchmark client run for real, the forward returns random logits and the
device is modelled as a queue of steps of ``--step-ms`` each (a step starts when it is launched or when the one
before it ends, whichever is later, and its tokens are ready when it ends; the host reads a step's tokens one step
later, as the overlapped CUDA-graph decode does). So a run's wall time is what the host adds on top of the device.

    python -m builder.bench.serve_overhead artifacts/quickstart --step-ms 9 --concurrency 256 \\
        --input-len 128 --output-len 128 --num-prompts 1024

Runs the offline engine (``ServingEngine.run``), then ``builder serve``'s app on a free port in a child process
with the same simulated forward and ``builder bench serve`` against it (streamed, greedy, EOS ignored), and prints
one JSON line: output tok/s of each and the overhead in percent. Any artifact works (its tokenizer and vocabulary
are used, not its weights' values).

On a GPU, ``bash builder/devtools/gpu_suite.sh serve-PREC`` measures the real thing (the offline engine, then the
server in both engine modes under ``builder bench serve``) and records the figures with

    python -m builder.bench.serve_overhead --record docs/benchmarks.jsonl --precision fp8 --offline OFFLINE.json \
        SERVE.json... [--thread SERVE_THREAD.json...]

``serve_throughput_128_128_PREC`` (output tok/s through HTTP, the best client setting, engine in its own process),
``serve_overhead_pct_PREC`` (100 x (1 - that / the offline engine's output tok/s)), ``serve_ttft_p50_128_128_PREC``
and ``serve_tpot_p50_128_128_PREC`` (ms, of that run) and ``serve_throughput_128_128_PREC_engine_thread``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch


class SimulatedDevice:
    """``executor.forward`` replaced by random logits from a device of ``step_ms`` per step (module docstring)."""

    def __init__(self, vocab: int, step_ms: float, rows: int) -> None:
        self.step_s = step_ms / 1000
        self.logits = torch.randn(rows, vocab)
        self._ends: list[float] = []  # end times of the steps launched so far (the last two are kept)

    def forward(self, inp) -> torch.Tensor:
        now = time.perf_counter()
        previous_end = self._ends[-1] if self._ends else now
        if len(self._ends) >= 2 and self._ends[-2] > now:  # the step before last is still running: wait for it
            time.sleep(self._ends[-2] - now)
        self._ends = [previous_end, max(now, previous_end) + self.step_s]
        n = inp.logits_indices.numel()
        if n > self.logits.shape[0]:
            self.logits = torch.randn(n, self.logits.shape[1])
        return self.logits[:n]

    def drain(self) -> None:
        if self._ends and self._ends[-1] > time.perf_counter():
            time.sleep(self._ends[-1] - time.perf_counter())


def simulated(artifact: str, device: str, config, check_hashes: bool, allow_failed_gate: bool, *, step_ms: float):
    """``runtime.engine_process.load_engine`` with the simulated device (module docstring)."""
    from runtime.serving import ServingEngine

    engine = ServingEngine.load(artifact, "cpu", config, check_hashes=check_hashes, allow_failed_gate=allow_failed_gate)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    engine.device_model = SimulatedDevice(vocab, step_ms, config.max_num_seqs)
    engine.executor.forward = engine.device_model.forward
    # sampling runs on the device too: random token ids instead of an argmax over the random logits on the host
    engine._sample = lambda logits, sampling: (torch.randint(0, vocab, (len(sampling),)), {})
    return engine


def serving_config(args):
    from runtime.serving import ServingConfig

    max_seq_len = args.input_len + args.output_len
    return ServingConfig(max_num_seqs=args.concurrency, max_waiting=1 << 20, max_seq_len=max_seq_len,
                         num_blocks=args.concurrency * -(-max_seq_len // 16) * 2)


def offline(args) -> dict:
    from builder.bench.offline import _random_prompts
    from runtime.sampling import SamplingParams

    engine = simulated(args.artifact, "cpu", serving_config(args), False, True, step_ms=args.step_ms)
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    prompts = _random_prompts(args.num_prompts, args.input_len, vocab, 0)
    t0 = time.perf_counter()
    engine.run(prompts, [SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)] * len(prompts))
    engine.device_model.drain()
    elapsed = time.perf_counter() - t0
    return {"output_tok_s": round(args.num_prompts * args.output_len / elapsed, 1), "elapsed_s": round(elapsed, 2),
            "steps": engine.num_steps}


def serve_stub(args) -> None:
    """The child process: ``builder serve``'s app over the simulated engine, in its own process (the default) or
    in a thread (``--engine-thread``)."""
    import functools

    import uvicorn

    from runtime.async_engine import AsyncEngine
    from runtime.engine_process import EngineProcess
    from runtime.server import create_app

    loader = functools.partial(simulated, step_ms=args.step_ms)
    if args.api_servers > 1:
        from runtime import api_servers

        api_servers.serve(args.artifact, "cpu", serving_config(args), num_servers=args.api_servers, host="127.0.0.1",
                          port=args.port, model_name="stub", api_key=None, stream_interval=args.stream_interval,
                          log_level="warning", allow_failed_gate=True, graceful_shutdown_s=5, loader=loader,
                          check_hashes=False)
        return
    if args.engine_thread:
        engine = AsyncEngine(loader(args.artifact, "cpu", serving_config(args), False, True))
    else:
        engine = EngineProcess(args.artifact, "cpu", serving_config(args), check_hashes=False, allow_failed_gate=True,
                               loader=loader)
    uvicorn.run(create_app(engine, "stub", stream_interval=args.stream_interval), host="127.0.0.1", port=args.port,
                log_level="warning")


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a running process has used (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(args) -> dict:
    port = _free_port()
    child = subprocess.Popen([sys.executable, "-m", "builder.bench.serve_overhead", args.artifact, "--serve-stub",
                              "--port", str(port), "--step-ms", str(args.step_ms), "--concurrency",
                              str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
                              str(args.output_len), "--stream-interval", str(args.stream_interval),
                              "--api-servers", str(args.api_servers)]
                             + (["--engine-thread"] if args.engine_thread else []),
                             env={**os.environ})
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or child.poll() is not None:
                raise RuntimeError("the stub server did not come up")
            time.sleep(0.2)
        out = os.path.join(tempfile.mkdtemp(prefix="serve_overhead_"), "serve.json")
        cmd = [sys.executable, "-m", "builder.cli", "bench", "serve", "--url", f"http://127.0.0.1:{port}",
               "--tokenizer", args.artifact, "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--range-ratio", "0", "--num-requests", str(args.num_prompts), "--concurrency",
               str(args.concurrency), "--json", out]
        if args.client_workers:
            cmd += ["--workers", str(args.client_workers)]
        cpu0 = _process_cpu_s(child.pid)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cpu1 = _process_cpu_s(child.pid)
        with open(out) as f:
            result = json.load(f)
        tokens = args.num_prompts * args.output_len
        return {"output_tok_s": round(result["output_token_throughput"], 1), "completed": result["completed"],
                "failed": result["failed"], "tpot_p50_ms": result["tpot_ms"]["p50"],
                "ttft_p50_ms": result["ttft_ms"]["p50"],
                # the API process's own CPU time (the engine runs in its child) per streamed output token; not
                # measured with several server processes (the stub then only waits for them)
                "api_cpu_us_per_token": None if cpu0 is None or cpu1 is None or args.api_servers > 1
                else round((cpu1 - cpu0) / tokens * 1e6, 1)}
    finally:
        child.terminate()
        child.wait(30)


def record(args) -> dict:
    """Figures from a gpu_suite serve-PREC run's JSON files (module docstring), appended to ``args.record``."""
    from builder.bench.record import append_figures

    with open(args.offline) as f:
        offline_tok_s = [json.loads(line) for line in f if line.strip()][-1]["output_tok_s"]

    def best(paths: list[str]) -> dict | None:
        runs = []
        for path in paths:
            with open(path) as f:
                runs.append(json.load(f))
        return max(runs, key=lambda r: r["output_token_throughput"]) if runs else None

    served, thread = best(args.served), best(args.thread or [])
    p = args.precision
    figures = [(f"serve_throughput_128_128_{p}", served["output_token_throughput"], "tok/s"),
               (f"serve_overhead_pct_{p}", 100 * (1 - served["output_token_throughput"] / offline_tok_s), "%"),
               (f"serve_ttft_p50_128_128_{p}", served["ttft_ms"]["p50"], "ms"),
               (f"serve_tpot_p50_128_128_{p}", served["tpot_ms"]["p50"], "ms")]
    if thread is not None:
        figures.append((f"serve_throughput_128_128_{p}_engine_thread", thread["output_token_throughput"], "tok/s"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    conc = served["config"]["concurrency"]
    append_figures(args.record, figures, device, f"bash builder/devtools/gpu_suite.sh serve-{p} "
                                                 f"(SERVE_CONCURRENCY={conc}; SERVE_API_SERVERS={args.api_servers}; "
                                                 f"client workers "
                                                 f"{served['config']['workers']}; offline {offline_tok_s:.1f} tok/s)")
    out = {name: round(value, 2) for name, value, _ in figures}
    print(json.dumps({"offline_output_tok_s": offline_tok_s, **out}))
    return out


def record_goodput(args) -> dict:
    """``serve_goodput_rps_PREC``: the highest request rate of a gpu_suite goodput-PREC sweep whose p99 TTFT and p99
    TPOT meet the run's SLOs (``--slo ttft=... --slo tpot=...``), appended to ``args.record``; a table of the sweep
    is printed."""
    from builder.bench.record import append_figures

    runs = []
    for path in args.goodput:
        with open(path) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: r["config"]["request_rate"])
    print("rate req/s | completed | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput req/s (fraction)")
    met = []
    for r in runs:
        slos = r["goodput"]["slos_ms"]
        ok = r["ttft_ms"]["p99"] <= slos["ttft"] and r["tpot_ms"]["p99"] <= slos["tpot"] and not r["failed"]
        if ok:
            met.append(r["config"]["request_rate"])
        print(f"{r['config']['request_rate']:g} | {r['completed']}/{r['num_requests']} | "
              f"{r['output_token_throughput']:.0f} | {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | "
              f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | {r['goodput']['request_throughput']:.1f} "
              f"({r['goodput']['fraction']:.3f}){'' if ok else '  (p99 over an SLO)'}")
    rate = max(met) if met else 0.0
    slos = runs[0]["goodput"]["slos_ms"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    append_figures(args.record, [(f"serve_goodput_rps_{args.precision}", rate, "req/s")], device,
                   f"bash builder/devtools/gpu_suite.sh goodput-{args.precision} (rates "
                   f"{' '.join(format(r['config']['request_rate'], 'g') for r in runs)}; p99 TTFT <= {slos['ttft']:g} "
                   f"ms, p99 TPOT <= {slos['tpot']:g} ms; 128 +/- 50% tokens in and out)")
    print(json.dumps({f"serve_goodput_rps_{args.precision}": rate}))
    return {"rate": rate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?")
    parser.add_argument("--record", default=None, help="append figures from the JSON files below to this record")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--offline", default=None, help="`builder bench throughput --json` output")
    parser.add_argument("--served", nargs="*", default=[], help="`builder bench serve --json` files, engine process")
    parser.add_argument("--thread", nargs="*", default=None, help="`builder bench serve --json` files, --engine-thread")
    parser.add_argument("--goodput", nargs="*", default=None, help="`builder bench serve --json` files of a rate sweep")
    parser.add_argument("--step-ms", type=float, default=9.0, help="simulated device time per step")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--client-workers", type=int, default=0, help="benchmark client processes (0: its default)")
    parser.add_argument("--engine-thread", action="store_true", help="the server's engine in a thread, not a process")
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    parser.add_argument("--api-servers", type=int, default=1, help="the server's --api-servers (server processes)")
    parser.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record and args.goodput:
        if not args.precision:
            parser.error("--record needs --precision")
        record_goodput(args)
        return 0
    if args.record:
        if not (args.precision and args.offline and args.served):
            parser.error("--record needs --precision, --offline and at least one served JSON file")
        record(args)
        return 0
    if args.artifact is None:
        parser.error("give an artifact directory")
    args.num_prompts = args.num_prompts or 4 * args.concurrency
    if args.serve_stub:
        serve_stub(args)
        return 0
    off = offline(args)
    srv = served(args)
    print(json.dumps({"step_ms": args.step_ms, "concurrency": args.concurrency, "engine_thread": args.engine_thread,
                      "stream_interval": args.stream_interval, "offline": off, "served": srv,
                      "overhead_pct": round(100 * (1 - srv["output_tok_s"] / off["output_tok_s"]), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`builder`: build, inspect and run engine artifacts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Turn a Hugging Face checkpoint into a self-contained engine artifact, and run it.")


TOKENS_PER_BLOCK_HELP = "tokens per KV block, a power of two (default: $RUNTIME_TOKENS_PER_BLOCK, else the artifact's)"


def _setup_logging(quiet: bool) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s",
                        datefmt="[%X]", handlers=[RichHandler(show_path=False, markup=False)], force=True)


EXIT_ERROR = 1  # bad recipe, checkpoint, data or artifact; a build that could not finish
EXIT_GATE_FAILED = 3  # the build finished but a quality gate failed: the artifact is marked gate-failed


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


@contextlib.contextmanager
def _progress(quiet: bool):
    """A rich progress bar fed by passes' progress(task, done, total) calls; silent with --quiet."""
    if quiet:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(task: str, done: int, total: int) -> None:
            if task not in tasks:
                tasks[task] = bar.add_task(task, total=total)
            bar.update(tasks[task], completed=done, total=total)

        yield update


@app.command()
def build(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    set_: list[str] = typer.Option([], "--set", help="override a recipe key: --set runtime.max_seq_len=4096"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only warnings and errors"),
    overwrite: bool = typer.Option(False, "--overwrite", help="delete output_dir before building even when it is "
                                   "not a previous artifact (a file, a link, a directory of other files); "
                                   "a failed build does not bring it back"),
) -> None:
    """Build an engine artifact from a recipe."""
    _setup_logging(quiet)
    from builder.artifact import OutputDirError, check_not_an_input, check_output_dir, is_replaceable, remove_output_dir
    from builder.checkpoint import CheckpointError
    from builder.calibration import DataError
    from builder.pipeline import BuildError, build as run_build
    from builder.recipe import RecipeError, load_recipe
    from passes import GraphError, PassError
    from passes.lift import LiftError

    from builder.pipeline import GateFailure

    try:
        r = load_recipe(recipe, set_)
        out = Path(r.output_dir)
        check_not_an_input(out, {"the recipe": recipe, "model.checkpoint": r.model.checkpoint,
                                 "calibration.dataset": r.calibration.dataset, "gates.eval_dataset":
                                 r.gates.eval_dataset, "runtime.speculative.draft_model":
                                 r.runtime.speculative.draft_model})
        if overwrite and not is_replaceable(out):
            logging.getLogger("builder").warning("--overwrite: deleting %s", out)
            remove_output_dir(out)
        check_output_dir(out)  # before the build spends any time
        with _progress(quiet) as progress:
            result = run_build(r, progress)
    except GateFailure as e:
        _fail(str(e), EXIT_GATE_FAILED)
    except (RecipeError, CheckpointError, DataError, BuildError, LiftError, PassError, GraphError,
            OutputDirError) as e:
        _fail(str(e))
    except OSError as e:  # a disk that filled up or went read-only mid-build: the message names the path
        _fail(f"the build could not read or write a file: {e}")
    typer.echo(f"artifact: {result.output_dir} ({result.seconds:.1f}s); report: {result.output_dir / 'report.html'}")


@app.command()
def plan(
    source: Path = typer.Argument(..., help="recipe YAML, or a checkpoint directory (only its config.json is read)"),
    gpu_memory: Optional[str] = typer.Option(None, help="memory of one GPU: 80GiB, 80GB, 81920MiB "
                                             "(default: the recipe's target, else 80GiB)"),
    gpu_memory_utilization: Optional[float] = typer.Option(None, help="fraction the runtime may use "
                                                           "(default: the recipe's target, else 0.9)"),
    tp_size: Optional[int] = typer.Option(None, help="tensor-parallel ranks (default: the recipe's, else 1)"),
    vocab_parallel: Optional[bool] = typer.Option(None, "--vocab-parallel/--no-vocab-parallel",
                                                  help="embedding/lm_head split over the ranks (default: the "
                                                  "recipe's, else replicated)"),
    dtype: Optional[str] = typer.Option(None, help="model dtype: float32 | bfloat16 | float16"),
    quant: Optional[str] = typer.Option(None, help="none | awq | gptq | fp8 | int8_wo | smoothquant"),
    group_size: Optional[int] = typer.Option(None, help="awq / gptq group size (-1 = per channel)"),
    bits: Optional[int] = typer.Option(None, help="gptq bits: 4 | 8"),
    kv_cache_dtype: Optional[str] = typer.Option(None, help="auto (the model dtype) | fp8 | int8"),
    max_seq_len: Optional[int] = typer.Option(None),
    max_batch_size: Optional[int] = typer.Option(None),
    max_num_tokens: Optional[int] = typer.Option(None),
    set_: list[str] = typer.Option([], "--set", help="override a recipe key: --set runtime.tokens_per_block=32"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the plan as JSON to this file; '-' prints "
                                           "it on stdout instead of the table"),
) -> None:
    """Memory plan from config.json: weights and KV bytes per rank, KV pool, max concurrency, and whether it fits.

    The precision and serving options override the recipe's (for a checkpoint directory: the recipe
    defaults, bfloat16 and no quantization). Exits 0 whenever a plan was made, fitting or not.
    """
    from builder.plan import PlanError, load_plan_input, make_plan, parse_memory, render, write_json
    from builder.recipe import RecipeError

    options = {"model.dtype": dtype, "quantization.algo": quant, "quantization.group_size": group_size,
               "quantization.bits": bits, "runtime.kv_cache_dtype": kv_cache_dtype, "runtime.max_seq_len": max_seq_len,
               "runtime.max_batch_size": max_batch_size, "runtime.max_num_tokens": max_num_tokens}
    overrides = [f"{key}={value}" for key, value in options.items() if value is not None] + list(set_)
    try:
        memory = None
        if gpu_memory is not None:
            try:
                memory = parse_memory(gpu_memory)
            except PlanError as e:
                raise PlanError(f"--gpu-memory {e}") from None
        result = make_plan(load_plan_input(source, overrides), tp_size=tp_size, gpu_memory=memory,
                           gpu_memory_utilization=gpu_memory_utilization, vocab_parallel=vocab_parallel,
                           source=str(source))
        if json_out != "-":
            render(result)
        if json_out is not None:
            write_json(result, json_out)
    except (PlanError, RecipeError) as e:
        _fail(str(e))


@app.command()
def gate(
    artifact: Path = typer.Argument(..., help="artifact directory to judge"),
    baseline: Path = typer.Option(..., "--baseline", help="unquantized checkpoint directory or artifact"),
    eval_dataset: Optional[Path] = typer.Option(None, help=".txt/.jsonl held-out text (default: the recipe's; the "
                                                "shipped eval text only for the bundled model, or 'bundled')"),
    num_positions: Optional[int] = typer.Option(None, help="evaluation positions (default: the recipe's)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    any_baseline: bool = typer.Option(False, "--any-baseline",
                                      help="gate against a baseline that is not the artifact's source model"),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
) -> None:
    """Run the quality gates of an artifact against its source model; exit 3 if a gate fails, 1 on an error
    (including a baseline whose config or weights are not the artifact's source, unless --any-baseline)."""
    _setup_logging(quiet)
    from builder.calibration import BUNDLED, DataError, read_texts
    from builder.checkpoint import CheckpointError
    from builder.gates import GateError
    from builder.quality import gate_artifact
    from builder.recipe import RecipeError, gates_section
    from runtime.artifact import ArtifactError, open_artifact

    try:
        manifest = open_artifact(artifact).manifest
        recorded = manifest["recipe"].get("gates")
        section = gates_section(recorded, f"{artifact}/manifest.json")
        options = {k: v for k, v in (("eval_dataset", None if eval_dataset is None else str(eval_dataset)),
                                     ("num_positions", num_positions)) if v is not None}
        if options:  # validated as the recipe's section is: a bad value is named with what is allowed
            section = gates_section({**section.model_dump(exclude_unset=True), **options},
                                    "the command's options (--eval-dataset, --num-positions)")
        if eval_dataset is not None and str(eval_dataset) != BUNDLED:  # before the baseline is traced
            try:
                read_texts(eval_dataset)
            except DataError as e:
                raise DataError(f"--eval-dataset: {e}") from None
        report = gate_artifact(artifact, baseline, section, any_baseline=any_baseline)
    except (ArtifactError, CheckpointError, DataError, GateError, RecipeError) as e:
        _fail(str(e))
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else report.table())
    if not report.passed:
        raise typer.Exit(code=EXIT_GATE_FAILED)


DEVICE_HELP = "auto (CUDA when this machine has it, else the CPU), cpu, cuda or cuda:N"


def _device_option(value: str) -> str:
    """Check --device against this machine at once: an unknown name or a missing GPU is a usage error."""
    from runtime.engine import DeviceError, resolve_device

    try:
        resolve_device(value)
    except DeviceError as e:
        raise typer.BadParameter(str(e)) from None
    return value


@app.command()
def generate(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    prompt: str = typer.Option(..., "--prompt", "-p"),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    chat: bool = typer.Option(False, "--chat", help="send the prompt as a user message through the chat template"),
    device: str = typer.Option("auto", help=DEVICE_HELP, callback=_device_option),
    allow_failed_gate: bool = typer.Option(False, "--allow-failed-gate", help="load an artifact that failed its gates"),
    stats: bool = typer.Option(False, "--stats", help="print timing to stderr"),
) -> None:
    """Generate text from an artifact (streams to stdout)."""
    _setup_logging(True)
    from runtime import ArtifactError, Engine, RequestError, SamplingParams
    from runtime.sampling import SamplingError
    from runtime.tokenizer import TokenizerError

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, stop=list(stop))
        engine = Engine.load(artifact, device=device, allow_failed_gate=allow_failed_gate)
        ids = (engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}]), add_special_tokens=False) if chat
               else engine.tokenizer.encode(prompt))  # encoded before anything is printed
        if not chat:
            sys.stdout.write(prompt)
        stream = engine.stream(ids, params)
        while True:
            try:
                sys.stdout.write(next(stream))
                sys.stdout.flush()
            except StopIteration as done:
                result = done.value
                break
    except (ArtifactError, RequestError, SamplingError, TokenizerError, ValueError) as e:  # ValueError: a bad
        _fail(str(e))  # RUNTIME_* setting in the environment
    sys.stdout.write("\n")
    if stats:
        typer.echo(f"[{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} generated, "
                   f"finish={result.finish_reason}, prefill {result.prefill_s * 1e3:.1f} ms, "
                   f"decode {result.decode_tokens_per_s:.1f} tok/s]", err=True)


@app.command()
def serve(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    host: str = typer.Option("127.0.0.1", help="address to bind; 0.0.0.0 exposes the server to the network"),
    port: int = typer.Option(8000),
    api_key: str | None = typer.Option(None, "--api-key", help="require 'Authorization: Bearer KEY' on /v1 "
                                       "routes (default: $LLM_BUILDER_API_KEY, else none)"),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    served_model_name: str | None = typer.Option(None, help="model id clients send (default: the artifact's name)"),
    max_num_seqs: int | None = typer.Option(None, help="requests in the running batch (default: the artifact's)"),
    max_num_batched_tokens: int | None = typer.Option(None, help="tokens per engine step (default: the artifact's)"),
    max_seq_len: int | None = typer.Option(None, help="prompt plus output; may only lower the artifact's"),
    max_waiting: int = typer.Option(256, help="queued requests; past it requests get 429"),
    kv_cache_memory: str | None = typer.Option(None, help="KV pool size, e.g. 512MiB (CPU default 1GiB)"),
    num_blocks: int | None = typer.Option(None, help="exact number of KV blocks"),
    tokens_per_block: int | None = typer.Option(None, help=TOKENS_PER_BLOCK_HELP),
    gpu_memory_utilization: float = typer.Option(0.9, help="CUDA: fraction of device memory to use"),
    request_timeout: float | None = typer.Option(None, help="per-request deadline in seconds"),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching"),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs", help="decode eagerly (debugging)"),
    prefill_hold_ms: float | None = typer.Option(None, help="CUDA: how long a new prompt may wait while requests "
                                                 "decode, to be prefilled with other arrivals (default 0: at once)"),
    engine_thread: bool = typer.Option(False, "--engine-thread", help="step the engine in a thread of the server "
                                       "process, not its own process"),
    speculative_ngram: int | None = typer.Option(None, metavar="K", help="n-gram (prompt lookup) speculative "
                                                 "decoding with up to K draft tokens per request and step"),
    speculative_config: str | None = typer.Option(None, metavar="JSON", help="the speculative section as a JSON "
                                                  "object (see python -m runtime.serve --help)"),
    allow_failed_gate: bool = typer.Option(False, "--allow-failed-gate", help="serve an artifact that failed its gates"),
    stream_interval: int = typer.Option(1, min=1, help="tokens a streamed response gathers per event after its first"),
    api_servers: int = typer.Option(1, min=1, help="HTTP server processes sharing the port over one engine process "
                                    "(more than 1 when one process's event loop is the limit)"),
    log_level: str = typer.Option("info", help="debug | info | warning | error"),
) -> None:
    """Serve an artifact over HTTP: OpenAI-compatible /v1 API, /health, Prometheus /metrics."""
    from runtime.serve import main as serve_main

    argv = [str(artifact), "--host", host, "--port", str(port), "--device", device, "--max-waiting", str(max_waiting),
            "--gpu-memory-utilization", str(gpu_memory_utilization), "--log-level", log_level,
            "--stream-interval", str(stream_interval), "--api-servers", str(api_servers)]
    options = {"--api-key": api_key, "--served-model-name": served_model_name, "--max-num-seqs": max_num_seqs,
               "--max-num-batched-tokens": max_num_batched_tokens, "--max-seq-len": max_seq_len,
               "--kv-cache-memory": kv_cache_memory, "--num-blocks": num_blocks, "--tokens-per-block": tokens_per_block,
               "--request-timeout": request_timeout,
               "--prefill-hold-ms": prefill_hold_ms, "--speculative-ngram": speculative_ngram,
               "--speculative-config": speculative_config}
    argv += [f"{flag}={value}" for flag, value in options.items() if value is not None]  # a value may begin with "-"
    argv += [flag for flag, on in (("--no-prefix-caching", no_prefix_caching), ("--no-cuda-graphs", no_cuda_graphs),
                                   ("--allow-failed-gate", allow_failed_gate), ("--engine-thread", engine_thread))
              if on]
    try:
        code = serve_main(argv)
    except SystemExit as e:  # argparse rejected a value
        code = e.code if isinstance(e.code, int) else EXIT_ERROR
    raise typer.Exit(code=code)


@app.command()
def inspect(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    graph: bool = typer.Option(False, "--graph", help="print the whole graph IR"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
) -> None:
    """Show an artifact's manifest, graph summary, sizes and build report location."""
    from runtime.artifact import ArtifactError, open_artifact

    try:
        a = open_artifact(artifact)
    except ArtifactError as e:
        _fail(str(e))
    m = a.manifest
    if as_json:
        typer.echo(json.dumps(m, indent=1))
        return
    model = m["model"]
    total = sum(f["bytes"] for f in m["files"].values())
    lines = [
        f"artifact      {artifact}  (format v{m['format_version']}, integrity verified)",
        f"name          {m['name']}",
        f"source        {m['source']['checkpoint']}  ({model['architecture']})",
        f"model         {model['num_layers']} layers, hidden {model['hidden_size']}, heads "
        f"{model['num_attention_heads']}/{model['num_key_value_heads']} kv, head_dim {model['head_dim']}, "
        f"vocab {model['vocab_size']}, {model['num_parameters'] / 1e6:.2f}M params, {model['dtype']}",
        "runtime       " + ", ".join(f"{k}={v}" for k, v in m["runtime"].items()),
        f"graph         IR v{m['graph']['ir_version']}, {m['graph']['num_nodes']} nodes: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(m["graph"]["ops"].items())),
        "passes        " + " -> ".join(p["name"] for p in m["build"]["passes"]),
    ]
    v = m["build"].get("verify")
    lines.append(f"verify        max |logit err| {v['max_abs_logit_err']:.3g} (atol {v['atol']:g}), top-1 agreement "
                 f"{v['top1_agreement']:.4f}" if v else "verify        not run")
    q = m.get("quantization", {})
    if q.get("algo", "none") != "none" or q.get("kv_cache_dtype", "auto") != "auto":
        g = q.get("gates")
        gate_text = ("gates " + ("PASSED" if g["passed"] else "FAILED") + ": " + ", ".join(
            f"{x['name']}={x['value']:.4g}" for x in g["metrics"])) if g else "gates not run"
        head = q.get("lm_head", "none")
        head_text = f"lm_head {head}" if head != "none" else f"lm_head {model['dtype']}"
        lines.append(f"quantization  {q['algo']}, {head_text}, KV cache {q.get('kv_cache_dtype', 'auto')}; {gate_text}")
    lines.append(f"built         {m['build']['started_at']} on {m['build']['host']} in {m['build']['duration_s']:.2f}s; "
                 f"toolchain {m['versions']['toolchain']}, torch {m['versions']['torch']}")
    lines.append(f"size          {total / 2**20:.2f} MiB in {len(m['files'])} files")
    for f, info in m["files"].items():
        lines.append(f"  {info['bytes'] / 2**20:10.2f} MiB  {f}")
    lines.append(f"report        {artifact / m['reports']['html']}  ({m['reports']['markdown']})")
    typer.echo("\n".join(lines))
    if graph:
        typer.echo(a.graph and _graph_text(a.graph))


def _graph_text(graph: dict) -> str:
    from passes.ir import Graph

    return str(Graph.from_dict(graph))


@app.command()
def compare(
    artifacts: list[Path] = typer.Argument(..., help="artifact directories built from one checkpoint"),
    output: Path = typer.Option(..., "--output", "-o", help="HTML report to write; the Markdown (.md) and its "
                                "plots (.svg) go beside it"),
    bench: list[str] = typer.Option([], "--bench", help="[ARTIFACT=]FILE.json from `builder bench serve|latency|"
                                    "throughput --json`; without ARTIFACT= matched by the file's model field"),
    quality_metric: str = typer.Option("kl", help="gate metric used as quality for the plots and Pareto sets"),
    top_layers: int = typer.Option(5, help="per-layer error hot spots shown per artifact"),
) -> None:
    """Side-by-side report of artifacts of one model: recipe differences, sizes, gates, hot spots, benchmarks."""
    from builder.compare import CompareError, compare as run_compare, write_reports

    try:
        written = write_reports(run_compare(artifacts, bench, quality_metric, top_layers), output)
    except CompareError as e:
        _fail(str(e))
    typer.echo("wrote " + ", ".join(str(p) for p in written))




bench_app = typer.Typer(no_args_is_help=True, help="Latency and throughput benchmarks of an artifact.")
app.add_typer(bench_app, name="bench")


def _empty_cuda_cache(device: str) -> None:
    """Give the memory of a closed engine back to the device before the next engine or process takes it: the
    engine's objects reference each other, so they are freed by a collection of cycles, not when the last name goes."""
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _bench_engine(artifact: Path, device: str, max_num_seqs: int, max_seq_len: Optional[int],
                  max_num_batched_tokens: Optional[int], no_cuda_graphs: bool, speculative: dict | None = None,
                  tokens_per_block: Optional[int] = None):
    from builder.bench.offline import load_for_bench
    from runtime.artifact import ArtifactError
    from runtime.memory import MemoryPlanError

    try:
        return load_for_bench(str(artifact), device, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len,
                              max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=not no_cuda_graphs,
                              speculative=speculative, tokens_per_block=tokens_per_block)
    except (ArtifactError, MemoryPlanError, ValueError, RuntimeError, MemoryError) as e:  # RuntimeError, MemoryError:
        _fail(f"cannot load {artifact}: {e or type(e).__name__}")  # out of memory (e.g. --concurrency 1000000000)


def _block_size_args(tokens_per_block: Optional[int]) -> tuple[list[str], str]:
    """A recorded bench command's block size: (its flag, or none) and (an environment prefix when the block size
    came from $RUNTIME_TOKENS_PER_BLOCK, else "")."""
    if tokens_per_block is not None:
        return ["--tokens-per-block", str(tokens_per_block)], ""
    env = os.environ.get("RUNTIME_TOKENS_PER_BLOCK")
    return [], (f"RUNTIME_TOKENS_PER_BLOCK={shlex.quote(env)} " if env else "")


def _batch_size(value: str) -> int:
    """One --batch-size value: a whole number of 1 or more."""
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise typer.BadParameter(f"{value!r} is not a batch size: give whole numbers of 1 or more, one per option "
                                 f"(--batch-size 2 --batch-size 4)")
    return size


def _check_record(record: Path | str | None, artifact: Path | None = None, option: str = "--record",
                  action: str = "appended to") -> None:
    """--record's (or --json's) file must be writable before minutes of measuring are spent, and outside the
    artifact being measured (appending to its manifest.json would corrupt it)."""
    if record is None:
        return
    record = Path(record)
    if artifact is not None and record.resolve().is_relative_to(Path(artifact).resolve()):
        _fail(f"{option} {record} is inside the artifact {artifact} being measured; an artifact's files are fixed "
              f"by its manifest: write the figures elsewhere")
    if record.exists():  # appended to: the file itself must be writable
        ok = not record.is_dir() and os.access(record, os.W_OK)
    else:  # created: in a directory that exists and takes new files
        ok = record.parent.is_dir() and os.access(record.parent, os.W_OK)
    if not ok:
        _fail(f"{option} {record}: not a file that can be {action} (an existing writable file, or a new one in a "
              f"writable directory)")


@bench_app.command("latency")
def bench_latency(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    device: str = typer.Option("cuda", help="cuda | cpu"),
    input_len: list[int] = typer.Option([128], min=1, help="prompt lengths (repeat the option for several)"),
    output_len: int = typer.Option(128, min=2, help="tokens generated per repeat (at least 2: the decode rate "
                                   "leaves out the first, the prefill's)"),
    repeats: int = typer.Option(3, min=1, help="median over this many runs"),
    max_seq_len: Optional[int] = typer.Option(None, help="lower the artifact's max_seq_len (smaller KV tables)"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, help="prefill chunk (default: the artifact's)"),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs"),
    tokens_per_block: Optional[int] = typer.Option(None, help=TOKENS_PER_BLOCK_HELP),
    json_out: Optional[str] = typer.Option(None, "--json", help="append the results as JSON lines to this file"),
    baseline: Optional[Path] = typer.Option(None, help="checkpoint the artifact was built from: also time the "
                                            "stock-PyTorch baseline (torch.compile) on it and print the ratio"),
    baseline_quant: Optional[str] = typer.Option(None, help="bf16 | int8wo | int4 (default: the stock "
                                                 "counterpart of the artifact's precision)"),
    record: Optional[Path] = typer.Option(None, help="append the figures to this record (docs/benchmarks.jsonl)"),
    batch_size: list[int] = typer.Option([], help="also the decode step time with this many prompts decoded "
                                         "together (repeat the option: --batch-size 2 --batch-size 4; whole "
                                         "numbers >= 1)", parser=_batch_size),
) -> None:
    """Batch-1 time to first token and decode tokens/s, with the decode's share of the bandwidth roofline;
    with --batch-size, the decode step time at each batch size too."""
    from builder.bench.offline import check_lengths, decode_steps, latency, report, step_table
    from builder.bench.record import STOCK_QUANT, append_figures, figure_tag, precision_of
    from builder.bench.stock_torch import QUANT_MODES, StockModelError, run_stock_baseline
    from runtime.engine import RequestError
    from runtime.sampling import SamplingError

    _setup_logging(False)
    _check_record(record, artifact)
    _check_record(json_out, artifact, "--json")
    if baseline_quant is not None and baseline_quant not in QUANT_MODES:
        _fail(f"--baseline-quant {baseline_quant!r} is not one of {', '.join(QUANT_MODES)}")
    batch_size = sorted(set(batch_size))
    input_len = list(dict.fromkeys(input_len))  # a length given twice would record its figures twice, differing
    if batch_size and output_len < 4:
        _fail(f"--output-len {output_len}: --batch-size needs at least 4 (the decode step figure leaves out the "
              f"prefill, the first decode step and the last)")
    engine = _bench_engine(artifact, device, 1, max_seq_len, max_num_batched_tokens, no_cuda_graphs,
                           tokens_per_block=tokens_per_block)
    try:
        for n in input_len:  # every length before any is measured
            check_lengths(engine, n, output_len)
        results = [latency(engine, n, output_len, repeats) for n in input_len]
        precision = precision_of(engine.executor.graph, engine.engine.artifact.manifest)
        tag = figure_tag(engine.executor.graph, engine.engine.artifact.manifest)  # the figures' precision part
    except (RequestError, SamplingError) as e:  # a prompt or output the engine refuses (--input-len past the context)
        _fail(f"{e} (--input-len {input_len if len(input_len) > 1 else input_len[0]}, --output-len {output_len})")
    finally:
        engine.close()  # a tensor-parallel engine's worker ranks
    del engine
    steps, failure = [], None
    if batch_size:  # an engine of its own, so the batch-1 figures stay those of a max_num_seqs 1 engine
        from builder.bench.offline import load_for_bench
        from runtime.artifact import ArtifactError
        from runtime.memory import MemoryPlanError

        _empty_cuda_cache(device)
        try:  # a failure here (e.g. no memory plan for max(batch_size) sequences) keeps the batch-1 figures
            engine = load_for_bench(str(artifact), device, max_num_seqs=max(batch_size), max_seq_len=max_seq_len,
                                    max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=not no_cuda_graphs,
                                    tokens_per_block=tokens_per_block)
        except (ArtifactError, MemoryPlanError, ValueError, RuntimeError) as e:
            failure, engine = f"cannot load {artifact} for batch {max(batch_size)}: {e}", None
        if engine is not None:
            try:
                for n in input_len:
                    for b in batch_size:
                        steps.append(decode_steps(engine, b, n, output_len, repeats))
            except (RequestError, RuntimeError) as e:  # the figures measured so far are still recorded
                failure = f"decode step at batch {b}, {n}-token prompts: {e}"
            finally:
                engine.close()
            del engine
    report(results + steps, json_out)
    figures = []
    for r in results:
        suffix = "" if r.input_len == 128 else f"_in{r.input_len}"
        figures += [(f"decode_b1_{tag}{suffix}", r.decode_tok_s, "tok/s"),
                    (f"ttft_{r.input_len}_{tag}", r.ttft_ms, "ms")]
    for r in steps:
        suffix = "" if r.input_len == 128 else f"_in{r.input_len}"
        figures.append((f"decode_step_b{r.batch_size}_{tag}{suffix}", r.decode_step_ms, "ms"))
    baseline_step_ms: dict[tuple[int, int], float] = {}
    if baseline is not None:
        quant = baseline_quant or STOCK_QUANT.get(precision, "bf16")
        _empty_cuda_cache(device)  # our KV pool and weights are gone; the baseline gets the device
        for r in results:
            try:
                stock = run_stock_baseline(baseline, quant, r.input_len, output_len, device, repeats)
            except StockModelError as e:
                failure = failure or str(e)  # our figures are still recorded
                break
            typer.echo(json.dumps({**stock, "ours_decode_tok_s": round(r.decode_tok_s, 2),
                                   "ratio": round(r.decode_tok_s / stock["decode_tok_s"], 3)}))
            suffix = "" if r.input_len == 128 else f"_in{r.input_len}"
            figures += [(f"baseline_decode_b1_{tag}{suffix}", stock["decode_tok_s"], "tok/s"),
                        (f"baseline_ttft_{r.input_len}_{tag}", stock["ttft_ms"], "ms")]
        for r in steps:
            try:
                stock = run_stock_baseline(baseline, quant, r.input_len, output_len, device, repeats,
                                           batch_size=r.batch_size)
            except StockModelError as e:
                failure = failure or str(e)
                break
            typer.echo(json.dumps({**stock, "ours_decode_step_ms": round(r.decode_step_ms, 3),
                                   "ratio": round(stock["decode_step_ms"] / r.decode_step_ms, 3)}))
            baseline_step_ms[r.batch_size, r.input_len] = stock["decode_step_ms"]
            suffix = "" if r.input_len == 128 else f"_in{r.input_len}"
            figures.append((f"baseline_decode_step_b{r.batch_size}_{tag}{suffix}", stock["decode_step_ms"],
                            "ms"))
    if steps:
        typer.echo(step_table(steps, baseline_step_ms))
    if record is not None:
        command = ["builder", "bench", "latency", str(artifact), "--device", device, "--output-len", str(output_len),
                   "--repeats", str(repeats), *[a for n in input_len for a in ("--input-len", str(n))],
                   *[a for b in batch_size for a in ("--batch-size", str(b))]]
        for flag, value in (("--baseline", baseline), ("--baseline-quant", baseline_quant),
                            ("--max-seq-len", max_seq_len), ("--max-num-batched-tokens", max_num_batched_tokens)):
            command += [flag, str(value)] if value is not None else []
        block_flag, env = _block_size_args(tokens_per_block)
        append_figures(record, figures, device, env + shlex.join(command + block_flag + (
            ["--no-cuda-graphs"] if no_cuda_graphs else [])))
    if failure is not None:
        _fail(failure)


MAX_BENCH_PROMPTS = 1_000_000  # requests per `bench throughput` point (each made up front)


@bench_app.command("throughput")
def bench_throughput(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    device: str = typer.Option("cuda", help="cuda | cpu"),
    input_len: int = typer.Option(128, min=1),
    output_len: int = typer.Option(128, min=1),
    concurrency: list[int] = typer.Option([64], help="max_num_seqs values to sweep (repeat the option)"),
    num_prompts: Optional[int] = typer.Option(None, min=1, help="requests per point (default: --waves x "
                                              "concurrency)"),
    waves: int = typer.Option(4, min=1, help="requests per point as a multiple of its concurrency, when "
                              "--num-prompts is not given (1: one wave, as long outputs are measured)"),
    max_seq_len: Optional[int] = typer.Option(None),
    max_num_batched_tokens: Optional[int] = typer.Option(None),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs"),
    tokens_per_block: Optional[int] = typer.Option(None, help=TOKENS_PER_BLOCK_HELP),
    json_out: Optional[str] = typer.Option(None, "--json"),
    record: Optional[Path] = typer.Option(None, help="append the figures to this record (docs/benchmarks.jsonl): "
                                          "throughput_IN_OUT_PREC (output tok/s, the best concurrency; not "
                                          "with --speculative-ngram), "
                                          "throughput_IN_OUT_PREC_cC and preemptions_IN_OUT_PREC_cC per point; "
                                          "PREC is moe_PREC for a mixture-of-experts model"),
    speculative_ngram: Optional[int] = typer.Option(None, metavar="K", help="also run each point with n-gram "
                                                    "speculative decoding of up to K drafts (adaptive, as served) and "
                                                    "record throughput_IN_OUT_PREC_spec_cC, spec_throughput_ratio_cC "
                                                    "(with / without) and spec_acceptance_cC"),
) -> None:
    """Output tokens/s of many requests submitted at once, at each concurrency."""
    from builder.bench.offline import report, throughput
    from builder.bench.record import append_figures, figure_tag
    from runtime.engine import RequestError
    from runtime.sampling import SamplingError

    _setup_logging(False)
    _check_record(record, artifact)
    _check_record(json_out, artifact, "--json")
    results, spec_results, tag = [], [], None
    concurrency = list(dict.fromkeys(concurrency))  # a point given twice would record its figures twice, differing
    for c in concurrency:  # the prompts are made up front: a count past memory was an allocator's traceback
        if (num_prompts or waves * c) > MAX_BENCH_PROMPTS:
            given = f"--num-prompts {num_prompts}" if num_prompts else f"--waves {waves} x --concurrency {c}"
            _fail(f"{given} asks for {num_prompts or waves * c} requests at one point; at most {MAX_BENCH_PROMPTS:,}")
    specs = [None] if speculative_ngram is None else [None, {"method": "ngram",
                                                            "num_speculative_tokens": speculative_ngram}]
    for c in concurrency:
        for spec in specs:
            engine = _bench_engine(artifact, device, c, max_seq_len, max_num_batched_tokens, no_cuda_graphs, spec,
                                   tokens_per_block)
            try:
                (results if spec is None else spec_results).append(
                    throughput(engine, input_len, output_len, num_prompts or waves * c))
                tag = figure_tag(engine.executor.graph, engine.engine.artifact.manifest)
            except (RequestError, SamplingError) as e:  # a request the engine refuses (--input-len past the context)
                _fail(f"{e} (--input-len {input_len}, --output-len {output_len})")
            finally:
                engine.close()  # a tensor-parallel engine's ranks leave the process group before the next point
            del engine
            _empty_cuda_cache(device)
    report(results + spec_results, json_out)
    if record is not None and results:
        name = f"throughput_{input_len}_{output_len}_{tag}"
        # the headline (the best point) comes from plain sweeps: a speculation comparison run at a few small
        # concurrencies would shadow the best point of a sweep recorded before it
        figures = [] if speculative_ngram is not None else [(name, max(r.output_tok_s for r in results), "tok/s")]
        for r in results:
            figures += [(f"{name}_c{r.concurrency}", r.output_tok_s, "tok/s"),
                        (f"preemptions_{input_len}_{output_len}_{tag}_c{r.concurrency}", r.num_preemptions, "count")]
        for r, s in zip(results, spec_results):
            figures += [(f"{name}_spec_c{s.concurrency}", s.output_tok_s, "tok/s"),
                        (f"spec_throughput_ratio_c{s.concurrency}", s.output_tok_s / r.output_tok_s, "x"),
                        (f"spec_acceptance_c{s.concurrency}",
                         s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0, "ratio")]
        command = ["builder", "bench", "throughput", str(artifact), "--device", device, "--input-len", str(input_len),
                   "--output-len", str(output_len), *[a for c in concurrency for a in ("--concurrency", str(c))]]
        for flag, value in (("--num-prompts", num_prompts), ("--waves", waves if waves != 4 else None),
                            ("--max-seq-len", max_seq_len),
                            ("--max-num-batched-tokens", max_num_batched_tokens),
                            ("--speculative-ngram", speculative_ngram)):
            command += [flag, str(value)] if value is not None else []
        block_flag, env = _block_size_args(tokens_per_block)
        append_figures(record, figures, device, env + shlex.join(command + block_flag + (
            ["--no-cuda-graphs"] if no_cuda_graphs else [])))


@bench_app.command("serve")
def bench_serve(
    url: str = typer.Option("http://127.0.0.1:8000", help="base URL of a running OpenAI-compatible server"),
    model: Optional[str] = typer.Option(None, help="model id (default: the first of GET /v1/models)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="bearer key (default: $LLM_BUILDER_API_KEY, "
                                          "else $OPENAI_API_KEY, else none)"),
    endpoint: str = typer.Option("completions", help="completions | chat"),
    concurrency: Optional[int] = typer.Option(None, help="most requests in flight (default: 1 without "
                                              "--request-rate, no cap with it)"),
    request_rate: list[float] = typer.Option(
        [], "--request-rate", metavar="RATE",
        help="Poisson arrivals per second (seeded); given more than once, a sweep: one run per rate, increasing, each "
             "with --num-requests/--duration; a rate meets the SLOs when no request failed and each --slo metric's "
             "p99 <= its bound; the highest such rate is the goodput rate"),
    num_requests: Optional[int] = typer.Option(None, help="requests to send (default: each dataset line once, "
                                               "or 100 random prompts; none with only --duration)"),
    duration: Optional[float] = typer.Option(None, help="seconds after which no new request is sent"),
    dataset: Optional[Path] = typer.Option(None, help="JSONL prompts: {\"prompt\": str, \"max_tokens\": int}"),
    tokenizer: Optional[Path] = typer.Option(None, help="tokenizer.json, or a checkpoint or artifact directory"),
    length_dist: str = typer.Option("uniform", help="random prompts' lengths: uniform (--input-len/--output-len "
                                    "+/- --range-ratio) | sharegpt (synthetic ShareGPT-like mix, no dataset: "
                                    "lognormal input median 160 sigma 1.0 at most 4096, output median 200 sigma "
                                    "0.9 at most 2048; clipped to --input-len/--output-len when given and to the "
                                    "server's max_model_len)"),
    input_len: Optional[int] = typer.Option(None, help="random prompts: prompt tokens (default 128); with "
                                            "--length-dist sharegpt the most (default: no cap)"),
    output_len: Optional[int] = typer.Option(None, help="max_tokens of random prompts and of dataset lines without "
                                             "one (default 128); with --length-dist sharegpt the most (default: no "
                                             "cap)"),
    range_ratio: float = typer.Option(0.0, help="uniform random lengths vary by +/- this fraction"),
    prompt_format: Optional[str] = typer.Option(None, help="random prompts: ids | text (default: ids; chat: text)"),
    no_ignore_eos: bool = typer.Option(False, "--no-ignore-eos", help="do not send ignore_eos: true"),
    slo: list[str] = typer.Option([], "--slo", help="goodput SLO in ms, ttft|tpot|e2e=MS (repeatable)"),
    seed: int = typer.Option(0, help="seed of random prompts and arrivals"),
    timeout: float = typer.Option(600.0, help="seconds per request from its send; bounds the wait for requests "
                                  "in flight at the end"),
    workers: int = typer.Option(1, help="client processes sharing the load (one Python process parses a few tens "
                                "of thousands of streamed chunks per second at most); needs --num-requests or "
                                "--request-rate with --duration when > 1"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results as one JSON object (kind "
                                            "bench_serve_sweep for a sweep)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Benchmark a running OpenAI-compatible server: TTFT, TPOT, ITL, latency, throughput, goodput."""
    from builder.bench.serve import (BenchError, ServeBenchConfig, print_report, print_sweep_report, run, run_sweep,
                                     sweep_rates, write_json)

    _check_record(json_out, None, "--json", "written")  # before the run, not after it
    try:
        rates = sweep_rates(list(request_rate))
        config = ServeBenchConfig(
            url=url, model=model, api_key=api_key, endpoint=endpoint, concurrency=concurrency,
            request_rate=rates[0] if rates else None, num_requests=num_requests, duration=duration,
            dataset=dataset and str(dataset), tokenizer=tokenizer and str(tokenizer), length_dist=length_dist,
            input_len=input_len, output_len=output_len, range_ratio=range_ratio, prompt_format=prompt_format,
            ignore_eos=not no_ignore_eos, slos=list(slo), seed=seed, timeout=timeout, workers=workers)
        with _progress(quiet) as progress:
            result = run_sweep(config, rates, progress) if len(rates) > 1 else run(config, progress)
        summary = result.summary()
        if len(rates) > 1:
            print_sweep_report(result, summary)
            runs = summary["runs"]
        else:
            print_report(result, summary)
            runs = [summary]
        if json_out is not None:
            write_json(summary, json_out)
    except BenchError as e:
        _fail(str(e))
    if not any(s["completed"] for s in runs):
        failed: dict[str, int] = {}
        for s in runs:
            for k, v in s["failed"].items():
                failed[k] = failed.get(k, 0) + v
        _fail(f"no request completed ({', '.join(f'{k}: {v}' for k, v in failed.items())})")


if __name__ == "__main__":
    app()

"""Side-by-side comparison of artifacts of one model (``builder compare``).

Reads each artifact's manifest and graph (no weights are loaded) and, optionally, benchmark results,
then renders one self-contained HTML report (plots inline as SVG, no scripts, fonts or links to the
network) and a Markdown twin whose plots are sibling SVG files:

    recipe differences   only the resolved-recipe keys whose values differ (name/output_dir left out)
    sizes                artifact bytes, weight bytes, bits per weight of the quantized linears, a
                         quantized lm_head included (their tensors' bytes x 8 / in_features x
                         out_features) and overall
                         (weight bytes x 8 / parameters, quantized linears counted unpacked)
    gates                every gate metric with its threshold and pass/fail
    hot spots            the linears with the largest relative output error on calibration data (random
                         inputs for methods that fit nothing on activations)
    benchmarks           `builder bench serve --json` objects and `bench latency|throughput --json` lines
    goodput vs rate      `builder bench serve --request-rate R1 --request-rate R2 ... --json` sweeps: a table
                         (offered rate as rows; goodput req/s, p99 TTFT, p99 TPOT per sweep file) and, in the
                         HTML, a chart of goodput req/s, p99 TTFT and p99 TPOT against the offered rate
    Pareto               minimise weight bytes, optimise the quality metric (default mean KL);
                         with benchmarks also quality vs output tokens/s

NOTE: an unquantized artifact (algo none, KV cache auto) has no gates: it *is* the reference the gates
of the quantized builds compare against, so it takes the metric's reference value (KL 0, agreement 1,
perplexity ratio 1) on the plots and in the Pareto sets, and is labelled "reference" in the tables.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from runtime.artifact import MANIFEST, ArtifactError, canonical_json, open_artifact

# The value a gate metric has when the candidate is the reference itself (see NOTE above).
REFERENCE_VALUES = {"kl": 0.0, "top1_agreement": 1.0, "ppl_ratio": 1.0, "greedy_agreement": 1.0}
# Recipe keys that always differ between artifacts and say nothing about the build.
IGNORED_RECIPE_KEYS = ("name", "output_dir")
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PERCENTILES = ("p50", "p90", "p95", "p99")
# The throughput figure each benchmark kind gives (the quality-vs-throughput axis), best kind first.
THROUGHPUT_FIELD = {"serve": "output_token_throughput", "throughput": "output_tok_s", "latency": "decode_tok_s"}
THROUGHPUT_LABEL = {"serve": "bench serve output tokens/s", "throughput": "bench throughput output tokens/s",
                    "latency": "bench latency batch-1 decode tokens/s"}


class CompareError(ValueError):
    """Artifacts or benchmark files that cannot be compared; the message says which and why."""


@dataclass
class Sizes:
    """Bytes and bits per weight of one artifact, from its manifest and graph.json."""

    artifact_bytes: int  # every file of the artifact directory
    weights_bytes: int  # the weight tensors (safetensors payload)
    num_parameters: int  # logical parameters: quantized linears counted as in_features x out_features
    num_linears: int  # linear ops in the graph (lm_head not included)
    num_quantized_linears: int
    # qweight, scales, zeros, ... of the quantized linears (and a quantized lm_head, and quantized experts)
    quantized_linear_bytes: int
    quantized_linear_parameters: int
    lm_head_quantized: bool = False  # quantization.lm_head: counted in the quantized bytes and parameters
    num_quantized_moe_layers: int = 0  # moe nodes whose experts are quantized: counted in the quantized bytes too

    @property
    def bpw_quantized(self) -> float | None:
        if not self.quantized_linear_parameters:
            return None
        return self.quantized_linear_bytes * 8 / self.quantized_linear_parameters

    @property
    def bpw_overall(self) -> float:
        return self.weights_bytes * 8 / self.num_parameters


@dataclass
class BenchRecord:
    """One benchmark result attached to an artifact."""

    kind: str  # "serve" | "sweep" (bench serve over several request rates) | "latency" | "throughput"
    source: str  # the file it came from, as given on the command line
    data: dict[str, Any]  # the JSON object as written by `builder bench`

    @property
    def throughput(self) -> float:
        return float(self.data[THROUGHPUT_FIELD[self.kind]])


@dataclass
class Entry:
    """One artifact in the comparison."""

    label: str  # unique display name: manifest name, else directory name, else path
    path: Path
    manifest: dict[str, Any]
    sizes: Sizes
    layer_errors: dict[str, float]  # relative output error per quantized linear (calibration data or random inputs)
    bench: list[BenchRecord] = field(default_factory=list)
    quality: float | None = None  # the chosen metric; None: not measured
    is_reference: bool = False  # unquantized: quality is the metric's reference value
    pareto_size: bool = False
    pareto_throughput: bool = False

    # Manifest fields read with defaults: artifacts written by older toolchains lack some of them.
    @property
    def gates(self) -> dict[str, Any] | None:
        return self.manifest.get("quantization", {}).get("gates")

    @property
    def algo(self) -> str:
        return self.manifest.get("quantization", {}).get("algo", "none")

    @property
    def kv_cache_dtype(self) -> str:
        q = self.manifest.get("quantization", {})
        return q.get("kv_cache_dtype") or self.manifest.get("runtime", {}).get("kv_cache_dtype", "auto")

    @property
    def dtype(self) -> str:
        return self.manifest["model"].get("dtype", "?")

    @property
    def calibration(self) -> dict[str, Any] | None:
        return self.manifest.get("quantization", {}).get("calibration")

    @property
    def build_s(self) -> float | None:
        return self.manifest["build"].get("duration_s")

    def timing(self, key: str) -> float | None:
        return self.manifest["build"].get("timings_s", {}).get(key)

    @property
    def gates_failed(self) -> bool:
        return bool(self.gates) and not self.gates["passed"]

    def metric(self, name: str) -> dict[str, Any] | None:
        return next((m for m in (self.gates or {}).get("metrics", []) if m["name"] == name), None)


@dataclass
class Comparison:
    """Everything the templates render."""

    entries: list[Entry]
    quality_metric: str
    minimise_quality: bool  # the metric's gate direction is "<="
    recipe_diff: list[tuple[str, list[Any]]]  # (dotted key, value per entry; MISSING where absent)
    gate_metrics: list[str]  # metric names in first-seen order
    hot_layers: list[str]  # union of every entry's top layers, worst first
    top_layers: int
    throughput_kind: str | None  # which benchmark figure the quality-vs-throughput view uses
    notes: list[str]  # caveats printed at the top of the report

    @property
    def has_bench(self) -> bool:
        return any(e.bench for e in self.entries)

    def throughput_of(self, e: Entry) -> float | None:
        """The entry's best figure of the benchmark kind the quality-vs-throughput view uses."""
        figures = [b.throughput for b in e.bench if b.kind == self.throughput_kind]
        return max(figures) if figures else None

    def bench_rows(self, kind: str) -> list[tuple[Entry, BenchRecord]]:
        return [(e, b) for e in self.entries for b in e.bench if b.kind == kind]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()  # a recipe key one artifact does not have


# ---------------------------------------------------------------- artifacts


def load_entry(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, graph) of an artifact; sizes are checked, hashes are not (reports read no weights)."""
    try:
        a = open_artifact(path, check_hashes=False)
    except ArtifactError as e:
        raise CompareError(f"artifact {path}: {e}") from e
    return a.manifest, a.graph


def weight_sizes(path: Path, manifest: dict[str, Any], graph: dict[str, Any]) -> Sizes:
    """Sizes and the parameter count with quantized linears counted unpacked (in x out, plus bias)."""
    import torch

    def numel(shape: list[int]) -> int:
        return math.prod(shape)

    params = graph["params"]  # name -> {"shape", "dtype"}
    nbytes = {n: numel(p["shape"]) * getattr(torch, p["dtype"]).itemsize for n, p in params.items()}
    linears = [n for n in graph["nodes"] if n["op"] == "linear"]
    heads = [n for n in graph["nodes"] if n["op"] == "lm_head" and n["attrs"].get("quant")]
    quantized = [n for n in linears if n["attrs"].get("quant")] + heads
    quant_tensors = {t for n in quantized for t in n["weights"].values()}
    quant_params = sum(n["attrs"]["in_features"] * n["attrs"]["out_features"]
                       + (numel(params[n["weights"]["bias"]]["shape"]) if "bias" in n["weights"] else 0)
                       for n in quantized)
    # quantized experts (a moe node's fp8 codes, or packed int4 codes, and their scales) count with the quantized
    # linears: their codes hold one logical parameter each (two a byte for int4), the scales and zeros none; the
    # router and expert biases stay float
    moes = [n for n in graph["nodes"] if n["op"] == "moe" and n["attrs"].get("quant")]
    for n in moes:
        roles = [r for r in ("w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale", "w_gate_up_scales",
                             "w_gate_up_zeros", "w_down_scales", "w_down_zeros") if r in n["weights"]]
        quant_tensors |= {n["weights"][r] for r in roles}
        per_code = 2 if n["attrs"]["quant"].get("scheme") == "w4a16" else 1  # w4a16: two codes a byte
        quant_params += per_code * sum(numel(params[n["weights"][r]]["shape"]) for r in ("w_gate_up", "w_down"))
    other_params = sum(numel(p["shape"]) for name, p in params.items() if name not in quant_tensors)
    return Sizes(
        artifact_bytes=sum(f["bytes"] for f in manifest["files"].values()) + (path / MANIFEST).stat().st_size,
        weights_bytes=manifest["weights"]["bytes"],
        num_parameters=quant_params + other_params,
        num_linears=len(linears),
        num_quantized_linears=len(quantized) - len(heads),
        num_quantized_moe_layers=len(moes),
        quantized_linear_bytes=sum(nbytes[t] for t in quant_tensors),
        quantized_linear_parameters=quant_params,
        lm_head_quantized=bool(heads),
    )


def layer_errors(manifest: dict[str, Any]) -> dict[str, float]:
    """Every quantized linear's relative output error recorded by the quantization passes."""
    errors: dict[str, float] = {}
    for record in manifest["build"]["passes"]:
        errors.update(record.get("details", {}).get("layer_errors", {}))
    if not errors:  # older manifests: only the gates' top list
        errors = dict((manifest.get("quantization", {}).get("gates") or {}).get("worst_layers", []))
    return errors


def model_identity(manifest: dict[str, Any]) -> dict[str, str]:
    """What makes two artifacts builds of one model: the source config and weight files' hashes."""
    files = manifest["source"].get("files", {})
    identity = {f: h for f, h in files.items() if f == "config.json" or f.endswith((".safetensors", ".bin"))}
    if not identity:
        identity = {"config": hashlib.sha256(canonical_json(manifest["source"]["config"])).hexdigest()}
    return identity


def check_same_model(entries: list[Entry]) -> None:
    first = entries[0]
    want = model_identity(first.manifest)
    for e in entries[1:]:
        got = model_identity(e.manifest)
        if got != want:
            differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            detail = ", ".join(f"{k} {str(want.get(k, '-'))[:12]} vs {str(got.get(k, '-'))[:12]}" for k in differ)
            raise CompareError(
                f"{first.label} and {e.label} are builds of different models: {first.label} from "
                f"{first.manifest['source']['checkpoint']}, {e.label} from {e.manifest['source']['checkpoint']} "
                f"(source sha256 differs: {detail}); compare artifacts built from one checkpoint")


def _labels(paths: list[Path], manifests: list[dict[str, Any]]) -> list[str]:
    for candidates in ([m["name"] for m in manifests], [p.name for p in paths], [str(p) for p in paths]):
        if len(set(candidates)) == len(candidates):
            return candidates
    raise CompareError("the same artifact is given twice: " + ", ".join(str(p) for p in paths))


# ---------------------------------------------------------------- recipe, gates, hot spots


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": 1, "quantization[0].algo": "gptq", "ignore": ["x"]}: lists of scalars stay values."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def values_differ(a: Any, b: Any) -> bool:
    """Recipe values compared as JSON; a key one recipe lacks (older toolchain) counts as null."""
    def norm(v: Any) -> str:
        return json.dumps(None if v is MISSING else v, sort_keys=True)

    return norm(a) != norm(b)


def recipe_diff(recipes: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The keys whose values differ between the recipes, in first-seen order.

    When any recipe has a list of quantization sections, single sections are compared as lists of
    one, so ``quantization[0].algo`` lines up across all of them.
    """
    recipes = [{k: v for k, v in r.items() if k not in IGNORED_RECIPE_KEYS} for r in recipes]
    if any(isinstance(r.get("quantization"), list) for r in recipes):
        recipes = [{**r, "quantization": [r["quantization"]]} if isinstance(r.get("quantization"), dict) else r
                   for r in recipes]
    flat = [flatten(r) for r in recipes]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    rows = []
    for k in keys:
        values = [f.get(k, MISSING) for f in flat]
        if any(values_differ(v, values[0]) for v in values[1:]):
            rows.append((k, values))
    return rows


def _quality(entry: Entry, metric: str) -> tuple[float | None, bool]:
    found = entry.metric(metric)
    if found is not None:
        return float(found["value"]), False
    unquantized = entry.algo == "none" and entry.kv_cache_dtype == "auto"
    if unquantized and metric in REFERENCE_VALUES:
        return REFERENCE_VALUES[metric], True
    return None, False


def pareto_front(points: list[tuple[float, float] | None]) -> list[bool]:
    """Which points no other point dominates, both coordinates minimised; None never qualifies.

    A point is dominated when another is no worse in both coordinates and better in one; equal
    points do not dominate each other.
    """
    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] <= b[0] and a[1] <= b[1] and a != b

    return [p is not None and not any(q is not None and dominates(q, p) for q in points) for p in points]


def mark_pareto(c: Comparison) -> None:
    """Set each entry's Pareto flags: weight bytes vs quality, and throughput vs quality."""
    sign = 1.0 if c.minimise_quality else -1.0  # pareto_front minimises both coordinates
    known = [e.quality is not None for e in c.entries]
    size_points = [(float(e.sizes.weights_bytes), sign * e.quality) if ok else None for e, ok in zip(c.entries, known)]
    tp = [c.throughput_of(e) for e in c.entries]
    tp_points = [(-t, sign * e.quality) if ok and t is not None else None for e, ok, t in zip(c.entries, known, tp)]
    for e, on_size, on_tp in zip(c.entries, pareto_front(size_points), pareto_front(tp_points)):
        e.pareto_size, e.pareto_throughput = on_size, on_tp


def _throughput_kind(entries: list[Entry]) -> str | None:
    """The benchmark kind that covers the most artifacts (serve, then throughput, then latency on ties)."""
    counts = {k: sum(any(b.kind == k for b in e.bench) for e in entries) for k in THROUGHPUT_FIELD}
    best = max(THROUGHPUT_FIELD, key=lambda k: counts[k])  # max keeps the first of equal counts
    return best if counts[best] else None


def _hot_layers(entries: list[Entry], top: int) -> list[str]:
    tops = {name: err for e in entries for name, err in sorted(e.layer_errors.items(), key=lambda kv: -kv[1])[:top]}
    worst = {name: max(e.layer_errors.get(name, 0.0) for e in entries) for name in tops}
    return sorted(worst, key=lambda n: -worst[n])


def is_top_layer(entry: Entry, name: str, top: int) -> bool:
    return name in dict(sorted(entry.layer_errors.items(), key=lambda kv: -kv[1])[:top])


def _notes(entries: list[Entry], metric: str, throughput_kind: str | None) -> list[str]:
    notes = []
    gated = [e for e in entries if e.gates]
    settings = {json.dumps({k: e.manifest["recipe"].get("gates", {}).get(k) for k in
                            ("eval_dataset", "num_positions", "window")}) for e in gated}
    if len(settings) > 1:
        notes.append("the gates were measured with different eval_dataset / num_positions / window settings "
                     "(see the recipe differences); their metrics are not strictly comparable")
    dtypes = {e.dtype for e in entries}
    if len(dtypes) > 1:
        notes.append(f"the artifacts were built in different dtypes ({', '.join(sorted(dtypes))}); each "
                     f"quantized build is gated against the unquantized graph of its own dtype")
    for e in entries:
        if e.gates_failed:
            notes.append(f"{e.label} FAILED its gates ({', '.join(e.gates['failed'])}); the runtime refuses it "
                         f"unless told --allow-failed-gate")
        if e.quality is None:
            notes.append(f"{e.label} has no {metric} measurement (gates not run), so it is left out of the "
                         f"plots and the Pareto sets")
    if throughput_kind is not None:
        other = sorted({b.kind for e in entries for b in e.bench} - {throughput_kind})
        if other:
            notes.append(f"quality vs throughput uses {THROUGHPUT_LABEL[throughput_kind]}; "
                         f"{', '.join(other)} results are tabled but not plotted against it")
    return notes


# ---------------------------------------------------------------- benchmarks


def read_bench_file(path: Path) -> list[BenchRecord]:
    """A `bench serve --json` object (or several) or `bench latency|throughput --json` lines."""
    if not path.is_file():
        raise CompareError(f"bench file {path} does not exist")
    text = path.read_text()
    try:
        doc = json.loads(text)
        objects = doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        objects = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    objects.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CompareError(f"bench file {path} line {i}: not JSON ({e.msg}); expected the output "
                                       f"of `builder bench serve|latency|throughput --json`") from e
    if not objects:
        raise CompareError(f"bench file {path} is empty")
    # `bench latency --batch-size` lines (decode step times) are no throughput figure of the artifact: skipped
    return [_bench_record(path, i, obj) for i, obj in enumerate(objects, 1)
            if not (isinstance(obj, dict) and "decode_step_ms" in obj)]


def _bench_record(path: Path, index: int, obj: Any) -> BenchRecord:
    where = f"bench file {path} (record {index})"
    if not isinstance(obj, dict):
        raise CompareError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("kind") in ("bench_serve", "bench_serve_sweep"):
        if obj.get("version") != 1:
            raise CompareError(f"{where}: {obj['kind']} version {obj.get('version')!r} is not supported (reads 1)")
        if obj["kind"] == "bench_serve":
            kind, required = "serve", ("request_throughput", "output_token_throughput", *LATENCY_KEYS)
        else:
            kind, required = "sweep", ("slos_ms", "points")
    elif "decode_tok_s" in obj:
        kind, required = "latency", ("input_len", "output_len", "ttft_ms", "decode_tok_s")
    elif "output_tok_s" in obj:
        kind, required = "throughput", ("input_len", "output_len", "concurrency", "output_tok_s")
    else:
        raise CompareError(f"{where}: not a `builder bench` result (no kind 'bench_serve', no decode_tok_s or "
                           f"output_tok_s field)")
    missing = [k for k in required if obj.get(k) is None]
    if missing:
        raise CompareError(f"{where}: {kind} result without {', '.join(missing)}")
    if kind == "serve":
        bad = [k for k in LATENCY_KEYS if not isinstance(obj[k], dict)]
        if bad:
            raise CompareError(f"{where}: {', '.join(bad)} should be objects of mean/p50/p90/p95/p99")
    if kind == "sweep":
        points = obj["points"]
        if not isinstance(points, list) or not points or not all(
                isinstance(p, dict) and isinstance(p.get("request_rate"), (int, float)) for p in points):
            raise CompareError(f"{where}: \"points\" should be a non-empty list of objects with a request_rate")
    return BenchRecord(kind, str(path), obj)


def _match(entries: list[Entry], key: str) -> list[Entry]:
    p = Path(key)
    return [e for e in entries if key in (e.label, e.manifest["name"], e.path.name)
            or (p.exists() and p.resolve() == e.path.resolve())]


def _available(entries: list[Entry]) -> str:
    return ", ".join(f"{e.label} ({e.path})" for e in entries)


def attach_bench(entries: list[Entry], specs: list[str]) -> None:
    """--bench [ARTIFACT=]FILE: to the named artifact, else by each record's "model" field."""
    for spec in specs:
        key, sep, file = spec.partition("=")
        if sep and (_match(entries, key) or not Path(spec).is_file()):
            targets = _match(entries, key)
            if not targets:
                raise CompareError(f"--bench {spec}: no artifact is named {key!r}; artifacts: {_available(entries)}")
            if len(targets) > 1:
                raise CompareError(f"--bench {spec}: {key!r} names several artifacts; use the directory path")
            targets[0].bench += read_bench_file(Path(file))
            continue
        for record in read_bench_file(Path(spec)):
            model = record.data.get("model")
            if not model:
                raise CompareError(f"bench file {spec} has no \"model\" field (bench latency/throughput lines do "
                                   f"not record one); attach it with --bench ARTIFACT={spec}; artifacts: "
                                   f"{_available(entries)}")
            targets = _match(entries, str(model))
            if len(targets) != 1:
                why = "matches none" if not targets else "matches several"
                raise CompareError(f"bench file {spec}: its model {model!r} {why} of the artifacts "
                                   f"{_available(entries)}; attach it with --bench ARTIFACT={spec}")
            targets[0].bench.append(record)


def _failed_count(failed: Any) -> Any:
    if isinstance(failed, dict):
        return sum(v for v in failed.values() if isinstance(v, (int, float)))
    return failed


def _pairs(d: Any) -> Any:
    return ", ".join(f"{k}={fmt(v)}" for k, v in d.items()) if isinstance(d, dict) else d


# (row label, is a number, value from one bench serve result), in the order the serve table shows them.
SERVE_ROWS: list[tuple[str, bool, Any]] = [
    ("endpoint", False, lambda d: d.get("endpoint")),
    ("config", False, lambda d: _pairs(d.get("config"))),
    ("started at", False, lambda d: d.get("started_at")),
    ("requests completed / sent", True, lambda d: f"{fmt(d.get('completed'))} / {fmt(d.get('num_requests'))}"),
    ("failed", True, lambda d: _failed_count(d.get("failed"))),
    ("duration (s)", True, lambda d: d.get("duration_s")),
    ("requests/s", True, lambda d: d["request_throughput"]),
    ("output tokens/s", True, lambda d: d["output_token_throughput"]),
    ("total tokens/s", True, lambda d: d.get("total_token_throughput")),
    ("input / output tokens", True,
     lambda d: f"{fmt(d.get('total_input_tokens'))} / {fmt(d.get('total_output_tokens'))}"),
    *[(f"{key.replace('_ms', '').upper()} {stat} (ms)", True, lambda d, key=key, stat=stat: d[key].get(stat))
      for key in LATENCY_KEYS for stat in ("mean", *PERCENTILES)],
    ("goodput requests/s", True, lambda d: (d.get("goodput") or {}).get("request_throughput")),
    ("goodput fraction", True, lambda d: (d.get("goodput") or {}).get("fraction")),
    ("goodput SLOs (ms)", False, lambda d: _pairs((d.get("goodput") or {}).get("slos_ms"))),
]


def _bench_label(e: Entry, b: BenchRecord) -> str:
    """The artifact's label, with the file's name when the artifact has several results of that kind."""
    return e.label if sum(r.kind == b.kind for r in e.bench) == 1 else f"{e.label} ({Path(b.source).name})"


def serve_table(c: Comparison) -> tuple[list[str], list[tuple[str, bool, list[str]]]]:
    """Columns (one per bench serve result) and formatted rows of the serving benchmark table."""
    records = c.bench_rows("serve")
    columns = [_bench_label(e, r) for e, r in records]
    rows = [("file", False, [r.source for _, r in records]),
            ("server / model", False, [f"{r.data.get('url', '?')} / {r.data.get('model', '?')}" for _, r in records])]
    rows += [(label, numeric, [fmt(get(r.data)) for _, r in records]) for label, numeric, get in SERVE_ROWS]
    return columns, rows


# (column label, field of a sweep point) per sweep file in the goodput-vs-rate table.
SWEEP_FIELDS = (("goodput req/s", "goodput_request_throughput"), ("p99 TTFT (ms)", "ttft_p99_ms"),
                ("p99 TPOT (ms)", "tpot_p99_ms"))


@dataclass
class SweepTable:
    """The goodput-vs-rate table: offered rates as rows, SWEEP_FIELDS per sweep file as columns."""

    columns: list[str]  # one per sweep file
    rates: list[float]  # every offered rate of any sweep, increasing
    cells: list[list[list[str]]]  # [rate][file][field], formatted; "—" where the file has no such rate
    meets: list[list[bool | None]]  # [rate][file]: the rate met the file's SLOs at p99 (None: no SLOs, no rate)
    footer: list[tuple[str, list[str]]]  # (label, value per file): goodput rate, SLOs, lengths, file


def sweep_table(c: Comparison) -> SweepTable | None:
    records = c.bench_rows("sweep")
    if not records:
        return None
    by_rate = [{float(p["request_rate"]): p for p in r.data["points"]} for _, r in records]
    rates = sorted(set().union(*by_rate))
    cells = [[[fmt(pts[rate].get(f)) if rate in pts else "—" for _, f in SWEEP_FIELDS] for pts in by_rate]
             for rate in rates]
    meets = [[pts[rate].get("meets_slos") if rate in pts else None for pts in by_rate] for rate in rates]

    def lengths(d: dict[str, Any]) -> str:
        config = (d.get("runs") or [{}])[0].get("config") or {}
        realized = config.get("realized_lengths")
        text = config.get("length_dist", "?")
        if realized:
            text += "; " + ", ".join(f"{side} mean {fmt(st.get('mean'))} / p50 {fmt(st.get('p50'))} / p90 "
                                     f"{fmt(st.get('p90'))}" for side, st in realized.items())
        return text

    footer = [("goodput rate (req/s)", [fmt(r.data.get("goodput_rate")) for _, r in records]),
              ("SLOs at p99 (ms)", [_pairs(r.data["slos_ms"]) or "none" for _, r in records]),
              ("lengths (tokens)", [lengths(r.data) for _, r in records]),
              ("server / model", [f"{r.data.get('url', '?')} / {r.data.get('model', '?')}" for _, r in records]),
              ("file", [r.source for _, r in records])]
    return SweepTable([_bench_label(e, r) for e, r in records], rates, cells, meets, footer)


# ---------------------------------------------------------------- assembling


def compare(paths: list[Path], bench: list[str] | None = None, quality_metric: str = "kl",
            top_layers: int = 5) -> Comparison:
    """Read the artifacts and benchmark files and work out everything the report shows."""
    if len(paths) < 2:
        raise CompareError(f"compare needs at least two artifacts, got {len(paths)}")
    if top_layers < 1:
        raise CompareError(f"top_layers must be at least 1, got {top_layers}")
    paths = [Path(p) for p in paths]
    if len({p.resolve() for p in paths}) != len(paths):
        raise CompareError("the same artifact directory is given twice: " + ", ".join(str(p) for p in paths))
    loaded = [load_entry(p) for p in paths]
    manifests = [m for m, _ in loaded]
    entries = [Entry(label, p, m, weight_sizes(p, m, g), layer_errors(m))
               for label, p, (m, g) in zip(_labels(paths, manifests), paths, loaded)]
    check_same_model(entries)
    attach_bench(entries, list(bench or []))

    gate_metrics = list(dict.fromkeys(m["name"] for e in entries for m in (e.gates or {}).get("metrics", [])))
    if gate_metrics and quality_metric not in gate_metrics:
        raise CompareError(f"quality metric {quality_metric!r} is not among the gate metrics: "
                           f"{', '.join(gate_metrics)}")
    directions = {e.metric(quality_metric)["direction"] for e in entries if e.metric(quality_metric)}
    minimise = directions != {">="}
    for e in entries:
        e.quality, e.is_reference = _quality(e, quality_metric)
    kind = _throughput_kind(entries)
    c = Comparison(
        entries=entries, quality_metric=quality_metric, minimise_quality=minimise,
        recipe_diff=recipe_diff([e.manifest["recipe"] for e in entries]), gate_metrics=gate_metrics,
        hot_layers=_hot_layers(entries, top_layers), top_layers=top_layers, throughput_kind=kind,
        notes=_notes(entries, quality_metric, kind))
    mark_pareto(c)
    return c


# ---------------------------------------------------------------- plots


@dataclass
class Plot:
    """One figure: inline markup for the HTML, a file for the Markdown."""

    slug: str  # file name part: <report stem>-<slug>.svg
    title: str
    svg: str  # a standalone SVG document


def _figure(width: float = 6.4, height: float = 4.2):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise CompareError("the comparison plots need matplotlib: pip install 'matplotlib>=3.7' "
                           "(part of llm-builder[build])") from e
    # Figure() without pyplot: no GUI backend and no global figure state; savefig renders SVG directly.
    return Figure(figsize=(width, height), layout="constrained")


def _to_svg(fig, slug: str) -> str:
    import io

    import matplotlib

    buf = io.StringIO()
    # fonttype none: text stays text (small, searchable); hashsalt: ids differ between inline SVGs.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": slug}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def _quality_axis(ax, c: Comparison, values: list[float]) -> None:
    better = "lower" if c.minimise_quality else "higher"
    ax.set_ylabel(f"{c.quality_metric} vs unquantized ({better} is better)")
    positive = [v for v in values if v > 0]
    if positive and c.minimise_quality and max(positive) / min(positive) > 20:
        ax.set_yscale("symlog", linthresh=min(positive))


def _color(c: Comparison, e: Entry) -> str:
    return f"C{c.entries.index(e) % 10}"  # one colour per artifact across every plot


def _scatter(c: Comparison, points: list[tuple[Entry, float]], pareto: list[bool], xlabel: str, slug: str,
             title: str) -> Plot:
    """Quality against x, one colour per artifact: Pareto points starred and joined, gate-failed ones
    crossed, the gate threshold dashed when all artifacts share one."""
    fig = _figure(8.0, 4.2)
    ax = fig.add_subplot()
    for (e, x), on in zip(points, pareto):
        marker = "X" if e.gates_failed else "*" if on else "o"
        tag = " ★" if on else ""
        tag += " (reference)" if e.is_reference else " (gates failed)" if e.gates_failed else ""
        ax.scatter([x], [e.quality], s=220 if on else 70, marker=marker, color=_color(c, e), zorder=3,
                   edgecolors="#222", linewidths=0.5, label=e.label + tag)
    front = sorted((x, e.quality) for (e, x), on in zip(points, pareto) if on)
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="#57606a", lw=1, ls=":", zorder=2,
                label="Pareto front")
    thresholds = {e.metric(c.quality_metric)["threshold"] for e, _ in points if e.metric(c.quality_metric)}
    values = [e.quality for e, _ in points]
    pad = 0.2 * ((max(values) - min(values)) or abs(max(values)))
    if len(thresholds) == 1 and min(values) - pad <= (t := thresholds.pop()) <= max(values) + pad:
        ax.axhline(t, color="#cf222e", lw=0.8, ls="--", label="gate threshold")  # only near the points
    _quality_axis(ax, c, values)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.12, y=0.12)
    fig.legend(loc="outside right upper", fontsize=8, markerscale=0.7)
    return Plot(slug, title, _to_svg(fig, slug))


def _latency_plot(c: Comparison) -> Plot | None:
    rows = c.bench_rows("serve")
    if not rows:
        return None
    fig = _figure(8.0, 5.6)
    axes = fig.subplots(2, 2)
    styles = ("-", "--", "-.", ":")
    for ax, key in zip(axes.flat, LATENCY_KEYS):
        seen: dict[str, int] = {}
        for e, b in rows:
            n = seen[e.label] = seen.get(e.label, -1) + 1
            several = sum(r.kind == "serve" for r in e.bench) > 1
            ys = [b.data[key].get(p) for p in PERCENTILES]
            xs = [i for i, y in enumerate(ys) if y is not None]
            ax.plot(xs, [ys[i] for i in xs], marker="o", color=_color(c, e), ls=styles[n % len(styles)],
                    label=f"{e.label} ({Path(b.source).name})" if several else e.label)
        ax.set_xticks(range(len(PERCENTILES)), PERCENTILES)
        ax.set_title(key.replace("_ms", "").upper() + " (ms)", fontsize=9)
        ax.grid(True, alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    fig.suptitle("Latency percentiles (bench serve)", fontsize=10)
    return Plot("latency", "Latency percentiles (bench serve)", _to_svg(fig, "latency"))


def _sweep_plot(c: Comparison) -> Plot | None:
    """Goodput req/s, p99 TTFT and p99 TPOT against the offered request rate, one line per sweep file; filled
    markers where the rate met that sweep's SLOs, hollow where it did not, the SLO bounds dashed."""
    rows = c.bench_rows("sweep")
    if not rows:
        return None
    fig = _figure(10.0, 3.6)
    axes = fig.subplots(1, 3)
    panels = (("goodput_request_throughput", "goodput (req/s)", None), ("ttft_p99_ms", "p99 TTFT (ms)", "ttft"),
              ("tpot_p99_ms", "p99 TPOT (ms)", "tpot"))
    styles = ("-", "--", "-.", ":")
    seen: dict[str, int] = {}
    for e, b in rows:
        n = seen[e.label] = seen.get(e.label, -1) + 1
        color, ls = _color(c, e), styles[n % len(styles)]
        points = sorted(b.data["points"], key=lambda p: p["request_rate"])
        for ax, (key, _, _) in zip(axes, panels):
            xy = [(p["request_rate"], p.get(key), p.get("meets_slos")) for p in points if p.get(key) is not None]
            ax.plot([x for x, _, _ in xy], [y for _, y, _ in xy], color=color, ls=ls, lw=1.2,
                    label=_bench_label(e, b) if ax is axes[0] else None)
            for x, y, met in xy:
                ax.plot([x], [y], marker="o", ms=5, color=color, mfc=color if met is not False else "white")
    rates = sorted({float(p["request_rate"]) for _, b in rows for p in b.data["points"]})
    axes[0].plot([rates[0], rates[-1]], [rates[0], rates[-1]], color="#57606a", lw=0.8, ls=":",
                 label="offered rate")
    for ax, (_, label, slo) in zip(axes, panels):
        bounds = {b.data["slos_ms"].get(slo) for _, b in rows} if slo else set()
        if len(bounds) == 1 and (bound := bounds.pop()) is not None:
            ax.axhline(bound, color="#cf222e", lw=0.8, ls="--")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    title = "Goodput and p99 latency vs offered request rate (bench serve sweeps)"
    fig.suptitle(title, fontsize=10)
    return Plot("goodput", title, _to_svg(fig, "goodput"))


def make_plots(c: Comparison) -> list[Plot]:
    plots = []
    known = [e for e in c.entries if e.quality is not None]
    if known:
        points = [(e, e.sizes.weights_bytes / 2**20) for e in known]
        plots.append(_scatter(c, points, [e.pareto_size for e in known], "weights (MiB)", "quality-size",
                              f"{c.quality_metric} vs weight size"))
    if c.throughput_kind is not None:
        benched = [(e, c.throughput_of(e)) for e in known if c.throughput_of(e) is not None]
        if benched:
            plots.append(_scatter(c, benched, [e.pareto_throughput for e, _ in benched],
                                  THROUGHPUT_LABEL[c.throughput_kind], "quality-throughput",
                                  f"{c.quality_metric} vs throughput"))
    for plot in (_latency_plot(c), _sweep_plot(c)):
        if plot is not None:
            plots.append(plot)
    return plots


def inline_svg(svg: str) -> str:
    """An SVG document as an element for HTML5: no XML prolog, doctype, RDF metadata or namespace URLs."""
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", svg, count=2)


# ---------------------------------------------------------------- rendering


def fmt(value: Any) -> str:
    """Numbers as the report shows them: floats to 4 significant digits, ints with separators."""
    if value is None:
        return "—"
    if value is MISSING:
        return "(absent)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def recipe_value(value: Any, max_chars: int = 120) -> str:
    """A recipe value as YAML would write it (null, true, [..]), shortened past max_chars (0: never)."""
    text = "null" if value is None else fmt(value) if value is MISSING or isinstance(value, str) else json.dumps(value)
    return text if not max_chars or len(text) <= max_chars else text[:max_chars - 1] + "…"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("builder", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "html.j2"]), trim_blocks=True,
                             lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["fmt"] = fmt
    env.filters["recipe_value"] = recipe_value
    env.filters["mib"] = lambda n: f"{n / 2**20:,.2f} MiB"
    env.filters["md"] = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    env.globals.update(is_top_layer=is_top_layer, values_differ=values_differ,
                       THROUGHPUT_LABEL=THROUGHPUT_LABEL, serve_table=serve_table, sweep_table=sweep_table,
                       SWEEP_FIELDS=SWEEP_FIELDS)
    return env


def render(c: Comparison, plots: list[Plot], plot_files: dict[str, str]) -> dict[str, str]:
    """{"html": ..., "md": ...}; plot_files maps a plot's slug to its file name beside report.md."""
    env = _env()
    ctx = {"c": c, "plots": plots, "plot_files": plot_files,
           "inline": {p.slug: Markup(inline_svg(p.svg)) for p in plots}}
    return {"html": env.get_template("compare.html.j2").render(**ctx),
            "md": env.get_template("compare.md.j2").render(**ctx)}


def write_reports(c: Comparison, html_path: Path) -> list[Path]:
    """Write <html_path>, the Markdown beside it (same stem, .md) and its plot files; returns the paths."""
    html_path = Path(html_path)
    if html_path.suffix.lower() == ".md":
        raise CompareError(f"-o {html_path}: name the HTML file (e.g. report.html); the Markdown is written "
                           f"beside it")
    if html_path.is_dir():
        raise CompareError(f"-o {html_path} is a directory; name the HTML file, e.g. {html_path / 'compare.html'}")
    where = html_path.parent.absolute().resolve()
    inside = next((e for e in c.entries if where == (root := Path(e.path).absolute().resolve())
                   or root in where.parents), None)
    if inside is not None:  # its own report.html / report.md are files its manifest lists: the artifact would break
        raise CompareError(f"-o {html_path} is inside the artifact {inside.path} being compared; an artifact's files "
                           f"are fixed by its manifest: write the report elsewhere")
    plots = make_plots(c)
    plot_files = {p.slug: f"{html_path.stem}-{p.slug}.svg" for p in plots}
    text = render(c, plots, plot_files)
    md_path = html_path.with_suffix(".md")
    written = [html_path, md_path]
    try:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(text["html"])
        md_path.write_text(text["md"])
        for p in plots:
            f = html_path.parent / plot_files[p.slug]
            f.write_text(p.svg)
            written.append(f)
    except OSError as e:
        raise CompareError(f"-o {html_path}: cannot write the report ({e})") from None
    return written

"""The build recipe: YAML validated once, at load, into typed models that reject unknown keys.

Errors name the key's path, the bad value and what is allowed, e.g.
``quantization.algo: 'awk' is not one of awq, gptq, smoothquant, fp8, int8_wo, none``.
Relative paths in a recipe are relative to the directory ``builder`` runs in.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_PASSES = ["merge_qkv", "merge_gate_up", "fuse_silu_mul", "fuse_add_rms_norm", "dce", "verify"]
DEFAULT_VERIFY_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\nclass Config:\n",
    "The quick brown fox jumps over the lazy dog.",
]
# Default verify tolerance (max |logit difference|) per build dtype.
DEFAULT_ATOL = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 2.5e-1}


class RecipeError(ValueError):
    """A recipe that cannot be read or does not validate; the message lists every problem."""


class _Strict(BaseModel):
    # strict: YAML's true is not the number 1, 128.0 is not a whole number, "8" is not a number
    # (a float field still takes a whole number: 1 for 1.0)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


NonBlank = Annotated[str, AfterValidator(_not_blank)]


def _module_pattern(value: str) -> str:
    """A module path, or ``re:`` and a regular expression, checked to compile."""
    if not value.strip():
        raise ValueError("must not be empty; give a module path (model.layers.0.mlp.down_proj) or re:REGEX")
    if value.startswith("re:"):
        try:
            re.compile(value[3:])
        except re.error as e:
            raise ValueError(f"'{value}' is not a valid regular expression ({e}); after 're:' comes a Python "
                             f"regex, e.g. 're:layers\\.0\\.'") from None
    return value


ModulePattern = Annotated[str, AfterValidator(_module_pattern)]


class ModelSection(_Strict):
    checkpoint: NonBlank = Field(description="local Hugging Face checkpoint directory")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"


class VerifySection(_Strict):
    prompts: list[str] = Field(default_factory=lambda: list(DEFAULT_VERIFY_PROMPTS), min_length=1)
    atol: Optional[float] = Field(default=None, gt=0, description="max |logit error|; default per dtype")


class SpeculativeSection(_Strict):
    """Speculative decoding the artifact serves with unless the server is told otherwise (``runtime.speculative``;
    see runtime.speculative): n-gram lookup, or a draft model, another artifact built by this toolchain with the
    same tokenizer, which the build copies into the artifact (``draft/``: the artifact still needs nothing else), or
    an EAGLE-1 head over the model's own hidden states (runtime.eagle: a checkpoint directory of config.json and
    model.safetensors, copied into ``eagle/``)."""

    method: Optional[Literal["ngram", "draft", "eagle"]] = None  # None: no speculation
    num_speculative_tokens: Optional[int] = Field(default=None, ge=1, le=16,
                                                  description="most draft tokens per request and step (default: 12 "
                                                              "for ngram, 4 for draft)")
    min_ngram: int = Field(default=3, ge=1)
    max_ngram: int = Field(default=6, ge=1)
    draft_model: Optional[str] = Field(default=None, description="method draft: the draft artifact's directory; "
                                                                  "method eagle: the EAGLE head's checkpoint directory")

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculativeSection:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {self.min_ngram} is above max_ngram {self.max_ngram}")
        if (self.method in ("draft", "eagle")) != (self.draft_model is not None):
            raise ValueError(f"methods 'draft' and 'eagle' need draft_model (a draft artifact's directory, or an "
                             f"EAGLE head's checkpoint directory, copied into the artifact), and draft_model needs "
                             f"one of them; got method {self.method!r} and draft_model {self.draft_model!r}")
        if self.method == "eagle":
            missing = [f for f in ("config.json", "model.safetensors") if not (Path(self.draft_model) / f).is_file()]
            if missing:
                raise ValueError(f"draft_model {self.draft_model!r} is not an EAGLE head checkpoint (no "
                                 f"{' or '.join(missing)}); method eagle reads config.json and model.safetensors")
        elif self.draft_model is not None and not (Path(self.draft_model) / "manifest.json").is_file():
            raise ValueError(f"draft_model {self.draft_model!r} is not an artifact directory (no manifest.json); "
                             f"build the draft model first (builder build) and name its output_dir")
        return self


class RuntimeSection(_Strict):
    max_batch_size: int = Field(default=8, ge=1)
    max_seq_len: int = Field(default=2048, ge=2)
    max_num_tokens: int = Field(default=2048, ge=1, description="most tokens in one forward step")
    tokens_per_block: int = Field(default=16, ge=1)
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = "auto"  # auto = the model dtype; fp8/int8 are calibrated
    # FP8 linears on cuBLAS (prefill, large batches) on Hopper: "promoted" moves the MMA's partial sums into fp32
    # periodically; "fast" keeps the MMA's own accumulator (faster GEMMs, a larger rounding error, which the gates
    # score on the GPU: builder.quality.fast_accumulation_scoring; kernels.torch_quant.fp8_fast_accum)
    fp8_accumulation: Literal["promoted", "fast"] = "promoted"
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)

    @model_validator(mode="after")
    def _block_size_power_of_two(self) -> RuntimeSection:
        if self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"tokens_per_block {self.tokens_per_block} is not a power of two (e.g. 16, 32, 64)")
        return self


# Which quantization options each algorithm reads; setting another one is an error.
ALGO_OPTIONS: dict[str, set[str]] = {
    "none": set(),
    "int8_wo": {"refit_scales"},
    "fp8": {"activations", "weight_granularity", "experts"},
    "smoothquant": {"activations", "alpha", "smoothing", "static_scale", "smooth_output"},
    "gptq": {"bits", "group_size", "symmetric", "act_order", "damp", "block_size", "refit_scales", "true_sequential",
             "experts", "activation_quant"},
    "awq": {"group_size", "symmetric", "n_grid", "duo_scaling", "rounding", "damp", "block_size", "clip",
            "scale_output", "joint_clip", "refit_scales", "experts", "activation_quant"},
}
COMMON_OPTIONS = {"algo", "targets", "ignore", "lm_head"}


class QuantizationSection(_Strict):
    algo: Literal["awq", "gptq", "smoothquant", "fp8", "int8_wo", "none"] = "none"
    targets: list[ModulePattern] = Field(default_factory=list, description="module paths or re:regex; "
                                         "empty = all linears")
    ignore: list[ModulePattern] = Field(default_factory=list, description="module paths or re:regex kept unquantized")
    bits: Optional[Literal[4, 8]] = None  # gptq (default 4); awq is always 4
    group_size: Optional[int] = None  # awq/gptq (default 128); -1 = per output channel
    symmetric: Optional[bool] = None  # gptq, awq (default False: zero points)
    act_order: Optional[bool] = None  # gptq (default True): columns by descending input energy, static groups
    damp: Optional[float] = Field(default=None, gt=0, lt=1)  # gptq, awq with rounding gptq (default 0.01)
    block_size: Optional[int] = Field(default=None, ge=1)  # gptq, awq with rounding gptq (default 128)
    n_grid: Optional[int] = Field(default=None, ge=2)  # awq (default 20)
    # awq: how the scaled, clipped weights are rounded: "nearest" (default, the reference) or "gptq" (GPTQ's
    # Hessian-aware error compensation on the scaled inputs; damp and block_size apply)
    rounding: Optional[Literal["nearest", "gptq"]] = None
    # awq: also search scales with the weights' own salience, mean|x|^a / w^(1-a), beside mean|x|^a (default: on
    # when symmetric, off otherwise)
    duo_scaling: Optional[bool] = None
    # awq with rounding "nearest": search a max-value clip per (row, group) after the scales (default True)
    clip: Optional[bool] = None
    # awq: also scale each output projection's input, folded into the v projection's rows, shared by the query heads
    # of each kv head (default True)
    scale_output: Optional[bool] = None
    # awq: run the clip search inside the scale search, each alpha scored after its clip (default False: slower by
    # n_grid clip searches per group)
    joint_clip: Optional[bool] = None
    # awq / gptq: once the codes are fixed, re-solve each row's group scales by least squares on the calibration
    # inputs' second moments, the row's output error (default True); int8_wo: the same for each row's scale, chosen
    # first by that error (default False: int8_wo then reads no calibration text)
    refit_scales: Optional[bool] = None
    # gptq: each linear's Hessian on inputs through the quantized linears before it in its layer (default False:
    # every linear of a layer on inputs through the layer's float weights, the quantized earlier layers' outputs)
    true_sequential: Optional[bool] = None
    alpha: Optional[float] = Field(default=None, ge=0, le=1)  # smoothquant (default 0.5)
    smoothing: Optional[bool] = None  # smoothquant (default True); False = plain (naive) W8A8 INT8
    activations: Optional[Literal["dynamic", "static"]] = None  # smoothquant/fp8 (default dynamic)
    # smoothquant, static activations: "mse" clips the input scale where that lowers the calibration error carried
    # through the quantized weight, "max" = max |x| / 127, "auto" (default): mse
    static_scale: Optional[Literal["auto", "mse", "max"]] = None
    # smoothquant: also smooth each output projection through its v projection (default False)
    smooth_output: Optional[bool] = None
    weight_granularity: Optional[Literal["tensor", "channel"]] = None  # fp8 (default tensor)
    # fp8: also quantize mixture-of-experts experts (e4m3 codes, per-channel scales, activations quantized per token
    # at run time whatever `activations` says). Default: on, except in a section that quantizes the lm_head alone.
    # Targets / ignore reach the moe layers by module path (model.layers.N.mlp); a section whose targets name only
    # moe layers (e.g. 're:layers.\d+.mlp$', which also names a merged dense gate/up) quantizes their experts alone.
    # The router stays in the model dtype. awq / gptq (bits 4): the same option, W4A16 experts (4-bit codes in the
    # section's groups, each expert calibrated on the tokens routed to it: passes/moe_int4.py)
    experts: Optional[bool] = None
    # awq / gptq with 4 bits: "fp8" also rounds each quantized linear's input per token to fp8 e4m3 at run time
    # (dynamic scales, amax / 448): W4A8, whose tensor-core path runs the fp8 MMA on the 4-bit codes (twice bf16's
    # rate on Hopper) past 64 rows of a step. The lm_head and mixture-of-experts experts stay W4A16. Default: none
    # (W4A16). The quality gates measure the artifact as it runs, activations rounded.
    activation_quant: Optional[Literal["fp8"]] = None
    # Also quantize the lm_head ([vocab, hidden]) with this method and scheme; targets/ignore do not reach it.
    # A tied lm_head is untied: the embedding stays in the model dtype, the lm_head gets a quantized copy.
    lm_head: bool = False

    @model_validator(mode="after")
    def _options_fit_algo(self) -> QuantizationSection:
        if self.lm_head and self.algo == "none":
            raise ValueError("lm_head: true needs a quantization method; algo is 'none' (pick awq, gptq, smoothquant, "
                             "fp8 or int8_wo, or set lm_head: false)")
        allowed = ALGO_OPTIONS[self.algo]
        for key in type(self).model_fields:
            if key in COMMON_OPTIONS or getattr(self, key) is None:
                continue
            if key not in allowed:
                raise ValueError(f"{key}: does not apply to algo {self.algo!r}; "
                                 f"{self.algo} reads: {', '.join(sorted(allowed | COMMON_OPTIONS)) }")
        if self.activation_quant and self.algo == "gptq" and (self.bits or 4) != 4:
            raise ValueError(f"activation_quant: fp8 (W4A8) takes 4-bit weights; bits is {self.bits}")
        if self.group_size is not None and self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size: {self.group_size} must be -1 (per channel) or >= 1")
        return self

    def method_options(self) -> dict[str, Any]:
        """Options passed to the quantization pass: the ones set, plus targets/ignore/lm_head."""
        return {k: v for k, v in self.model_dump().items() if v is not None and k != "algo"}


class CalibrationSection(_Strict):
    dataset: Optional[NonBlank] = Field(default=None, description=".txt or .jsonl (with a text field) of text like "
                                   "the model's inputs; required unless the checkpoint is the bundled model; "
                                   "'bundled': the shipped Python-source set, on purpose (the report says so)")
    text_field: NonBlank = "text"
    num_samples: int = Field(default=64, ge=1)
    seq_len: int = Field(default=256, ge=8)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="where calibrating passes run; auto = cuda when available, else cpu")


class GatesSection(_Strict):
    enabled: bool = True
    eval_dataset: Optional[NonBlank] = Field(default=None, description="held-out text; required unless the checkpoint "
                                        "is the bundled model; 'bundled': the shipped eval text, on purpose")
    num_positions: int = Field(default=4096, ge=1)
    window: int = Field(default=256, ge=8)
    max_kl: Optional[float] = Field(default=None, ge=0)
    min_top1_agreement: Optional[float] = Field(default=None, ge=0, le=1)
    max_ppl_ratio: Optional[float] = Field(default=None, ge=1)
    min_greedy_agreement: Optional[float] = Field(default=None, ge=0, le=1)
    max_kl_vs_rtn: Optional[float] = Field(default=None, gt=0, description="KL over that of plain "
                                           "round-to-nearest of the same scheme: GPTQ / AWQ must beat it (default "
                                           "0.9); INT8 weight-only and FP8 must be no worse than a fresh "
                                           "rounding (default 1.3); SmoothQuant only when set; .inf turns it off")
    greedy_tokens: int = Field(default=16, ge=1)
    needle_context_len: Optional[int] = Field(default=None, description="tokens of the needle check's context, "
                                              "at least 32; 0 or null: no needle check")

    @field_validator("needle_context_len")
    @classmethod
    def _needle_off_or_long_enough(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value != 0 and value < 32:
            raise ValueError(f"{value} is too short for a needle check: at least 32 tokens, or 0 / null for none")
        return value or None


class TargetSection(_Strict):
    """The GPU the artifact is meant for: `builder build` plans its memory first (builder/plan.py)."""

    gpu_memory: str = Field(default="80GiB", description="memory of one GPU: 80GiB, 80GB (powers of 1000), 81920MiB")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="fraction of it the runtime may use")
    fail_if_not_fit: bool = Field(default=False, description="a plan that does not fit fails the build (else warns)")

    @model_validator(mode="after")
    def _memory_parses(self) -> TargetSection:
        from runtime.memory import parse_bytes

        try:
            parse_bytes(self.gpu_memory)
        except ValueError as e:
            raise ValueError(f"gpu_memory: {e}") from None
        return self


class ParallelSection(_Strict):
    tp_size: int = Field(default=1, ge=1, description="tensor-parallel ranks: GPUs of one host the artifact runs on")
    vocab_parallel: bool = False  # split the embedding and lm_head by vocabulary too (default: replicated)
    gpus_per_node: Optional[int] = Field(default=None, ge=1, description="GPUs of the runtime host; when set, "
                                         "tp_size may not exceed it")

    @model_validator(mode="after")
    def _fits_host(self) -> ParallelSection:
        if self.gpus_per_node is not None and self.tp_size > self.gpus_per_node:
            ok = [t for t in (1, 2, 4, 8) if t <= self.gpus_per_node]
            raise ValueError(f"tp_size: {self.tp_size} is more than the runtime host's gpus_per_node "
                             f"{self.gpus_per_node}; one rank runs per GPU, pick {' or '.join(map(str, ok))}")
        return self


# passes the quantization section runs (resolve_passes), never listed in ``passes``
_QUANTIZATION_PASSES = frozenset(("awq", "gptq", "smoothquant", "fp8", "int8_wo", "kv_cache_quant"))


class Recipe(_Strict):
    name: Optional[NonBlank] = None
    model: ModelSection
    output_dir: NonBlank
    passes: list[str] = Field(default_factory=lambda: list(DEFAULT_PASSES))
    verify: VerifySection = Field(default_factory=VerifySection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    # One method, or a list applied in order to different layer groups (by their targets / ignore):
    # a linear quantized by an earlier entry is not selected by a later one.
    quantization: Union[QuantizationSection, list[QuantizationSection]] = Field(default_factory=QuantizationSection)
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    gates: GatesSection = Field(default_factory=GatesSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)  # tensor parallelism (tp_size)
    target: Optional[TargetSection] = Field(default=None, description="the GPU to plan for; none = no plan at build")

    @model_validator(mode="after")
    def _known_passes(self) -> Recipe:
        from passes import PASSES

        for i, name in enumerate(self.passes):
            if name not in PASSES:
                raise ValueError(f"passes[{i}]: {name!r} is not a known pass; known: {', '.join(PASSES)}")
            if name == "shard":
                raise ValueError(f"passes[{i}]: 'shard' runs last, after quantization, when parallel.tp_size > 1; "
                                 f"set parallel.tp_size instead of listing it")
            if name in _QUANTIZATION_PASSES:  # run from the list it would quantize ungated, the manifest saying "none"
                setting = ("runtime.kv_cache_dtype: fp8 or int8" if name == "kv_cache_quant"
                           else f"quantization.algo: {name}")
                raise ValueError(f"passes[{i}]: {name!r} is a quantization method: the build runs it from the "
                                 f"recipe's settings (calibrated, gated and recorded in the manifest); set {setting} "
                                 f"and leave it out of passes")
        return self

    @model_validator(mode="after")
    def _gates_fit_the_context(self) -> Recipe:
        """Gate lengths a recipe sets fit runtime.max_seq_len: the gates judge the artifact on inputs it can serve.
        The defaults, a window of 256 tokens and 16 greedy tokens, are shortened to fit a shorter max_seq_len."""
        limit = self.runtime.max_seq_len
        given = set(self.gates.model_fields_set)  # what the recipe set; a default shortened below stays a default
        for key, fit in (("window", limit), ("greedy_tokens", limit - 1)):
            low = GatesSection.model_fields[key].metadata[0].ge  # (a context under the window's least, 8: unchanged)
            if key not in given and getattr(self.gates, key) > fit >= low:
                setattr(self.gates, key, fit)
                self.gates.model_fields_set.discard(key)
        for key, most in (("window", limit), ("needle_context_len", limit), ("greedy_tokens", limit - 1)):
            value = getattr(self.gates, key)
            if key in given and value is not None and value > most:
                raise ValueError(f"gates.{key} {value} is past runtime.max_seq_len {limit}: the gates would judge "
                                 f"the build on inputs the artifact cannot serve; set it to at most {most}")
        return self

    @model_validator(mode="after")
    def _distinct_methods(self) -> Recipe:
        if isinstance(self.quantization, list):
            algos = [q.algo for q in self.quantization]
            if not algos or "none" in algos or len(set(algos)) != len(algos):
                raise ValueError(f"quantization: a list needs distinct methods other than 'none', got {algos}")
            heads = [i for i, q in enumerate(self.quantization) if q.lm_head]
            if len(heads) > 1:
                raise ValueError(f"quantization: lm_head: true in sections {', '.join(map(str, heads))}; the lm_head is "
                                 f"quantized once, so set it in one section only")
        return self

    def quant_sections(self) -> list[QuantizationSection]:
        """The quantization methods to run, in order (empty when none)."""
        sections = self.quantization if isinstance(self.quantization, list) else [self.quantization]
        return [q for q in sections if q.algo != "none"]

    def quant_algo(self) -> str:
        """'none', a method, or methods joined with '+' (the first one's gate thresholds apply)."""
        return "+".join(q.algo for q in self.quant_sections()) or "none"

    def verify_atol(self) -> float:
        return self.verify.atol if self.verify.atol is not None else DEFAULT_ATOL[self.model.dtype]

    def resolved(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def sha256(self) -> str:
        body = json.dumps(self.resolved(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(body).hexdigest()


# --- loading ---------------------------------------------------------------------------------
class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = key in first_line
            except TypeError:  # an unhashable key: the safe loader reports it
                continue
            if seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (first on line {first_line[key]}); "
                    f"YAML would keep only the last, so merge the two", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads 1e-9 as a string: it wants a dot in the mantissa. Read it as YAML 1.2 does.
_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506  a SafeLoader subclass


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: where, what, and the construct it happened in."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        context = e.context or ""
        if e.context and e.context_mark and e.context_mark is not mark:
            context += f" that starts on line {e.context_mark.line + 1}, column {e.context_mark.column + 1}"
        return where + (e.problem or "") + (f" ({context})" if context else "")
    if isinstance(e, yaml.reader.ReaderError):
        return f"character #x{e.character:04x} at offset {e.position} is not allowed ({e.reason})"
    return " ".join(str(e).split())


def read_recipe_text(p: Path) -> str:
    """The recipe file's text; raises RecipeError for a missing path, a directory or non-UTF-8 bytes."""
    if p.is_dir():
        raise RecipeError(f"recipe {str(p)!r} is a directory; pass the recipe YAML file itself")
    if not p.is_file():
        raise RecipeError(f"recipe {str(p)!r} does not exist")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"recipe {str(p)!r} cannot be read ({e.strerror})") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise RecipeError(f"{p}: the file is UTF-16 text; save it as UTF-8 (a recipe is UTF-8 YAML)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{p}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); a recipe is "
                          f"a YAML text file saved as UTF-8") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override (``key.path=value``) and validate a recipe file."""
    p = Path(path)
    text = read_recipe_text(p)
    try:
        raw = _parse_yaml(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{p}: not valid YAML: {_yaml_problem(e)}") from None
    if raw is None:
        raise RecipeError(f"{p} is empty; a recipe is a YAML mapping with at least model.checkpoint and output_dir")
    if not isinstance(raw, dict):
        raise RecipeError(f"{p}: a recipe is a YAML mapping of keys (model:, output_dir:, ...) at the top level, "
                          f"got {_kind_of(raw)}")
    for item in overrides or []:
        apply_override(raw, item)
    raw.setdefault("name", p.stem)
    return validate_recipe(raw, source=str(p))


def apply_override(raw: dict, item: str) -> None:
    """Set ``a.b.c=value`` in the raw recipe; the value is parsed as YAML (so 8, true, [a, b] work)."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected key.path=value")
    key, _, text = item.partition("=")
    parts = [k for k in key.strip().split(".")]
    if not all(parts):
        raise RecipeError(f"--set {item!r}: empty key in path {key!r}")
    node = raw
    for k in parts[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {item!r}: {k!r} is not a section")
        node = child
    try:
        node[parts[-1]] = _parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as e:
        problem = str(e).splitlines()[0]
        raise RecipeError(f"--set {item!r}: the value {text!r} is not valid YAML ({problem}); a string with "
                          f"backslashes goes in single quotes, e.g. {key}='re:layers\\.0\\.'") from None


def validate_recipe(raw: dict, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        lines = [format_error(err) for err in _matching_branch(e.errors(), raw)]
        if len(lines) == 1:
            raise RecipeError(f"{source}: invalid recipe: {lines[0]}") from None
        raise RecipeError(f"{source}: invalid recipe:\n  " + "\n  ".join(lines)) from None


def gates_section(raw: object, source: str) -> GatesSection:
    """A recorded ``gates`` section (an artifact manifest's recipe) validated as a recipe's, refused with the recipe's
    error messages (RecipeError) rather than pydantic's."""
    try:
        return GatesSection.model_validate({} if raw is None else raw)
    except ValidationError as e:
        lines = [format_error({**err, "loc": ("gates", *err["loc"])}) for err in e.errors()]
        raise RecipeError(f"{source}: invalid gates section: " + "; ".join(lines)) from None


def _matching_branch(errors: list[dict], raw: dict) -> list[dict]:
    """For a key that takes one section or a list of them, keep the errors of the form the recipe
    used, with pydantic's union-branch tags removed from the key path."""
    out = []
    for err in errors:
        loc = list(err["loc"])
        tags = [i for i, part in enumerate(loc) if isinstance(part, str) and "[" in part]
        if tags:
            i = tags[0]
            value = raw.get(loc[0]) if i == 1 else None
            is_list_branch = loc[i].startswith("list[")
            if isinstance(value, list) != is_list_branch:
                continue
            del loc[i]
        out.append({**err, "loc": tuple(loc)})
    return out


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top>"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the key at ``loc`` (to list allowed keys)."""
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        # an optional section or a one-or-list section (Optional[X], Union[X, list[X]]) lists X's keys
        from typing import get_args

        options = [a for a in (field.annotation, *get_args(field.annotation))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
        if not options:
            return None
        model = options[0]
    return model


def format_error(err: dict) -> str:
    loc, kind, value = tuple(err["loc"]), err["type"], err.get("input")
    path = _loc(loc)
    if kind == "extra_forbidden":
        model = _model_at(loc)
        allowed = list(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{path}: unknown key{hint}; allowed here: {', '.join(allowed)}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        options = expected.replace("'", "").replace(" or ", ", ")
        return f"{path}: {value!r} is not one of {options}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        if loc and re.match(r"^\w+: ", msg):  # the message names a key inside this section
            return f"{path}.{msg}"
        return f"{path}: {msg}" if loc else msg
    if kind in _EXPECTED_TYPE and value is None:
        return f"{path}: has no value; expected {_EXPECTED_TYPE[kind]}"
    if kind in _EXPECTED_TYPE:
        return f"{path}: {_shown(value)} is {_kind_of(value)}; expected {_EXPECTED_TYPE[kind]}{_type_hint(value)}"
    return f"{path}: {value!r}: {err['msg'].lower()}"


# What a key of each type takes, by pydantic's error type.
_EXPECTED_TYPE = {"int_type": "a whole number", "float_type": "a number", "bool_type": "true or false",
                  "string_type": "a string", "list_type": "a list, e.g. [a, b]",
                  "model_type": "a section (indented key: value lines)", "dict_type": "a section (key: value lines)"}


def _shown(value: Any) -> str:
    """A value as it reads in YAML."""
    if isinstance(value, bool):
        return str(value).lower()
    text = _REPR.repr(value)  # bounded in depth and width: an aliased YAML value can expand to billions of items
    return text if len(text) <= 60 else text[:57] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _kind_of(value: Any) -> str:
    kinds = [(bool, "a boolean"), (int, "a whole number"), (float, "a decimal number"), (str, "a string"),
             (list, "a list"), (dict, "a section")]
    return next((kind for t, kind in kinds if isinstance(value, t)), type(value).__name__)


def _type_hint(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return f" (write {int(value)})"
    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", value):
        return " (drop the quotes)"
    return ""

"""The build: checkpoint -> traced graph -> passes -> artifact.

    recipe ──► open_checkpoint ──► trace (meta) ──► attach weights ──► passes ──► write_artifact
                                                                      (verify runs the graph
                                                                       against the HF model)
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.artifact import write_artifact
from builder.calibration import (DEFAULT_CALIBRATION, DEFAULT_EVAL, DataError, TokenData, read_texts, resolve_text,
                                 token_windows)
from builder.checkpoint import INDEX_FILE, Checkpoint, CheckpointError, attach_weights, open_checkpoint
from builder.prequantized import Imported
from builder.quality import run_gates
from builder.plan import check_target
from builder.recipe import Recipe
from passes import PASSES, PassContext, PassRecord, run_passes
from passes.base import Progress
from passes.ir import Graph
from passes.quant_math import QuantConfig
from passes.shard import check_tp_groups, check_tp_size
from passes.trace import refuses_sdpa, trace
from runtime.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger("builder")


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to change."""


class GateFailure(BuildError):
    """The quantized graph regressed past the recipe's quality thresholds: the build is blocked."""


@dataclass
class BuildResult:
    output_dir: Path
    graph: Graph
    records: list[PassRecord]
    seconds: float


def resolve_passes(recipe: Recipe, prequantized: bool = False) -> tuple[list[str], list[str]]:
    """The ordered passes this recipe runs: (graph passes, quantization passes).

    Graph passes (fusions, verify) run on the full-precision graph; verify compares it with the HF
    model. Quantization runs after, on the verified graph, which stays as the gates' baseline. A
    pre-quantized checkpoint's weights are already quantized: its (agreeing) sections run nothing.
    """
    quant = [] if prequantized else [q.algo for q in recipe.quant_sections()]
    if recipe.runtime.kv_cache_dtype != "auto":
        quant.append("kv_cache_quant")
    return list(recipe.passes), quant + ["dce"] if quant else []


def needs_calibration(recipe: Recipe, prequantized: bool = False) -> bool:
    """Whether a quantization pass of this recipe fits anything on activations (AWQ, GPTQ, SmoothQuant, static
    FP8, a quantized KV cache): int8 weight-only and dynamic FP8 alone read no calibration text."""
    if recipe.runtime.kv_cache_dtype != "auto":
        return True
    for q in ([] if prequantized else recipe.quant_sections()):
        method = PASSES[q.algo]()
        method.configure(q.method_options())
        if method.needs_calibration:
            return True
    return False


def parallel_passes(recipe: Recipe) -> list[str]:
    """Passes that run last, on the final (quantized, gated) graph: ``shard`` when tp_size > 1."""
    return ["shard"] if recipe.parallel.tp_size > 1 else []


def check_quantization(recipe: Recipe, graph: Graph) -> None:
    """Fail before any pass runs when a quantization section cannot apply to the traced graph: it
    selects no linear, a selected linear does not fit its options (e.g. group_size), or its groups would be cut by
    the tensor-parallel split (``parallel.tp_size``; call it after ``check_tp_size``).

    The quantization pass checks again on the graph it gets (after merges, and after earlier
    sections); a section that selects nothing here selects nothing there either.
    """
    is_list = isinstance(recipe.quantization, list)
    for i, q in enumerate(recipe.quantization if is_list else [recipe.quantization]):
        if q.algo != "none":
            key = f"quantization[{i}]" if is_list else "quantization"
            method = PASSES[q.algo]()
            targets = method.prepare(graph, q.method_options(), f"{key} (algo {q.algo})", warn=False)
            cfg = getattr(method, "cfg", None)  # grouped weight methods (AWQ, GPTQ): their QuantConfig
            if isinstance(cfg, QuantConfig):
                check_tp_groups(graph, recipe.parallel.tp_size, targets, cfg.group_size, cfg.bits, key)


def calibration_data(recipe: Recipe, tokenizer: Tokenizer) -> tuple[TokenData, str | None]:
    """The calibration windows and a warning for the report (the shipped text taken for another model)."""
    c = recipe.calibration
    path, warning = resolve_text(c.dataset, DEFAULT_CALIBRATION, recipe.model.checkpoint, "calibration.dataset")
    try:
        data = token_windows(path, lambda t: tokenizer.encode(t, add_special_tokens=False), c.num_samples,
                             c.seq_len, c.seed, c.text_field)
    except DataError as e:
        raise DataError(f"{'calibration.dataset' if c.dataset else 'calibration'}: {e}") from None
    if warning:
        log.warning("%s", warning)
    return data, warning


def check_eval_data(recipe: Recipe) -> None:
    """The gates' held-out text is named (or the model is the bundled one) and readable: checked before the
    build spends time on the model."""
    if recipe.gates.enabled:
        path, _ = resolve_text(recipe.gates.eval_dataset, DEFAULT_EVAL, recipe.model.checkpoint, "gates.eval_dataset")
        try:
            read_texts(path)
        except DataError as e:
            raise DataError(f"gates.eval_dataset: {e}") from None


def calibration_device(choice: str) -> torch.device:
    """The device the quantization passes run on: ``auto`` takes the GPU when there is one."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise BuildError("calibration.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def check_prequantized(recipe: Recipe, ckpt: Checkpoint) -> None:
    """A pre-quantized checkpoint is built as it is: the recipe's quantization must be empty or describe it."""
    from builder.prequantized import recipe_disagreement

    sections = recipe.quant_sections()
    if ckpt.quant is None or not sections:
        return
    fmt = ckpt.quant
    what = f"{fmt.source} ({fmt.scheme}, {fmt.bits}-bit, group_size {fmt.group_size})"
    problem = recipe_disagreement(fmt, sections)
    if problem is not None:
        raise BuildError(f"quantization: {problem} does not describe the checkpoint, which is already quantized by "
                         f"{what}; a quantized checkpoint is not quantized again: remove the quantization section "
                         f"(the build keeps the checkpoint's own codes and scales), or build from the unquantized "
                         f"checkpoint to quantize with {recipe.quant_algo()}")
    log.info("quantization (%s) agrees with the checkpoint, already quantized by %s: its own codes and scales are "
             "kept, nothing is re-quantized", recipe.quant_algo(), what)


def fast_without_fp8(recipe: Recipe) -> bool:
    """Whether the recipe asks fast FP8 accumulation without an fp8 quantization section (only a pre-quantized FP8
    checkpoint's linears can then take it, which the graph shows once its weights are attached)."""
    return recipe.runtime.fp8_accumulation == "fast" and "fp8" not in {q.algo for q in recipe.quant_sections()}


def check_fp8_accumulation(recipe: Recipe, prequantized: bool) -> None:
    """``runtime.fp8_accumulation: fast`` names cuBLAS's FP8 GEMMs, which run on bf16 / fp16 activations: refused for
    another model dtype, and for a model with no FP8 linear (checked here for a checkpoint that is not pre-quantized,
    before any weight is read)."""
    if recipe.runtime.fp8_accumulation != "fast":
        return
    if recipe.model.dtype not in ("bfloat16", "float16"):
        raise BuildError(f"runtime.fp8_accumulation is 'fast' but model.dtype is {recipe.model.dtype}: FP8 GEMMs on "
                         f"cuBLAS run on bfloat16 or float16 activations; set one of those, or 'promoted'")
    if fast_without_fp8(recipe) and not prequantized:
        raise BuildError(f"runtime.fp8_accumulation is 'fast' but no quantization section is fp8 (quantization.algo: "
                         f"{recipe.quant_algo()}); leave it out or set 'promoted'")


def check_draft_model(recipe: Recipe, ckpt: Checkpoint) -> None:
    """``runtime.speculative`` method draft: the draft must be an intact artifact of this toolchain, for one GPU,
    whose tokenizer is the checkpoint's (its tokens are the target's); it is copied into the artifact when written.
    Method eagle: the head's config and tensors must fit the checkpoint (hidden size, vocabulary, an EAGLE-3 head's
    target layers; runtime.eagle's ``read_head``). Checked before anything is built."""
    spec = recipe.runtime.speculative
    if spec.method == "eagle":
        from runtime.eagle import EagleCheckpointError, read_head

        try:
            read_head(spec.draft_model, ckpt.config_dict.get("hidden_size"), ckpt.config_dict.get("vocab_size"),
                      ckpt.config_dict.get("num_hidden_layers"))
        except EagleCheckpointError as e:
            raise BuildError(f"runtime.speculative.draft_model: {e}") from None
        return
    if spec.method != "draft":
        return
    from runtime.artifact import ArtifactError, open_artifact

    try:
        draft = open_artifact(spec.draft_model)
    except ArtifactError as e:
        raise BuildError(f"runtime.speculative.draft_model: {e}") from None
    if draft.tp_size != 1:
        raise BuildError(f"runtime.speculative.draft_model {spec.draft_model} is sharded for tp_size {draft.tp_size}; "
                         f"a draft model runs on one GPU: build it with tp_size 1")
    ours, theirs = ckpt.path / "tokenizer.json", draft.tokenizer_dir / "tokenizer.json"
    if not (ours.is_file() and theirs.is_file()) or ours.read_bytes() != theirs.read_bytes():
        raise BuildError(f"runtime.speculative.draft_model {spec.draft_model}: its tokenizer.json is not the "
                         f"checkpoint's ({ckpt.path / 'tokenizer.json'}); a draft model must propose the target's "
                         f"tokens: build it from a checkpoint with the same tokenizer")
    ours_vocab, theirs_vocab = ckpt.config_dict.get("vocab_size"), draft.manifest["model"].get("vocab_size")
    if ours_vocab != theirs_vocab:  # the runtime's draft proposer refuses this too: its ids would not be the target's
        raise BuildError(f"runtime.speculative.draft_model {spec.draft_model}: its vocab_size is {theirs_vocab}, the "
                         f"checkpoint's {ours_vocab}; a draft model must have the target's vocabulary (embedding rows)")
    if (draft.path / "draft" / "manifest.json").is_file():
        raise BuildError(f"runtime.speculative.draft_model {spec.draft_model} carries a draft model of its own (it was "
                         f"built with runtime.speculative); name the plain draft artifact")
    gates = draft.manifest.get("quantization", {}).get("gates") or {}
    if not gates.get("passed", True):  # served anyway: the target verifies every draft token
        log.warning("runtime.speculative.draft_model %s failed its quality gates (%s) when it was built; the "
                    "runtime serves with it (the target verifies every draft token), at whatever acceptance it has",
                    spec.draft_model, ", ".join(gates.get("failed", [])))
    draft_bytes = sum(f.stat().st_size for f in draft.path.glob("weights*.safetensors"))
    target_bytes = sum(f.stat().st_size for f in ckpt.weight_files)
    if draft_bytes >= target_bytes / 2:
        log.warning("runtime.speculative.draft_model %s holds %.1f MiB of weights against the checkpoint's %.1f MiB: "
                    "a draft reads its weights for every token it proposes, so one this large saves little or "
                    "nothing", spec.draft_model, draft_bytes / 2**20, target_bytes / 2**20)


def check_longrope(config, max_seq_len: int) -> None:
    """LongRoPE's positions past its switch carry an offset (runtime.executor.LONG_ROPE_OFFSET) below which every
    position must stay."""
    from passes.trace import longrope_from
    from runtime.executor import LONG_ROPE_OFFSET

    if longrope_from(config) is not None and max_seq_len >= LONG_ROPE_OFFSET:
        raise BuildError(f"runtime.max_seq_len {max_seq_len}: LongRoPE's positions run below {LONG_ROPE_OFFSET}")


def reference_model(ckpt: Checkpoint, dtype: torch.dtype, imported: Imported | None = None,
                    weights: dict[str, torch.Tensor] | None = None):
    """The Hugging Face model with its real weights (safetensors only), for the verify pass. A pre-quantized
    checkpoint's (``imported``): its float tensors (``weights``, by name) and the format's own dequantization of
    its quantized linears, whose W8A8 ones also quantize their inputs as the format does and whose pre_quant_scale
    (ModelOpt's AWQ) multiplies their inputs first. An MXFP4 checkpoint's:
    every tensor as the build reads it (MXFP4 weights decoded, ``Checkpoint.load_tensors``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if imported is None and ckpt.mxfp4:  # decoded as the build reads them, no HF quantizer
        model = _model_from_weights(ckpt, dtype, ckpt.load_tensors(sorted(ckpt.weight_map), dtype))
    elif imported is None and ckpt.nvfp4:  # the build's own decoded weights, under the model's names (experts stacked)
        model = _model_from_weights(ckpt, dtype, weights or {})
    elif imported is None:
        index = ckpt.path / INDEX_FILE
        if index.is_file() and not isinstance(json.loads(index.read_bytes()).get("metadata"), dict):
            raise CheckpointError(f"{index} has no \"metadata\" object, which transformers needs to load the "
                                  f"checkpoint as the reference model for verify (it holds total_size); add "
                                  f"\"metadata\": {{}}, or download the checkpoint again")
        try:
            model = _sdpa_or_eager(lambda attn: AutoModelForCausalLM.from_pretrained(
                ckpt.path, dtype=dtype, attn_implementation=attn, local_files_only=True, use_safetensors=True))
        except (OSError, ValueError, KeyError, TypeError) as e:  # what transformers raises on files it cannot read
            raise BuildError(f"transformers could not load {ckpt.path} as the reference model for verify "
                             f"({type(e).__name__}: {e}); the checkpoint's files do not form a model transformers "
                             f"reads") from e
    else:
        model = _model_from_weights(ckpt, dtype, {**(weights or {}), **imported.pop_reference_weights()})
        for module, scale in imported.input_scales().items():  # registered first: they run before the quantization
            model.get_submodule(module).register_forward_pre_hook(_scale_input(scale))
        for module, (scheme, input_scale, group, qmin) in imported.activation_quant().items():
            model.get_submodule(module).register_forward_pre_hook(_fake_quantize_input(scheme, input_scale, group,
                                                                                       qmin))
        if imported.expert_inputs:  # transformers' eager experts: each expert's projections by nn.functional.linear
            model.set_experts_implementation("eager")
        for module, (scheme, group) in imported.expert_inputs.items():
            _fake_quantize_expert_inputs(model.get_submodule(module), scheme, group)
    model.eval()

    @torch.inference_mode()
    def logits(token_ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()

    return logits


def _sdpa_or_eager(make):
    """``make(attn_implementation)`` with SDPA, or with the model's own eager attention where its class refuses SDPA
    (attention that soft-caps its scores or adds sinks: Gemma 2, gpt-oss)."""
    try:
        return make("sdpa")
    except ValueError as e:
        if not refuses_sdpa(e):
            raise
        return make("eager")


def _model_from_weights(ckpt: Checkpoint, dtype: torch.dtype, weights: dict[str, torch.Tensor]):
    """The checkpoint's model class built from its config (its quantization_config dropped), holding ``weights``."""
    from transformers import AutoModelForCausalLM

    config = ckpt.hf_config()
    for key in ("quantization_config", "compression_config"):
        if hasattr(config, key):
            delattr(config, key)
    model = _sdpa_or_eager(lambda attn: AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                                         dtype=dtype))
    own = dict(model.state_dict())
    missing, unexpected = model.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=False)
    loaded = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n not in missing}
    untied = [n for n, p in model.named_parameters(remove_duplicate=False) if n in missing and id(p) not in loaded]
    assert not untied and not unexpected, f"reference model: weights missing {untied[:3]}, unexpected {unexpected[:3]}"
    return model


def _scale_input(scale: torch.Tensor):
    """A forward pre-hook: the module's input times a per-input-channel scale (an exporter's pre_quant_scale), the
    product in fp32 rounded to the input's dtype, as the runtime's linear takes it (``kernels/torch_quant.py``)."""
    def hook(module, args):
        x = args[0]
        return ((x.float() * scale.to(x.device)).to(x.dtype), *args[1:])

    return hook


def _fake_quantize_input(scheme: str, input_scale: torch.Tensor | None, group: int | None = None, qmin: int = -127):
    """A forward pre-hook: the module's input quantized as a W8A8 scheme's runtime does, then dequantized (fp8_block:
    per token and ``group`` columns; int8: codes down to ``qmin``, the linear's act_qmin)."""
    from kernels.torch_quant import (expand_blocks, quantize_activation_fp8, quantize_activation_fp8_blocks,
                                     quantize_activation_int8)

    def quantize(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if scheme == "fp8_block":
            xq, scales = quantize_activation_fp8_blocks(x2, group)
            return xq, expand_blocks(scales, group, x2.shape[1], 1)
        if scheme == "fp8":
            return quantize_activation_fp8(x2, input_scale)
        return quantize_activation_int8(x2, input_scale, qmin)

    def hook(module, args):
        x = args[0]  # [batch, tokens, in]
        xq, scale = quantize(x.reshape(-1, x.shape[-1]))
        return ((xq.float() * scale).to(x.dtype).reshape(x.shape), *args[1:])

    return hook


def _fake_quantize_expert_inputs(experts: torch.nn.Module, scheme: str, group: int | None = None) -> None:
    """transformers' experts module (one per mixture-of-experts layer) computes every expert's projections with
    ``nn.functional.linear`` in its forward: while it runs, that function quantizes its input first
    (:func:`_fake_quantize_input`: fp8 per token; fp8_block per token and ``group`` columns), as the format's expert
    linears do. A forward that made no such call (another experts implementation) is an error, not an unquantized
    reference."""
    import torch.nn.functional as F

    original, fake = F.linear, _fake_quantize_input(scheme, None, group)
    calls = [0]

    def linear(x, weight, bias=None):
        calls[0] += 1
        return original(fake(experts, (x,))[0], weight, bias)

    def enter(module, args):
        calls[0] = 0
        F.linear = linear

    def leave(module, args, output):
        F.linear = original
        if not calls[0]:
            raise RuntimeError(f"the reference model's {type(module).__name__} ran without nn.functional.linear, so "
                               f"its experts' inputs could not be quantized as the checkpoint's are")

    experts.register_forward_pre_hook(enter)
    experts.register_forward_hook(leave, always_call=True)


def params_to_host(params: dict[str, torch.Tensor], moved: dict[str, weakref.ref],
                   host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` after passes ran on a device copy of ``host`` (``moved``: weak references to the copies, so that a
    copy a pass replaced is freed at once, e.g. a 30B mixture of experts' 58 GB of float experts as its FP8 codes are
    made): a tensor the passes left as it was is the host tensor it was copied from (not copied back), a new one is
    copied to the host."""
    return {k: host[k] if k in moved and moved[k]() is v else v.cpu() for k, v in params.items()}


def error_inputs(records: list[PassRecord]) -> str:
    """What the per-layer errors were measured on: calibration data, random inputs, or both (by method)."""
    kinds = [(r.name, r.details.get("layer_error_inputs", "calibration data")) for r in records
             if r.details.get("layer_errors")]
    if len({k for _, k in kinds}) <= 1:
        return kinds[0][1] if kinds else "calibration data"
    return "; ".join(f"{name}: {k}" for name, k in kinds)


def worst_layers(records: list[PassRecord], n: int = 5) -> list[tuple[str, float]]:
    """The quantized linears with the largest relative output error (on calibration data, or random inputs for
    methods that fit nothing on activations: :func:`error_inputs`)."""
    errors: dict[str, float] = {}
    for r in records:
        errors.update(r.details.get("layer_errors", {}))
    return sorted(errors.items(), key=lambda kv: -kv[1])[:n]


def build(recipe: Recipe, progress: Progress | None = None) -> BuildResult:
    """Run the whole build for ``recipe``.

    A build that cannot finish writes nothing (the previous artifact stays). A build whose quality
    gates fail writes the artifact marked gate-failed, then raises GateFailure. With a ``target``
    section the memory plan (builder/plan.py) runs first: a plan that does not fit warns, or fails
    the build before anything is loaded when ``target.fail_if_not_fit`` is true.
    """
    start = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    dtype = getattr(torch, recipe.model.dtype)
    ckpt = open_checkpoint(recipe.model.checkpoint)
    if (problem := check_target(recipe)) is not None:  # memory plan against recipe.target, from config.json
        if recipe.target.fail_if_not_fit:
            raise BuildError(f"{problem}; nothing was built (target.fail_if_not_fit is true)")
        log.warning("%s", problem)
    try:
        vocab = ckpt.config_dict.get("vocab_size")  # the model's: EOS ids must be rows of its logits
        tokenizer = Tokenizer.from_dir(ckpt.path, vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None)
    except TokenizerError as e:
        where = "" if str(ckpt.path) in str(e) else f"{ckpt.path}: "
        raise CheckpointError(f"{where}{e}; an artifact must carry its tokenizer") from e
    config = ckpt.hf_config()
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and recipe.runtime.max_seq_len > max_pos:
        raise BuildError(f"runtime.max_seq_len {recipe.runtime.max_seq_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}; set it to at most {max_pos}")
    check_longrope(config, recipe.runtime.max_seq_len)
    check_prequantized(recipe, ckpt)
    check_draft_model(recipe, ckpt)
    check_fp8_accumulation(recipe, prequantized=ckpt.quant is not None)
    from runtime.generation_config import GenerationConfigError, sampling_defaults
    from runtime.tokenizer import GENERATION_CONFIG_FILE

    try:  # the artifact carries it and the server reads its sampling defaults: refused now, not at serve time
        sampling_defaults(ckpt.path / GENERATION_CONFIG_FILE)
    except GenerationConfigError as e:
        raise CheckpointError(f"{e} (the artifact would carry it, and the server refuses it)") from None
    if ckpt.mxfp4 and dtype == torch.float16:  # e8m0 scales reach 2^127: fp16 cannot hold every MXFP4 value
        raise BuildError(f"{ckpt.path}: its MXFP4 weights are decoded exactly into bfloat16 or float32 only (their "
                         f"power-of-two scales run past float16's range); set model.dtype to bfloat16 or float32")
    prequantized = ckpt.quant is not None
    names, quant_names = resolve_passes(recipe, prequantized)
    t = time.perf_counter()
    graph, meta_model = trace(config)
    trace_s = time.perf_counter() - t
    par = recipe.parallel
    # structure and shapes only: a section or tp_size that cannot apply stops the build before any weight is read
    check_tp_size(graph, par.tp_size, par.vocab_parallel)
    if not prequantized:
        check_quantization(recipe, graph)
    if quant_names:  # data problems, too, surface before the weights are read and any pass runs
        device = calibration_device(recipe.calibration.device)
        t = time.perf_counter()
        calib, calib_warning = (calibration_data(recipe, tokenizer) if needs_calibration(recipe, prequantized)
                                else (None, None))
        if calib is None and recipe.calibration.dataset:
            log.warning("calibration.dataset %s is not read: %s fit nothing on activations (their per-layer errors "
                        "are measured on random inputs)", recipe.calibration.dataset, recipe.quant_algo())
        calib_s = time.perf_counter() - t
        check_eval_data(recipe)
    t = time.perf_counter()
    imported = attach_weights(graph, ckpt, meta_model, dtype, keep_references="verify" in names)
    load_s = time.perf_counter() - t
    if fast_without_fp8(recipe) and not any((n.attrs.get("quant") or {}).get("scheme") == "fp8"
                                             for n in graph.nodes if n.op in ("linear", "lm_head")):
        raise BuildError(f"runtime.fp8_accumulation is 'fast' but {ckpt.path} has no FP8 linear; leave it out or set "
                         f"'promoted'")
    log.info("loaded %d tensors (%.1fM parameters) in %.2fs", len(graph.params), graph.num_params() / 1e6, load_s)
    extra: dict = {}
    if ckpt.mxfp4:  # the source's format, recorded: its MXFP4 weights were decoded (exactly: bf16 / fp32) into the
        # build's dtype
        extra["source_mxfp4_weights"] = len(ckpt.mxfp4)
        log.info("decoded %d MXFP4 weights (%s, ...) into %s", len(ckpt.mxfp4), next(iter(ckpt.mxfp4)), dtype)
    if ckpt.nvfp4:  # a ModelOpt NVFP4 export, decoded as ModelOpt dequantizes it; its FP4 activations are not kept
        extra["source_nvfp4_weights"] = len(ckpt.nvfp4)
        extra["source_nvfp4_unread_scales"] = len(ckpt.nvfp4_dropped)
        log.warning("decoded %d NVFP4 weights (%s, ...) into %s as ModelOpt dequantizes them; the export's FP4 "
                    "activation scales and KV-cache scales (%d tensors) are not used: the artifact computes with "
                    "unquantized activations and its recipe's KV cache", len(ckpt.nvfp4), next(iter(ckpt.nvfp4)),
                    dtype, len(ckpt.nvfp4_dropped))
    if imported is not None:
        extra["algo"] = "prequantized"
        extra["prequantized"] = imported.summary()
        log.info("imported %d %s-quantized linears (%s) with the checkpoint's own codes and scales",
                 len(imported.linears), imported.fmt.source, ", ".join(extra["prequantized"]["schemes"]))

    ctx = PassContext(verify_atol=recipe.verify_atol(), progress=progress)
    if "verify" in names:
        # a pre-quantized checkpoint's reference: its float tensors and the format's own dequantization
        ctx.reference = reference_model(ckpt, dtype, imported, graph.params)
        ctx.verify_prompts = [tokenizer.encode(p) for p in recipe.verify.prompts]
    graph, records = run_passes(graph, names, ctx)
    timings = {"trace_s": trace_s, "load_weights_s": load_s, "passes_s": sum(r.seconds for r in records)}

    if quant_names:
        baseline = graph.copy() if recipe.gates.enabled else None  # shares the tensors the passes do not replace
        t = time.perf_counter()
        ctx.calibration = calib.windows if calib is not None else None
        for q in recipe.quant_sections():
            ctx.options[q.algo] = q.method_options()
        ctx.options["kv_cache_quant"] = {"kv_cache_dtype": recipe.runtime.kv_cache_dtype}
        log.info("quantization passes run on %s", device)
        host = graph.params
        graph.params = {k: v.to(device) for k, v in host.items()}  # the passes put new tensors in it
        moved = {k: weakref.ref(v) for k, v in graph.params.items()}  # what was copied, not kept alive
        try:
            graph, quant_records = run_passes(graph, quant_names, ctx)
        finally:  # the artifact writer and the gates read host tensors
            graph.params = params_to_host(graph.params, moved, host)
            del moved
            if device.type == "cuda":
                torch.cuda.empty_cache()
        records += quant_records
        timings["quantization_s"] = calib_s + time.perf_counter() - t  # reading the calibration data included
        if calib is not None:
            extra["calibration"] = {**calib.manifest(), "device": str(device)}
            if calib_warning:
                extra["calibration"]["warning"] = calib_warning
        if recipe.gates.enabled:
            t = time.perf_counter()
            report = run_gates(recipe, baseline, graph, tokenizer, device)
            timings["gates_s"] = time.perf_counter() - t
            extra["gates"] = report.to_dict()
            extra["gates"]["worst_layers"] = worst_layers(records)
            extra["gates"]["worst_layers_inputs"] = error_inputs(records)
    if shard_names := parallel_passes(recipe):  # per-rank weights are cut while writing, one tensor at a time
        ctx.options["shard"] = {"tp_size": par.tp_size, "vocab_parallel": par.vocab_parallel}
        graph, shard_records = run_passes(graph, shard_names, ctx)
        records += shard_records
    out = write_artifact(recipe, ckpt, graph, records, started_at, start, timings, extra)
    gates = extra.get("gates")
    if gates and not gates["passed"]:
        worst = "\n".join(f"  {name}: relative output error {err:.4g}" for name, err in gates["worst_layers"])
        raise GateFailure(f"quality gates failed for {recipe.name}: {', '.join(gates['failed'])}\n"
                          f"{report.table()}\nlayers with the largest relative output error (on "
                          f"{gates['worst_layers_inputs']}):\n{worst}\n"
                          f"the artifact was written to {out} and marked gate-failed; the runtime refuses it "
                          f"unless told --allow-failed-gate")
    seconds = time.perf_counter() - start
    log.info("built %s in %.1fs", out, seconds)
    return BuildResult(out, graph, records, seconds)

"""Reading a local Hugging Face checkpoint directory: config, safetensors weights, tokenizer files.

Any model family is opened: whether the toolchain can build it is decided by tracing and lifting its
modeling code (``passes/trace.py``), not by a list of names. Weights are read with safetensors only;
a checkpoint that ships only pickled weights (``pytorch_model.bin``) is refused rather than unpickled.
Tensor names are bound to the traced model's weights as transformers maps them when it loads the model
(:func:`map_tensor_names`: its registered renamings and base-model prefix; transformers is imported at build time
only); a weight transformers computes from several tensors on load (a mixture of experts' per-expert tensors stacked
into one) is computed by the same conversion operations.
Checkpoints already quantized by GPTQ, AutoAWQ, llm-compressor, transformers' fine-grained FP8 or ModelOpt (a
``quantization_config`` in config.json, or ModelOpt's hf_quant_config.json) are imported with their own codes and
scales (``builder/prequantized.py``); MXFP4 (gpt-oss) and ModelOpt NVFP4 weights are decoded to float weights as
they are read. Other quantization formats, and float8 or integer weight tensors that no such config describes, are
refused: their codes would be read as plain floats and their scales dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

if TYPE_CHECKING:
    from builder.prequantized import Imported, QuantFormat
    from passes.ir import Graph

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
FLOAT_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Checkpoint tensors no model weight stands for, safe to leave unread: rotary tables (recomputed from the config).
UNREAD_OK_SUFFIXES = ("rotary_emb.inv_freq",)
HASH_THREADS = min(8, os.cpu_count() or 1)  # checkpoint files hashed at once
QUANTIZE_INSTEAD = ("build from the unquantized (bf16/fp16/fp32) checkpoint and quantize with the recipe's "
                    "quantization section (algo: awq, gptq, smoothquant, fp8 or int8_wo)")


class CheckpointError(RuntimeError):
    """The checkpoint directory is missing, incomplete, corrupt or of an unsupported kind."""


@dataclass
class Checkpoint:
    """A verified local checkpoint: where its files are and what they hold."""

    path: Path
    config_dict: dict
    weight_files: list[Path]  # safetensors files, in name order
    weight_map: dict[str, Path]  # tensor name -> file
    quant: QuantFormat | None = None  # the quantization_config of a pre-quantized checkpoint
    # MXFP4 weights (gpt-oss's experts): the weight's name -> its (blocks, scales) tensors, decoded on read
    mxfp4: dict[str, tuple[str, str]] = field(default_factory=dict)
    mxfp4_files: dict[str, Path] = field(default_factory=dict)  # those blocks / scales tensors -> their file
    # ModelOpt NVFP4 weights: the weight's name -> its (codes, block scales, global scale[, pre_quant_scale]) tensors,
    # decoded on read (:func:`decode_nvfp4`); nvfp4_dropped: the activation and KV-cache scales left unread (see
    # _nvfp4_weights)
    nvfp4: dict[str, tuple[str, ...]] = field(default_factory=dict)
    nvfp4_files: dict[str, Path] = field(default_factory=dict)  # those three tensors -> their file
    nvfp4_dropped: list[str] = field(default_factory=list)

    @property
    def model_type(self) -> str:
        return self.config_dict.get("model_type", "")

    def hf_config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path, local_files_only=True)
        except Exception as e:  # transformers' validation raises many kinds (ValueError, TypeError, its own)
            problem = " ".join(str(e).split())
            raise CheckpointError(f"{self.path / 'config.json'}: transformers cannot read this {self.model_type} config "
                                  f"({type(e).__name__}: {problem}); the config is corrupt or from a newer "
                                  f"transformers, download the checkpoint again") from e

    def tokenizer_files(self) -> list[Path]:
        return [self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()]

    def file_hashes(self) -> dict[str, str]:
        """sha256 of config, weight and tokenizer files (and ModelOpt's hf_quant_config.json where the import read
        it), for the manifest. The files are hashed side by side (hashlib and file reads release the GIL): the 15
        shards of a 61 GB checkpoint in 10 s on the 16-core H100 machine, where one after another would take about
        50 s at its 1.2 GB/s of sha256 per core."""
        files = [self.path / "config.json", *self.weight_files, *self.tokenizer_files()]
        index = self.path / INDEX_FILE
        if index.is_file():
            files.append(index)
        if self.quant is not None and self.quant.cfg_file.name != "config.json":
            files.append(self.quant.cfg_file)
        elif self.nvfp4 and (self.path / "hf_quant_config.json").is_file():  # it may be what said NVFP4
            files.append(self.path / "hf_quant_config.json")
        with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(files))) as pool:
            return dict(zip((f.name for f in files), pool.map(_sha256, files)))

    def load_tensors(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read the named tensors; with ``dtype`` they are float weights, cast to it.

        A float weight stored as float8 or integers is a quantized code, not a value: it is refused
        rather than cast (its scales would be lost).
        """
        out: dict[str, torch.Tensor] = {}
        fp4 = [n for n in names if n in self.nvfp4]
        if fp4:
            parts = Checkpoint(self.path, self.config_dict, self.weight_files, self.nvfp4_files).load_tensors(
                [t for n in fp4 for t in self.nvfp4[n]])
            for name in fp4:
                codes, scales, scale_2, *pqs = (parts.pop(t) for t in self.nvfp4[name])
                try:  # (dtype None: fp32, exact)
                    out[name] = decode_nvfp4(codes, scales, scale_2, dtype or torch.float32, *pqs)
                except ValueError as e:
                    raise CheckpointError(f"{self.path}: NVFP4 weight {name!r}: {e}") from None
            names = [n for n in names if n not in self.nvfp4]
        packed = [n for n in names if n in self.mxfp4]
        if packed:
            parts = Checkpoint(self.path, self.config_dict, self.weight_files, self.mxfp4_files).load_tensors(
                [t for n in packed for t in self.mxfp4[n]])
            for name in packed:
                blocks, scales = (parts.pop(t) for t in self.mxfp4[name])
                try:
                    out[name] = decode_mxfp4(blocks, scales, dtype or torch.bfloat16)
                except ValueError as e:
                    raise CheckpointError(f"{self.path}: MXFP4 weight {name!r}: {e}") from None
            names = [n for n in names if n not in self.mxfp4]
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.weight_map:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint's weight files")
            by_file.setdefault(self.weight_map[name], []).append(name)
        for file, file_names in by_file.items():
            try:
                with safe_open(file, framework="pt") as f:
                    for name in file_names:
                        t = f.get_tensor(name)
                        if dtype is not None and t.dtype not in FLOAT_WEIGHT_DTYPES:
                            raise CheckpointError(
                                f"{file}: tensor {name!r} is stored as {str(t.dtype).removeprefix('torch.')} where "
                                f"a floating-point weight is expected: the checkpoint holds quantized weights, "
                                f"which are not imported; {QUANTIZE_INSTEAD}")
                        out[name] = t.to(dtype) if dtype is not None else t
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: cannot read tensor data ({e}); the file is corrupt or truncated, "
                                      f"download the checkpoint again") from e
        return out


# MXFP4 (OCP microscaling, e2m1 elements): the 16 values of a 4-bit code, and the elements per shared scale
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's MXFP4 expert weight as transformers holds it once dequantized: blocks uint8 [E, rows, G, 16] (two
    e2m1 codes a byte, the low nibble first), scales uint8 [E, rows, G] (e8m0: 2^(s - 127) per 32 elements) ->
    [E, G * 32, rows] in ``dtype`` (rows: the projection's outputs, so the weight is [experts, in, out]). Exact in
    bf16 and fp32 (a code times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not [E, rows, G, 16] "
                         f"and [E, rows, G]")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, groups * MXFP4_BLOCK, rows, dtype=dtype)
    for e in range(experts):  # one expert at a time: the fp32 temporaries stay an expert's size
        codes = torch.stack((blocks[e] & 0x0F, blocks[e] >> 4), dim=-1).flatten(-2).to(torch.int32)  # [rows, G, 32]
        values = torch.ldexp(lut[codes], scales[e].to(torch.int32)[..., None] - 127)
        out[e] = values.flatten(-2).t()
    return out


NVFP4_BLOCK = 16  # NVFP4: e2m1 elements per fp8 (e4m3) block scale
NVFP4_ROWS = 1024  # rows decoded at a time


def decode_nvfp4(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype,
                 pre_quant_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A ModelOpt NVFP4 weight as ModelOpt dequantizes it: codes uint8 [N, K / 2] (two e2m1 codes a byte, the even
    column in the low nibble), scales float8_e4m3fn [N, K / 16] (one per 16 columns), scale_2 fp32 (one number) ->
    [N, K] in ``dtype``: each code's value times (its block's scale * scale_2), in fp32, then rounded once to
    ``dtype``. ``pre_quant_scale`` [K] (NVFP4_AWQ: the linear computes W (s * x)) is folded into the columns in fp32
    first: W diag(s), the same product."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or scale_2.numel() != 1 \
            or not scale_2.is_floating_point():
        raise ValueError(f"expected uint8 codes, float8_e4m3fn block scales and one float global scale, got "
                         f"{codes.dtype}, {scales.dtype} and {scale_2.dtype} {tuple(scale_2.shape)}")
    if codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0] \
            or 2 * codes.shape[1] != NVFP4_BLOCK * scales.shape[1]:
        raise ValueError(f"codes {tuple(codes.shape)} and block scales {tuple(scales.shape)} are not [N, K / 2] and "
                         f"[N, K / {NVFP4_BLOCK}]")
    if pre_quant_scale is not None and tuple(pre_quant_scale.shape) != (2 * codes.shape[1],):
        raise ValueError(f"pre_quant_scale {tuple(pre_quant_scale.shape)} is not [K] = [{2 * codes.shape[1]}]")
    columns = pre_quant_scale.to(torch.float32) if pre_quant_scale is not None else None
    if columns is not None:  # as the AWQ imports take one (builder/prequantized.py _read_pre_quant_scale)
        allowed = "expected finite scales, not all 0 (a few zeros and negative values are allowed)"
        finite = torch.isfinite(columns)
        if not bool(finite.all()):
            at = int(torch.nonzero(~finite)[0, 0])
            raise ValueError(f"pre_quant_scale holds {float(columns[at])} (input feature {at}), which the folded "
                             f"column would carry into every output; {allowed}")
        if columns.numel() and not bool(columns.ne(0).any()):
            raise ValueError(f"pre_quant_scale is 0 in all {columns.numel()} values, which would fold the weight to "
                             f"zeros; {allowed}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    rows, half = codes.shape
    out = torch.empty(rows, 2 * half, dtype=dtype)
    for r in range(0, rows, NVFP4_ROWS):  # rows at a time: the fp32 and index temporaries stay bounded
        c = codes[r:r + NVFP4_ROWS]
        values = lut[torch.stack((c & 0x0F, c >> 4), dim=-1).flatten(-2).to(torch.int64)]  # [rows, K]
        block = scales[r:r + NVFP4_ROWS].to(torch.float32) * scale_2.reshape(()).to(torch.float32)  # [rows, K / 16]
        w = (values.view(len(c), -1, NVFP4_BLOCK) * block[..., None]).flatten(-2)
        out[r:r + NVFP4_ROWS] = (w if columns is None else w * columns).to(dtype)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Check a checkpoint directory and index its weights; raises CheckpointError saying what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = (f" {str(path)!r} looks like a model hub id: this toolchain never downloads; download the "
                f"checkpoint first (e.g. `huggingface-cli download {path} --local-dir models/NAME`) and point "
                f"model.checkpoint at that directory" if _looks_like_hub_id(str(path))
                else " download the checkpoint first and point model.checkpoint at its local directory")
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist;{hint}")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} is not a directory; expected a Hugging Face model directory "
                              f"with config.json and *.safetensors")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{p} has no config.json; expected a Hugging Face model directory")
    try:
        config = json.loads(cfg_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); download the checkpoint again") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_file} holds a JSON {type(config).__name__}, not an object of model settings; "
                              f"download the checkpoint again")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{cfg_file}: model_type is {json.dumps(model_type)}; config.json must name the "
                              f"model's family (e.g. \"llama\"), which transformers needs to read it; the config "
                              f"is incomplete, download the checkpoint again")
    from builder.prequantized import PrequantizedError, read_quant_config

    try:
        quant = read_quant_config(cfg_file, config)
    except PrequantizedError as e:
        raise CheckpointError(str(e)) from None
    _check_dimensions(cfg_file, config)
    _check_tokenizer_fits(p / "tokenizer.json", config.get("vocab_size"))
    weight_files, weight_map = _index_weights(p)
    _check_layer_count(cfg_file, config, weight_map)
    mxfp4, mxfp4_files = _mxfp4_weights(cfg_file, config, weight_map)
    nvfp4, nvfp4_files, dropped = _nvfp4_weights(cfg_file, config, weight_map)
    return Checkpoint(p, config, weight_files, weight_map, quant, mxfp4, mxfp4_files, nvfp4, nvfp4_files, dropped)


def _nvfp4_weights(cfg_file: Path, config: dict, weight_map: dict[str, Path]
                   ) -> tuple[dict[str, tuple[str, ...]], dict[str, Path], list[str]]:
    """A ModelOpt NVFP4 export (``quant_algo: NVFP4``) holds each quantized linear's weight as ``W`` (packed e2m1
    codes), ``W_scale`` (fp8 block scales) and ``W_scale_2`` (a global scale); NVFP4_AWQ's linears may also keep AWQ's
    ``pre_quant_scale`` (folded into the decoded columns). Returned as W -> those tensors, decoded
    to float weights as they are read (:func:`decode_nvfp4`: the format's own dequantization; the build then holds
    no FP4 scheme, and the recipe's quantization section may quantize the weights again). The linears' FP4
    activation scales (``input_scale``) and an FP8 KV cache's ``k_scale`` / ``v_scale`` are left unread and listed:
    the artifact computes with unquantized activations and the KV cache of its recipe. Their weight-map entries are
    removed (the scales are parts of their weights, not weights)."""
    from builder.prequantized import nvfp4_export

    algo = nvfp4_export(cfg_file, config)
    if algo is None:
        return {}, {}, []
    parts: dict[str, tuple[str, ...]] = {}
    for name in [n for n in weight_map if n.endswith(".weight_scale_2")]:
        base = name.removesuffix("_scale_2")
        for t in (base, base + "_scale"):
            if t not in weight_map:
                raise CheckpointError(f"{cfg_file.parent}: NVFP4 tensor {name!r} has no {t!r}; the checkpoint is "
                                      f"incomplete, export it again")
        pqs = base.removesuffix("weight") + "pre_quant_scale"
        parts[base] = (base, base + "_scale", name) + ((pqs,) if algo == "NVFP4_AWQ" and pqs in weight_map else ())
    if not parts:
        raise CheckpointError(f"{cfg_file}: the ModelOpt export's quant_algo is \"{algo}\" but no tensor is stored as "
                              f"NAME.weight / NAME.weight_scale / NAME.weight_scale_2")
    files: dict[str, Path] = {}
    for codes, *scales in parts.values():
        files[codes] = weight_map[codes]
        files.update({t: weight_map.pop(t) for t in scales})
    # the NVFP4 linears' activation scales, and the attention modules' KV-cache scales
    dropped = [n for n in (codes.removesuffix("weight") + "input_scale" for codes in parts) if n in weight_map]
    dropped += [n for n in weight_map if n.endswith((".k_scale", ".v_scale"))]
    for n in dropped:
        del weight_map[n]
    return parts, files, dropped


def _mxfp4_weights(cfg_file: Path, config: dict,
                   weight_map: dict[str, Path]) -> tuple[dict[str, tuple[str, str]], dict[str, Path]]:
    """An MXFP4 checkpoint (``quant_method: mxfp4``, gpt-oss's release format) holds each quantized weight as
    ``NAME_blocks`` and ``NAME_scales``; those pairs are listed under NAME in the weight map (read as one float
    weight: decoding is exact, nothing is lost) and returned with the files of their parts. A blocks tensor without
    its scales is an error."""
    section = config.get("quantization_config")
    if not (isinstance(section, dict) and section.get("quant_method") == "mxfp4"):
        return {}, {}
    pairs: dict[str, tuple[str, str]] = {}
    for name in [n for n in weight_map if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        if base + "_scales" not in weight_map:
            raise CheckpointError(f"{cfg_file.parent}: MXFP4 tensor {name!r} has no {base + '_scales'!r}; the "
                                  f"checkpoint is incomplete, download it again")
        pairs[base] = (name, base + "_scales")
    if not pairs:
        raise CheckpointError(f"{cfg_file}: quantization_config.quant_method is \"mxfp4\" but no tensor is stored "
                              f"as NAME_blocks / NAME_scales")
    files: dict[str, Path] = {}
    for base, (blocks, scales) in pairs.items():
        files[blocks], files[scales] = weight_map.pop(blocks), weight_map.pop(scales)
        weight_map[base] = files[blocks]
    return pairs, files


# Model sizes in config.json, checked when present (a key left out takes the family's default).
DIMENSIONS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")


PER_LAYER_DIMENSIONS = ("intermediate_size",)  # may be a list, one size per layer (Gemma 3n's MLPs)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_dimensions(cfg_file: Path, config: dict) -> None:
    """The sizes the model is built from: positive whole numbers (one per layer where a family sizes its layers
    apart), heads that group evenly."""
    for key in DIMENSIONS:
        value = config.get(key)
        if value is None and key in ("num_key_value_heads", "head_dim"):  # null: derived from the heads
            continue
        if key in PER_LAYER_DIMENSIONS and isinstance(value, list):
            layers = config.get("num_hidden_layers")
            if not value or not all(map(_positive_int, value)) or (_positive_int(layers) and len(value) != layers):
                raise CheckpointError(f"{cfg_file}: {key} is {json.dumps(value)[:120]}, expected a positive whole "
                                      f"number or a list of them, one per layer ({layers} layers); the config is "
                                      f"corrupt, download the checkpoint again")
            continue
        if key in config and not _positive_int(value):
            raise CheckpointError(f"{cfg_file}: {key} is {json.dumps(value)}, expected a positive whole number; "
                                  f"the config is corrupt, download the checkpoint again")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise CheckpointError(f"{cfg_file}: num_key_value_heads {kv_heads} does not divide num_attention_heads "
                              f"{heads}; the config is corrupt, download the checkpoint again")
    hidden = config.get("hidden_size")
    if heads and hidden and not config.get("head_dim") and hidden % heads:
        raise CheckpointError(f"{cfg_file}: num_attention_heads {heads} does not divide hidden_size {hidden} and "
                              f"no head_dim is given; the config is corrupt, download the checkpoint again")
    top_k = config.get("num_experts_per_tok")
    experts_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if _positive_int(config.get(k))), None)
    if _positive_int(top_k) and experts_key is not None and top_k > config[experts_key]:
        raise CheckpointError(f"{cfg_file}: num_experts_per_tok {top_k} is more than the {config[experts_key]} "
                              f"experts ({experts_key}); a token is routed to at most every expert: the config is "
                              f"corrupt, download the checkpoint again")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")  # model.layers.N., transformer.h.N., ...


def _check_layer_count(cfg_file: Path, config: dict, weight_map: dict[str, Path]) -> None:
    """config.json's num_hidden_layers against the layers the files hold: a count past them fails now, not after
    every one of them has been traced (a corrupt 100,000 took minutes to reach the missing weight)."""
    layers = config.get("num_hidden_layers")
    stored = {int(m.group(1)) for name in weight_map if (m := _LAYER_INDEX.search(name))}
    if _positive_int(layers) and stored and layers > max(stored) + 1:
        raise CheckpointError(f"{cfg_file}: num_hidden_layers is {layers} but the safetensors files hold layers "
                              f"0..{max(stored)}; the config or the files are incomplete, download the checkpoint "
                              f"again")


def tokenizer_size(tokenizer_json: dict) -> int:
    """One past the largest token id in a tokenizer.json: its model's vocabulary plus its added tokens."""
    model = tokenizer_json.get("model")
    vocab = (model.get("vocab") if isinstance(model, dict) else None) or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
    ids += [t.get("id") for t in tokenizer_json.get("added_tokens") or [] if isinstance(t, dict)]
    return max((i for i in ids if isinstance(i, int)), default=-1) + 1


def _check_tokenizer_fits(tokenizer_file: Path, vocab_size: int | None) -> None:
    """A tokenizer whose ids reach past the model's embedding rows would index out of it.

    A tokenizer.json that does not parse is left to the tokenizer loader, which says what is wrong.
    """
    if not tokenizer_file.is_file() or vocab_size is None:
        return
    try:
        data = json.loads(tokenizer_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    size = tokenizer_size(data) if isinstance(data, dict) else 0
    if size > vocab_size:
        raise CheckpointError(f"{tokenizer_file}: the tokenizer has {size} tokens (ids 0..{size - 1}, added tokens "
                              f"included) but config.json vocab_size is {vocab_size}: ids from {vocab_size} on have "
                              f"no embedding row; use the tokenizer that came with this model")


def _index_weights(p: Path) -> tuple[list[Path], dict[str, Path]]:
    index = p / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_bytes())["weight_map"]
            files = sorted({p / f for f in mapping.values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (expected a JSON object whose "
                                  f"weight_map maps tensor names to shard files; {type(e).__name__}: {e}); "
                                  f"download the checkpoint again") from e
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{p}: shards named in {INDEX_FILE} are missing: {', '.join(missing)}")
    else:
        files = sorted(p.glob("*.safetensors"))
        if not files:
            pickles = [f.name for f in p.glob("*.bin")] + [f.name for f in p.glob("*.pt")]
            extra = (f" (found {', '.join(pickles)}: pickled weights are never loaded; convert them to "
                     f"safetensors first)" if pickles else "; download the model's *.safetensors files into it")
            raise CheckpointError(f"{p} has no *.safetensors weight files{extra}")
    special = next((f for f in files if not f.is_file()), None)  # a pipe or a device would block the read
    if special is not None:
        raise CheckpointError(f"{special} is not a regular file; a checkpoint's weights are files")
    indexed = {name: p / f for name, f in mapping.items()} if index.is_file() else {}
    weight_map: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as handle:
                names = list(handle.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e}); download the checkpoint again") from e
        for name in names:
            first = weight_map.setdefault(name, f)
            if first is not f and not _same_tensor(name, first, f):  # which copy is read depends on the loader
                where = (f" ({INDEX_FILE} names {indexed[name].name})" if name in indexed
                         else "" if indexed else f" (no {INDEX_FILE})")
                raise CheckpointError(f"{p}: tensor {name!r} is stored in both {first.name} and {f.name} with "
                                      f"different values{where}; which copy a loader reads depends on the loader "
                                      f"(transformers: the last file it reads): remove the stale copy or download "
                                      f"the checkpoint again")
    return files, weight_map


def _same_tensor(name: str, a: Path, b: Path) -> bool:
    """Whether files ``a`` and ``b`` hold the same tensor ``name`` (dtype, shape and values)."""
    with safe_open(a, framework="pt") as fa, safe_open(b, framework="pt") as fb:
        x, y = fa.get_tensor(name), fb.get_tensor(name)
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@dataclass
class TensorNames:
    """The checkpoint's tensor names as transformers maps them when it loads the model (:func:`map_tensor_names`)."""

    model_name: dict[str, str]  # checkpoint name -> the model's state-dict name it is loaded into
    converted: dict[str, str]  # checkpoint name -> model name transformers computes from it (split, merged, permuted)
    ignored: frozenset[str]  # checkpoint names transformers drops on load (old causal-mask buffers and the like)
    # checkpoint name in ``converted`` -> (transformers' WeightConverter that computes its model weight, the source
    # pattern of it the name matched)
    converters: dict[str, tuple[Any, str]] = field(default_factory=dict)


@dataclass
class Conversion:
    """A weight transformers computes on load from several checkpoint tensors with a ``WeightConverter`` (a
    mixture-of-experts block's per-expert ``experts.3.w1.weight`` tensors stacked into ``experts.gate_up_proj``),
    assembled here by that converter's own operations."""

    converter: Any  # transformers' WeightConverter
    sources: dict[str, list[str]]  # its source pattern -> checkpoint names, in transformers' order (expert 0, 1, ...)

    def names(self) -> list[str]:
        return [n for names in self.sources.values() for n in names]


def map_tensor_names(meta_model: torch.nn.Module, names: list[str]) -> TensorNames:
    """Map checkpoint tensor names to ``meta_model``'s parameter names with transformers' own loading rules.

    transformers renames checkpoint keys on load: the model's registered weight conversions (e.g. GPT-NeoX's
    ``embed_out.`` -> ``lm_head.``, legacy ``LayerNorm.gamma`` -> ``LayerNorm.weight``), then the
    ``base_model_prefix`` added or stripped where only the other form is a model key (a base-model checkpoint
    read into a ``ForCausalLM`` model, or the reverse). The same rules are reused here, read from the installed
    transformers, so a checkpoint binds under exactly the names ``from_pretrained`` would give it. Conversions that
    compute a weight from several tensors or reshape it (``WeightConverter``) are not renamings: the tensors they
    match are returned in ``converted``, and in ``converters`` which converter makes each one's weight
    (:func:`weight_sources` assembles a weight that one converter makes from several tensors, a mixture of experts'
    per-expert tensors stacked, with that converter's operations). Checkpoint keys that map to no model key and that
    the model lists in ``_keys_to_ignore_on_load_unexpected`` (and the like) are returned in ``ignored``.
    """
    state = meta_model.state_dict()
    model_name: dict[str, str] = {}
    converted: dict[str, str] = {}
    by_converter: dict[str, tuple[Any, str]] = {}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x: a class's regex key mapping, then the prefix
        _map_names_v4(meta_model, names, state, model_name)
    else:
        transforms = get_model_conversion_mapping(meta_model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        prefix = getattr(meta_model, "base_model_prefix", None) or None
        for name in names:
            renamed, pattern = rename_source_key(name, renamings, converters, prefix, state)
            if renamed not in state and name in state:  # as transformers: a key the model has is kept as it is
                renamed, pattern = rename_source_key(name, [], [], prefix, state)
            (converted if pattern is not None else model_name)[name] = renamed
            if pattern is not None:
                by_converter[name] = (next(c for c in converters if pattern in c.source_patterns), pattern)
    unexpected = {n: m for n, m in model_name.items() if m not in state}
    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(unexpected.values()))
    try:
        meta_model._adjust_missing_and_unexpected_keys(info)  # the model's own ignore patterns
    except (AttributeError, TypeError):  # another transformers' signature: nothing is ignored
        info.unexpected_keys = set(unexpected.values())
    ignored = frozenset(n for n, m in unexpected.items() if m not in info.unexpected_keys)
    return TensorNames(model_name, converted, ignored, by_converter)


def _map_names_v4(meta_model: torch.nn.Module, names: list[str], state: dict, out: dict[str, str]) -> None:
    """transformers 4.x's renaming on load: the first matching ``_checkpoint_conversion_mapping`` regex, then the
    ``base_model_prefix`` added or stripped."""
    key_mapping = getattr(meta_model, "_checkpoint_conversion_mapping", None) or {}
    prefix = getattr(meta_model, "base_model_prefix", "")
    for name in names:
        renamed = name
        for pattern, replacement in key_mapping.items():
            renamed, n = re.subn(pattern, replacement, name)
            if n:
                break
        if prefix and renamed not in state:
            if renamed.startswith(prefix + ".") and renamed.removeprefix(prefix + ".") in state:
                renamed = renamed.removeprefix(prefix + ".")
            elif f"{prefix}.{renamed}" in state:
                renamed = f"{prefix}.{renamed}"
        out[name] = renamed


def weight_sources(graph: Graph, ckpt: Checkpoint, meta_model: torch.nn.Module,
                   imported: frozenset[str] = frozenset()) -> dict[str, str | Conversion]:
    """Which checkpoint tensor each of the graph's weights is read from (graph name -> checkpoint name), or for a
    weight transformers computes from several tensors on load (stacked experts), how (a :class:`Conversion`).

    Checkpoint names are mapped to the traced model's names as transformers maps them on load
    (:func:`map_tensor_names`: e.g. GPT-NeoX stores its lm_head as ``embed_out.weight``). A tied weight is
    traced under one of its names (e.g. ``lm_head.weight``) while the checkpoint may store it under another
    (``model.embed_tokens.weight``); aliases come from the model itself. Every checkpoint tensor must be read by
    some weight (or be an alias of one, or be one transformers drops on load): a tensor nothing reads, such as a
    ``weight_scale``, means the graph would compute something else than the checkpoint.
    ``imported``: tensors a pre-quantized checkpoint's import read already.
    """
    aliases: dict[int, list[str]] = {}
    for name, p in meta_model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    alias_of = {n: names for names in aliases.values() for n in names}
    names = map_tensor_names(meta_model, sorted(n for n in ckpt.weight_map if n not in imported))
    stored_as: dict[str, list[str]] = {}  # model name -> the checkpoint names loaded into it
    for stored, model_name in names.model_name.items():
        stored_as.setdefault(model_name, []).append(stored)
    wanted: dict[str, str | Conversion] = {}  # graph name -> checkpoint name, or how it is computed from several
    read: set[str] = set(imported) | names.ignored
    for name, t in graph.params.items():
        if not t.is_meta:
            continue
        sources = [s for a in alias_of.get(name, [name]) for s in stored_as.get(a, [])]
        conversion = _conversion(names, alias_of.get(name, [name]))
        if not sources and conversion is not None:
            wanted[name] = conversion
            read.update(conversion.names())
            continue
        if not sources:
            converted = sorted(s for s, m in names.converted.items() if m in alias_of.get(name, [name]))
            how = (f"; transformers computes it from {', '.join(map(repr, converted))} by a conversion (split, merge "
                   f"or permutation) that binding tensors by name does not perform" if converted
                   else "; the checkpoint is incomplete")
            raise CheckpointError(f"{ckpt.path}: weight {name!r} (or an alias of it) is missing from the "
                                  f"safetensors files, under its own name and any name transformers maps to it{how}")
        if len(sources) > 1:  # one weight of the model (tied) stored under several names: they must agree
            stored = ckpt.load_tensors(sources)
            differing = next((s for s in sources[1:] if not torch.equal(stored[s], stored[sources[0]])), None)
            if differing is not None:
                raise CheckpointError(f"{ckpt.path}: {sources[0]!r} and {differing!r} are one weight of the "
                                      f"{ckpt.model_type} model as config.json builds it (tied) but the files store "
                                      f"different values{_tie_hint(ckpt, [sources[0], differing])}")
        wanted[name] = sources[0]
        read.update(sources)
    unread = sorted(n for n in ckpt.weight_map if n not in read and not n.endswith(UNREAD_OK_SUFFIXES))
    if unread:
        def shown_name(n: str) -> str:
            mapped = names.model_name.get(n, names.converted.get(n, n))
            return n if mapped == n else f"{n} (loaded by transformers as {mapped})"

        shown = ", ".join(map(shown_name, unread[:6])) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
        count = "1 checkpoint tensor is" if len(unread) == 1 else f"{len(unread)} checkpoint tensors are"
        if ckpt.quant is not None:
            raise CheckpointError(f"{ckpt.path}: {count} read by no weight of the {ckpt.model_type} model: {shown}; "
                                  f"the {ckpt.quant.source} import reads each quantized linear's own tensors only, "
                                  f"so these belong to no linear it imports (another format, or adapters)")
        raise CheckpointError(f"{ckpt.path}: {count} read by no weight of the {ckpt.model_type} model: {shown}; "
                              f"a checkpoint with extra tensors (quantization "
                              f"scales, adapters) is not imported: {QUANTIZE_INSTEAD}")
    return wanted


def _tie_hint(ckpt: Checkpoint, names: list[str]) -> str:
    """What to change when an embedding and an lm_head stored apart are tied by the config: its effective
    tie_word_embeddings (the model class's default when config.json does not set it)."""
    if not any("lm_head" in n or "embed_out" in n for n in names):
        return "; the checkpoint and its config.json disagree, download the checkpoint again"
    try:
        tied = getattr(ckpt.hf_config(), "tie_word_embeddings", None)
    except CheckpointError:
        tied = ckpt.config_dict.get("tie_word_embeddings")
    said = "sets" if "tie_word_embeddings" in ckpt.config_dict else "leaves to the model's default"
    return (f" (config.json {said} tie_word_embeddings: {json.dumps(tied)}); if the model has its own lm_head, set "
            f"tie_word_embeddings to false in config.json")


def _natural_key(name: str) -> tuple:
    """Sort key of tensor names with numbers in order (experts.2 before experts.10), as transformers loads them."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _conversion(names: TensorNames, model_names: list[str]) -> Conversion | None:
    """How transformers computes the model weight ``model_names`` (a weight and its aliases) from several
    checkpoint tensors with one WeightConverter, or None (no converter makes it, or several would)."""
    stored = sorted((s for s, m in names.converted.items() if m in model_names), key=_natural_key)
    converters = {id(names.converters[s][0]): names.converters[s][0] for s in stored if s in names.converters}
    if not stored or len(converters) != 1:
        return None
    converter = next(iter(converters.values()))
    sources: dict[str, list[str]] = {p: [] for p in converter.source_patterns}
    for s in stored:
        sources[names.converters[s][1]].append(s)
    return Conversion(converter, {p: v for p, v in sources.items() if v})


def _convert(conversion: Conversion, tensors: dict[str, torch.Tensor], name: str, where: Path) -> torch.Tensor:
    """Run a Conversion's operations (transformers' own: stack the experts, concatenate gate and up) over its
    checkpoint tensors."""
    converter = conversion.converter
    collected: dict[str, Any] = {p: [tensors[n] for n in names] for p, names in conversion.sources.items()}
    try:
        for op in converter.operations:
            collected = op.convert(collected, source_patterns=list(converter.source_patterns),
                                   target_patterns=list(converter.target_patterns), full_layer_name=name,
                                   model=None, config=None, missing_keys=None)
    except Exception as e:  # a conversion op's own checks (ValueError, RuntimeError from torch.cat, ...)
        raise CheckpointError(f"{where}: weight {name!r} is computed by transformers from "
                              f"{len(conversion.names())} tensors ({', '.join(conversion.sources)}), and that "
                              f"conversion failed here ({type(e).__name__}: {e})") from e
    if len(collected) != 1 or not isinstance(next(iter(collected.values())), torch.Tensor):
        raise CheckpointError(f"{where}: weight {name!r} is computed by transformers from "
                              f"{', '.join(conversion.sources)} by a conversion that makes {len(collected)} tensors; "
                              f"binding assembles a weight from a conversion that makes one")
    return next(iter(collected.values()))


def quantized_expert_sources(graph: Graph, ckpt: Checkpoint, meta_model: torch.nn.Module,
                             taken: set[str]) -> dict[str, tuple[dict[str, list[str]], Any]]:
    """For a pre-quantized checkpoint: each moe weight (graph name) that transformers stacks from per-expert linears
    the checkpoint stores quantized -> (source pattern -> ``<module>.weight`` names in expert order, a function
    stacking float tensors by those names with transformers' own conversion), for
    ``builder.prequantized.import_experts``. The names are mapped as transformers maps checkpoint names on load
    (:func:`map_tensor_names`), ``<module>.weight`` standing for the module's quantized tensors."""
    from builder.prequantized import expert_modules

    if ckpt.quant is None or not any(n.op == "moe" for n in graph.nodes):
        return {}
    pseudo = expert_modules(ckpt, ckpt.quant, taken)
    if not pseudo:
        return {}
    names = map_tensor_names(meta_model, sorted(pseudo))
    out: dict[str, tuple[dict[str, list[str]], Any]] = {}
    for node in graph.nodes:
        if node.op != "moe":
            continue
        for role in ("w_gate_up", "w_down"):
            name = node.weights.get(role, "")
            if name not in graph.params or not graph.params[name].is_meta:
                continue
            conversion = _conversion(names, [name])
            if conversion is not None:
                out[name] = (conversion.sources, lambda refs, c=conversion, n=name: _convert(c, refs, n, ckpt.path))
    return out


def attach_weights(graph: Graph, ckpt: Checkpoint, meta_model: torch.nn.Module,
                   dtype: torch.dtype, keep_references: bool = True) -> Imported | None:
    """Replace the traced graph's meta params with the checkpoint's tensors, cast to ``dtype``.

    A pre-quantized checkpoint's quantized linears get their IR scheme from its own codes and scales first
    (``builder/prequantized.py``); what that import made is returned (None for a floating-point checkpoint), with
    the format's dequantized weights for a reference model when ``keep_references`` (only the verify pass needs them).

    NOTE host memory: safetensors maps the weight files, so a tensor stored in ``dtype`` is not copied (its pages
    are the page cache's, read when the artifact is written). Cast tensors and weights computed from several tensors
    (stacked experts) are copies, and the tensors a weight was computed from are let go of once it is made: the
    build holds at most one model's worth of private memory.
    """
    imported = None
    if ckpt.quant is not None:
        from builder.prequantized import PrequantizedError, check_imported, import_experts, import_linears

        try:
            imported = import_linears(graph, ckpt, ckpt.quant, dtype, require=False, keep_references=keep_references)
            import_experts(graph, ckpt, ckpt.quant, dtype, imported,
                           quantized_expert_sources(graph, ckpt, meta_model, imported.consumed))
            check_imported(imported, ckpt)
        except PrequantizedError as e:
            raise CheckpointError(str(e)) from None
    wanted = weight_sources(graph, ckpt, meta_model, frozenset(imported.consumed) if imported else frozenset())
    stored_names = {n for s in wanted.values() for n in (s.names() if isinstance(s, Conversion) else [s])}
    tensors = ckpt.load_tensors(sorted(stored_names), dtype)
    # weights the family keeps in fp32 whatever its dtype (a router's selection bias, its fp32 router's weight: the
    # lift's meta["fp32_weights"], from transformers' _keep_in_fp32_modules): read again, as fp32
    fp32 = {wanted[n] for n in graph.meta.pop("fp32_weights", ()) if isinstance(wanted.get(n), str)}
    if fp32:
        tensors.update({n: t.float() for n, t in ckpt.load_tensors(sorted(fp32), None).items()})
    # Conv1D weights (GPT-2), stored [in, out]: the graph's linears hold them [out, in] like every other linear's, so
    # they are transposed once, here, and the artifact stores them so
    transposed = set(graph.meta.pop("transposed_weights", ()))
    # gpt-oss's experts, stored [E, in, out] with gate / up interleaved: converted once to the moe op's layout
    moe_layouts = graph.meta.pop("moe_weight_layouts", {})
    if moe_layouts:
        from passes.lift import moe_layout_convert, moe_layout_shape
    for name, stored in wanted.items():
        expected = tuple(graph.params[name].shape)
        expected = expected[::-1] if name in transposed else expected
        if name in moe_layouts:
            expected = moe_layout_shape(moe_layouts[name], expected)  # [E, out, in] -> [E, in, out]; biases as held
        if isinstance(stored, Conversion):  # its tensors are its alone: let go of them (copies, when cast) once used
            tensor = _convert(stored, {n: tensors.pop(n) for n in stored.names()}, name, ckpt.path)
        else:
            tensor = tensors.pop(stored) if name in moe_layouts else tensors[stored]  # a converted copy replaces it
        if tuple(tensor.shape) != expected:
            what = (f"weight {name!r}, computed from {len(stored.names())} tensors ({', '.join(stored.sources)}),"
                    if isinstance(stored, Conversion) else f"tensor {stored!r}")
            raise CheckpointError(f"{ckpt.path}: {what} has shape {tuple(tensor.shape)}, config.json implies "
                                  f"{expected}")
        if name in moe_layouts:
            tensor = moe_layout_convert(moe_layouts[name], tensor)
        graph.params[name] = tensor.t().contiguous() if name in transposed else tensor
    graph.meta["dtype"] = str(dtype).removeprefix("torch.")
    return imported

"""Importing checkpoints another tool already quantized: GPTQ, AutoAWQ, compressed-tensors, transformers'
fine-grained FP8 and NVIDIA ModelOpt.

A pre-quantized checkpoint's linears keep the checkpoint's own codes, scales and zero points: each is mapped,
without re-quantizing, onto an IR scheme (``passes/ir.py`` QUANT_SCHEMES), and the import checks that the IR's
dequantization of what it made equals the format's own dequantization bit for bit in fp32. What the formats
store per linear (N = out features, K = in features, G = groups along K):

    gptq (AutoGPTQ, GPTQModel, optimum)     qweight int32 [K*b/32, N] (codes along K, low bits = lower k),
                                            qzeros int32 [G, N*b/32] (along N), scales [G, N], g_idx int32 [K];
                                            w[n, k] = (q - z) * s at group g_idx[k]; format v1 stores z - 1
    awq (AutoAWQ, version gemm)             qweight int32 [K, N/8], qzeros int32 [G, N/8], both along N in the
                                            nibble order 0 2 4 6 1 3 5 7; scales [G, N]; groups are k // group
    compressed-tensors pack-quantized       weight_packed int32 [N, K*b/32] (along K), weight_scale [N, G],
                                            weight_zero_point int32 [N*b/32, G] (along N; asymmetric only),
                                            weight_shape [2], weight_g_idx [K]? (act-order); codes are signed,
                                            stored + 2^(b-1)
    compressed-tensors float-quantized      weight float8_e4m3fn [N, K], weight_scale [N, 1] or [1],
                                            input_scale [1] (static activations)
    compressed-tensors int-quantized        weight int8 [N, K], weight_scale [N, 1], input_scale [1]? (static:
                                            codes round(clamp(x / input_scale, -128, 127)), calculate_range's
                                            int8 range; input_scale = amax / 127.5)
    fp8 (fine-grained, weight_block_size    weight float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N/bn),
        [bn, bk]: DeepSeek-V3, Qwen3-FP8)   ceil(K/bk)]: w[n, k] = q * weight_scale_inv[n // bn, k // bk], partial
                                            last blocks included; activations e4m3 per token and bk-wide group
                                            (dynamic); every linear but lm_head and modules_to_not_convert
    modelopt FP8                            weight float8_e4m3fn [N, K], weight_scale fp32 [] (amax / 448),
                                            input_scale fp32 [] (static); k_proj.k_scale / v_proj.v_scale [] with
                                            kv_cache_quant_algo FP8
    modelopt FP8_PER_CHANNEL_PER_TOKEN      weight float8_e4m3fn [N, K], weight_scale [N]; activations per token
    modelopt W8A16                          weight int8 [N, K], weight_scale [N] (amax / 127)
    modelopt W4A16_AWQ                      weight uint8 [N/2, K]: signed 4-bit codes (-8..7) along N, row 2i in
                                            the low nibble, 2i+1 in the high one; weight_scale fp32 [N, K/group]
                                            (amax / 7): w[n, k] = q * s[n, k // group], no zero points;
                                            pre_quant_scale [K] (model dtype) where the export kept AWQ's scale on
                                            the linear (o_proj, down_proj: no norm writes their input): y = W (x * s)
    modelopt W8A8_SQ_PER_CHANNEL            weight int8 [N, K] (round(w / scale) clamped to -128..127, of the
                                            smoothed w / s), weight_scale fp32 [N] (amax / 127), input_scale fp32
                                            [] (amax of x * s over calibration / 127: static), pre_quant_scale [K]
                                            (model dtype) on every linear (SmoothQuant's s, never folded into a
                                            norm; the linears reading one input share s and input_scale): y =
                                            W (x * s), x * s quantized to round-half-even(x * s / input_scale)
                                            clamped to -128..127 (narrow_range false)

ModelOpt's settings come from hf_quant_config.json beside config.json (``quantization``: quant_algo,
kv_cache_quant_algo, exclude_modules as fnmatch patterns, quantized_layers for MIXED_PRECISION); exports from
ModelOpt 0.29 on also carry a flat ``quantization_config`` (``quant_method: modelopt``, ``ignore``), read where
hf_quant_config.json is absent. FP8 maps onto the IR's fp8 with static activations (compressed-tensors' per-tensor
path), FP8_PER_CHANNEL_PER_TOKEN onto fp8 per channel with dynamic activations, W8A16 onto w8a16 (zero point 128),
W4A16_AWQ onto w4a16 (zero point 8, group_size from hf_quant_config.json: config.json's quantization_config does not
carry it) with the linear's pre_quant_scale as its ``pre_quant_scale`` role (x * s in fp32, rounded to the activations'
dtype, as the exporter's own bf16 product; the reference model applies it with a pre-hook), W8A8_SQ_PER_CHANNEL onto
w8a8_int8 with static activations, ``act_qmin`` -128 and the pre_quant_scale role (applied before the activation
quantization, as ModelOpt's input quantizer multiplies first); fine-grained FP8 onto fp8_block. compressed-tensors'
static int8 activations (int-quantized, ``input_activations`` strategy tensor, not dynamic) import with ``act_qmin``
-128 too: both formats clamp int8 activation codes at -128, the SmoothQuant pass's (the IR's default) at -127.
ModelOpt itself folds AWQ's scale into the norm before q/k/v and gate/up (those linears arrive without one); the ones
it keeps are not folded into the rows of v_proj / up_proj here either, which would mean making their codes again.
The KV cache's k_scale / v_scale are read and checked, not applied: the build's KV cache is runtime.kv_cache_dtype's.

Mixture-of-experts layers whose experts are stored quantized, one linear per expert and projection
(``experts.3.gate_proj.qweight`` ...): each expert's linear is read as above, and the experts are stacked into the
moe op's W4A16 or FP8 layout the way transformers stacks float experts (:func:`import_experts`; the names are mapped
with transformers' own loading rules by ``builder/checkpoint.py``): 4-bit weight-only experts, FP8 ones per channel
or tensor with dynamic per-token inputs, and fine-grained (block) FP8 ones.

Act-order (a g_idx that is not k // group_size): the IR's groups are contiguous along K, so input channels are
sorted by group (``perm``, stable) and the linear reads ``x[:, perm]`` (its ``perm`` weight role).

Static int8 codes are x / input_scale in fp32 (an IEEE division) rounded half to even: ModelOpt's own fake
quantization multiplies by 127 / amax instead (``_tensor_quant``: round(x * (127 / amax))), which can differ from
x / (amax / 127) in the last bit, so a value within an ulp of a rounding boundary may take the neighbouring code; the
exported input_scale is what a deployment divides by.

Refused, naming the setting: ModelOpt's fp8_pb_wo (block FP8 weights with unquantized activations: no IR scheme
keeps them in the model dtype), W4A8_AWQ (int4 weights with fp8 activations: no IR scheme), NVFP4 and NVFP4_AWQ in a
mixed-precision export (no FP4 scheme; an export of either alone is decoded to float weights as it is read,
``builder.checkpoint._nvfp4_weights``), a W4A16_AWQ with zero points or without its group_size, and experts that
carry a pre_quant_scale (the moe op has no input scale); fine-grained FP8 with static activations, ue8m0 scales or
per-tensor scales (weight_block_size null). Refused, naming the tensor: a linear's weight scales (any format) that
are all zero (the whole linear would dequantize to zeros); a few zero scales (pruned channels or groups) and negative
scales (AutoRound's signed symmetric groups) import.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kernels.torch_quant import dequantize_weight, dequantize_weight_fp8_blocks
from passes.ir import block_size_ok
from passes.quant_math import pack_int4
from runtime.manifest import MAX_SCALE_BLOCK


class PrequantizedError(ValueError):
    """A quantization config or tensor the import cannot read; ``builder/checkpoint.py`` raises it as a
    CheckpointError (this module is below it: it reads only what the checkpoint hands it)."""


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ gemm: nibble i of a word holds column 8 * word + AWQ_ORDER[i]
SUPPORTED = ("gptq, awq (version gemm), compressed-tensors (pack-quantized, float-quantized, int-quantized), fp8 "
             "(fine-grained, weight_block_size), modelopt (FP8, FP8_PER_CHANNEL_PER_TOKEN, W8A16, W4A16_AWQ, "
             "W8A8_SQ_PER_CHANNEL)")
# What a recipe quantization section must say to agree with an import: algo -> the IR schemes it writes.
ALGO_SCHEMES = {"gptq": ("w4a16", "w8a16"), "awq": ("w4a16",), "int8_wo": ("w8a16",), "fp8": ("fp8", "fp8_block"),
                "smoothquant": ("w8a8_int8",)}


@dataclass
class ImportedLinear:
    """One checkpoint linear in an IR scheme, and the weight the checkpoint's own format dequantizes it to."""

    scheme: str  # an IR quant scheme (passes/ir.py QUANT_SCHEMES)
    tensors: dict[str, Tensor]  # IR role -> tensor (qweight, scales, zeros, perm / qweight, weight_scale, ...)
    quant: dict[str, Any]  # the node's `quant` attr, less its scheme
    reference: Tensor | None  # [out, in]: the format's own dequantization of the checkpoint's tensors (fp32, then
    # the build's dtype once checked against the IR's; None once handed to the reference model)
    consumed: list[str]  # the checkpoint tensors read


def _fail(cfg_file: Path | str, what: str) -> PrequantizedError:
    return PrequantizedError(f"{cfg_file}: {what}")


def _unpack(packed: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words holding 32 / bits codes each, the first code in the low bits -> the codes (int32), the
    packed dimension ``dim`` grown by 32 / bits."""
    per_word = 32 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per_word)]  # each: packed's shape
    stacked = torch.stack(parts, dim=dim + 1)  # [..., words, per_word, ...]
    shape = list(packed.shape)
    shape[dim] *= per_word
    return stacked.reshape(shape)


def _check(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], why: str) -> None:
    """A one-line error naming the tensor, what it is and what the format expects."""
    if t.dtype not in dtypes or tuple(t.shape) != shape:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise PrequantizedError(f"tensor {name!r} is {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}; "
                              f"expected {want} {shape} ({why})")


FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check_scales(name: str, scales: Tensor) -> None:
    """A linear's weight scales (of its groups, channels or blocks): not every one zero, which would dequantize the
    whole linear to zeros (an export that lost its scales). A few zeros stay allowed: a pruned channel or group,
    whose weights are all zero. Negative scales are allowed: dequantization is ``scale * (q - zero)`` whatever the
    sign, and some exporters sign them on purpose (AutoRound's full-range symmetric groups, written as GPTQ or
    compressed-tensors checkpoints, carry about half their scales negative). NaN and infinity are check_finite's."""
    values = scales.float()
    if values.numel() and not bool(values.ne(0).any()):
        raise PrequantizedError(f"tensor {name!r}: every one of its {values.numel()} scales is 0, which dequantizes "
                                f"every weight of the linear to 0; expected positive scales (a few zeros, pruned "
                                f"channels, are allowed): the checkpoint is corrupt, download it again")


def _groups(in_f: int, group_size: int, where: str) -> int:
    if group_size == -1:
        return 1
    if group_size < 1 or in_f % group_size:
        raise PrequantizedError(f"{where}: group_size {group_size} does not divide in_features {in_f}")
    return in_f // group_size


def _check_group_ids(g_idx: Tensor, num_groups: int, name: str) -> None:
    """A g_idx names groups 0..num_groups - 1 only (checked before anything is indexed with it)."""
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
        raise PrequantizedError(f"tensor {name!r} holds group ids {int(g_idx.min())}..{int(g_idx.max())}; "
                              f"expected 0..{num_groups - 1}")


def _contiguous_groups(g_idx: Tensor, num_groups: int, group_size: int, name: str) -> Tensor | None:
    """The permutation of input channels that makes a g_idx's groups contiguous; None when they already are.
    Every group must hold group_size channels (what GPTQ's act-order writes)."""
    in_f = g_idx.numel()
    _check_group_ids(g_idx, num_groups, name)
    size = in_f if group_size == -1 else group_size
    if torch.equal(g_idx.long(), torch.arange(in_f) // size):
        return None
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    if not bool((counts == size).all()):
        raise PrequantizedError(f"tensor {name!r} puts {int(counts.min())}..{int(counts.max())} input channels in a "
                              f"group; act-order is imported when every group holds group_size {size}")
    return torch.sort(g_idx.long(), stable=True).indices.to(torch.int32)


def _weight_only(codes_nk: Tensor, zeros_ng: Tensor, scales_ng: Tensor, bits: int, group_size: int,
                 perm: Tensor | None, source: str, where: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """IR w4a16 / w8a16 tensors from codes [N, K] (the checkpoint's channel order), zeros and scales [N, G]."""
    if int(zeros_ng.max()) > 255:
        raise PrequantizedError(f"{where}: a zero point of {int(zeros_ng.max())} does not fit the IR's 8-bit zeros")
    if perm is not None:
        codes_nk = codes_nk[:, perm.long()]
    codes = codes_nk.to(torch.uint8)
    tensors = {"qweight": pack_int4(codes) if bits == 4 else codes.contiguous(),
               "scales": scales_ng.float().contiguous(), "zeros": zeros_ng.to(torch.uint8).contiguous()}
    if perm is not None:
        tensors["perm"] = perm
    quant = {"bits": bits, "group_size": group_size, "source": source}
    if perm is not None:
        quant["act_order"] = True
    return tensors, quant


def ir_dequantize(imported: ImportedLinear, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight [out, in] the IR's tensors stand for (``kernels/torch_quant.py``), in the checkpoint's channel
    order (a ``perm`` undone)."""
    t, q = imported.tensors, imported.quant
    if imported.scheme in ("w4a16", "w8a16"):
        w = dequantize_weight(t["qweight"], t["scales"], t["zeros"], q["bits"], q["group_size"], torch.float32)
    elif imported.scheme == "fp8_block":
        w = dequantize_weight_fp8_blocks(t["qweight"], t["weight_scale"], q["block_size"])
    else:
        w = t["qweight"].float() * t["weight_scale"].float().reshape(-1, 1)
    if "perm" in t:
        out = torch.empty_like(w)
        out[:, t["perm"].long()] = w
        w = out
    return w.to(dtype)


# --- formats ----------------------------------------------------------------------------------------
@dataclass
class QuantFormat:
    """A checkpoint's quantization as config.json's ``quantization_config`` describes it."""

    source: str  # gptq, awq, compressed-tensors
    cfg_file: Path
    section: dict[str, Any]
    bits: int = 0
    group_size: int = -1
    scheme: str = ""  # the IR scheme most linears get (a compressed-tensors config may mix)
    details: dict[str, Any] = field(default_factory=dict)  # for the manifest

    def tensor_names(self, module: str) -> tuple[list[str], list[str]] | None:
        """(required, optional) checkpoint tensors of ``module``'s quantized weight (its bias aside); None when the
        config leaves the module in floating point. Formats that name no modules (GPTQ, AWQ) answer for every
        module: one is quantized when its required tensors are in the checkpoint."""
        raise NotImplementedError

    names_modules = False  # True: the config, not the tensors present, says which modules are quantized

    def read(self, module: str, tensors: dict[str, Tensor], in_f: int, out_f: int) -> ImportedLinear:
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        return {"source": self.source, "scheme": self.scheme, "bits": self.bits, "group_size": self.group_size,
                **self.details}


def _int(section: dict, key: str, cfg_file: Path, allowed: tuple[int, ...] | None = None, default=None) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (allowed is not None and value not in allowed):
        what = f"one of {', '.join(map(str, allowed))}" if allowed else "a whole number"
        raise _fail(cfg_file, f"quantization_config.{key} is {json.dumps(value)}; expected {what}")
    return value


def _group_size(section: dict, key: str, cfg_file: Path) -> int:
    g = _int(section, key, cfg_file, default=-1)
    if g != -1 and g < 1:
        raise _fail(cfg_file, f"quantization_config.{key} is {g}; expected -1 (per channel) or a positive size")
    return g


class GPTQ(QuantFormat):
    """AutoGPTQ / GPTQModel / optimum: ``quant_method: gptq``."""

    def __init__(self, cfg_file: Path, section: dict) -> None:
        super().__init__("gptq", cfg_file, section)
        self.bits = _int(section, "bits", cfg_file, (4, 8))
        self.group_size = _group_size(section, "group_size", cfg_file)
        fmt = section.get("checkpoint_format", section.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise _fail(cfg_file, f"quantization_config.checkpoint_format is {json.dumps(fmt)}; imported: gptq (v1: "
                                  f"zero points stored minus one) and gptq_v2 (the others, e.g. marlin, are not)")
        if section.get("dynamic"):
            raise _fail(cfg_file, "quantization_config.dynamic sets per-module bits or group sizes, which the import "
                                  "does not read; requantize with one setting for every module")
        self.v1 = fmt == "gptq"
        self.scheme = "w4a16" if self.bits == 4 else "w8a16"
        self.details = {"checkpoint_format": fmt, "desc_act": bool(section.get("desc_act", False)),
                        "sym": bool(section.get("sym", True))}

    def tensor_names(self, module: str) -> tuple[list[str], list[str]] | None:
        return [f"{module}.{r}" for r in ("qweight", "qzeros", "scales")], [f"{module}.g_idx"]

    def read(self, module: str, tensors: dict[str, Tensor], in_f: int, out_f: int) -> ImportedLinear:
        bits, per_word = self.bits, 32 // self.bits
        num_groups = _groups(in_f, self.group_size, module)
        if in_f % per_word or out_f % per_word:
            raise PrequantizedError(f"{module}: {in_f} x {out_f} is not a multiple of {per_word} codes per int32 word")
        names = {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales", "g_idx")}
        qweight, qzeros, scales = (tensors[names[r]] for r in ("qweight", "qzeros", "scales"))
        _check(names["qweight"], qweight, (torch.int32,), (in_f // per_word, out_f),
               f"{bits}-bit codes packed along in_features {in_f}")
        _check(names["qzeros"], qzeros, (torch.int32,), (num_groups, out_f // per_word),
               f"{bits}-bit zero points of {num_groups} groups packed along out_features {out_f}")
        _check(names["scales"], scales, FLOATS, (num_groups, out_f), f"{num_groups} groups of {out_f} scales")
        _check_scales(names["scales"], scales)
        g_idx = tensors.get(names["g_idx"])
        if g_idx is None:
            g_idx = torch.arange(in_f, dtype=torch.int32) // (in_f if self.group_size == -1 else self.group_size)
        _check(names["g_idx"], g_idx, (torch.int32, torch.int64), (in_f,), "the group of each input channel")
        _check_group_ids(g_idx, num_groups, names["g_idx"])
        codes = _unpack(qweight, bits, 0)  # [K, N]
        zeros = _unpack(qzeros, bits, 1) + (1 if self.v1 else 0)  # [G, N]; v1 stores zero - 1
        # the format's dequantization: w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
        g = g_idx.long()
        reference = ((codes - zeros[g]).float() * scales.float()[g]).t().contiguous()  # [N, K]
        perm = _contiguous_groups(g_idx, num_groups, self.group_size, names["g_idx"])
        ir, quant = _weight_only(codes.t(), zeros.t(), scales.t(), bits, self.group_size, perm, "gptq", module)
        return ImportedLinear(self.scheme, ir, quant, reference, [n for n in names.values() if n in tensors])


class AWQ(QuantFormat):
    """AutoAWQ's GEMM layout: ``quant_method: awq``, ``version: gemm``."""

    def __init__(self, cfg_file: Path, section: dict) -> None:
        super().__init__("awq", cfg_file, section)
        self.bits = _int(section, "bits", cfg_file, (4,), default=section.get("w_bit", 4))
        self.group_size = _group_size(section, "group_size", cfg_file) if "group_size" in section else \
            _group_size(section, "q_group_size", cfg_file)
        version = str(section.get("version", "gemm")).lower()
        if version != "gemm":
            raise _fail(cfg_file, f"quantization_config.version is {json.dumps(section.get('version'))}; imported: "
                                  f"gemm (the gemv, gemv_fast, marlin and exllama layouts are not)")
        if section.get("zero_point", True) is not True:
            raise _fail(cfg_file, "quantization_config.zero_point is false; imported: AWQ with zero points (true)")
        self.scheme = "w4a16"
        self.details = {"version": "gemm"}

    def tensor_names(self, module: str) -> tuple[list[str], list[str]] | None:
        return [f"{module}.{r}" for r in ("qweight", "qzeros", "scales")], []

    def read(self, module: str, tensors: dict[str, Tensor], in_f: int, out_f: int) -> ImportedLinear:
        num_groups = _groups(in_f, self.group_size, module)
        if out_f % 8:
            raise PrequantizedError(f"{module}: out_features {out_f} is not a multiple of 8 codes per int32 word")
        names = {r: f"{module}.{r}" for r in ("qweight", "qzeros", "scales")}
        qweight, qzeros, scales = (tensors[names[r]] for r in ("qweight", "qzeros", "scales"))
        _check(names["qweight"], qweight, (torch.int32,), (in_f, out_f // 8), "4-bit codes packed along out_features")
        _check(names["qzeros"], qzeros, (torch.int32,), (num_groups, out_f // 8),
               f"4-bit zero points of {num_groups} groups packed along out_features")
        _check(names["scales"], scales, FLOATS, (num_groups, out_f), f"{num_groups} groups of {out_f} scales")
        _check_scales(names["scales"], scales)
        order = torch.tensor(AWQ_ORDER).argsort()  # output column 8 * word + j sits in nibble order[j]
        codes = _unpack(qweight, 4, 1).view(in_f, out_f // 8, 8)[:, :, order].reshape(in_f, out_f)  # [K, N]
        zeros = _unpack(qzeros, 4, 1).view(num_groups, out_f // 8, 8)[:, :, order].reshape(num_groups, out_f)
        size = in_f if self.group_size == -1 else self.group_size
        g = torch.arange(in_f) // size
        reference = ((codes - zeros[g]).float() * scales.float()[g]).t().contiguous()  # [N, K]
        ir, quant = _weight_only(codes.t(), zeros.t(), scales.t(), 4, self.group_size, None, "awq", module)
        return ImportedLinear(self.scheme, ir, quant, reference, list(names.values()))


@dataclass
class _CTScheme:
    """One compressed-tensors config group: the modules it targets and how their weights are stored."""

    name: str
    targets: list[str]
    weights: dict[str, Any]
    inputs: dict[str, Any] | None
    fmt: str  # pack-quantized, float-quantized, int-quantized


class CompressedTensors(QuantFormat):
    """llm-compressor's ``quant_method: compressed-tensors`` (``quantization_status: compressed``)."""

    FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")

    def __init__(self, cfg_file: Path, section: dict, key: str = "quantization_config") -> None:
        super().__init__("compressed-tensors", cfg_file, section)
        self.key = key  # compression_config in older exports
        status = section.get("quantization_status", "compressed")
        if status != "compressed":
            raise _fail(cfg_file, f"{key}.quantization_status is {json.dumps(status)}; imported: compressed (saved "
                                  f"by llm-compressor with save_compressed=True)")
        groups = section.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _fail(cfg_file, f"{key}.config_groups is missing or empty; expected the groups of modules and "
                                  f"their weight / input_activations settings")
        self.ignore = _patterns(cfg_file, section, "ignore", f"{key}.ignore", "re:")
        self.schemes = [self._scheme(name, g, section.get("format")) for name, g in groups.items()]
        first = self.schemes[0]
        self.bits = int(first.weights.get("num_bits", 0))
        self.group_size = int(first.weights.get("group_size") or -1)
        self.scheme = self._ir_scheme(first)
        self.details = {"format": sorted({s.fmt for s in self.schemes}),
                        "config_groups": {s.name: self._ir_scheme(s) for s in self.schemes}}

    def _scheme(self, name: str, group: Any, default_fmt: Any) -> _CTScheme:
        where = f"{self.key}.config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise _fail(self.cfg_file, f"{where} has no weights settings; expected num_bits, type, strategy, ...")
        fmt = group.get("format") or default_fmt
        if fmt not in self.FORMATS:
            raise _fail(self.cfg_file, f"{where}: format {json.dumps(fmt)} is not imported; imported: "
                                       f"{', '.join(self.FORMATS[:3])}")
        w, a = group["weights"], group.get("input_activations")
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if kind == "int" and fmt == "pack-quantized":
            ok = bits in (4, 8) and strategy in ("group", "channel") and a is None
            want = "4 or 8-bit int weights per group or channel, no activation quantization (W4A16 / W8A16)"
        elif kind == "float" and fmt == "float-quantized":
            ok = bits == 8 and strategy in ("tensor", "channel") and w.get("symmetric", True) and _fp8_inputs(a)
            want = ("fp8 weights per tensor or channel with fp8 activations, dynamic per token or static per tensor "
                    "(block-scaled fp8 has no IR scheme)")
        elif kind == "int" and fmt in ("int-quantized", "naive-quantized"):
            ok = bits == 8 and strategy == "channel" and w.get("symmetric", True) and _int8_inputs(a)
            want = ("symmetric int8 weights per channel, activations none or symmetric int8 dynamic per token or "
                    "static per tensor")
        else:
            ok, want = False, "int weights in pack-quantized or int-quantized, float weights in float-quantized"
        if not ok:
            shown = {k: w.get(k) for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}
            inputs = None if a is None else {k: a.get(k) for k in ("num_bits", "type", "strategy", "dynamic",
                                                                   "symmetric")}
            raise _fail(self.cfg_file, f"{where} ({fmt}) has weights {json.dumps(shown)}, input_activations "
                                       f"{json.dumps(inputs)}; imported: {want}")
        if strategy == "group" and not (isinstance(w.get("group_size"), int) and w["group_size"] > 0):
            raise _fail(self.cfg_file, f"{where}: strategy group needs a positive group_size, got "
                                       f"{json.dumps(w.get('group_size'))}")
        return _CTScheme(name, _patterns(self.cfg_file, group, "targets", f"{where}.targets", "re:"), w, a, fmt)

    @staticmethod
    def _ir_scheme(s: _CTScheme) -> str:
        if s.fmt == "pack-quantized":
            return "w4a16" if s.weights["num_bits"] == 4 else "w8a16"
        if s.fmt == "float-quantized":
            return "fp8"
        return "w8a16" if s.inputs is None else "w8a8_int8"

    def _scheme_of(self, module: str) -> _CTScheme | None:
        if _ct_matches(self.ignore, module):
            return None
        return next((s for s in self.schemes if _ct_matches(s.targets, module)), None)

    names_modules = True

    def tensor_names(self, module: str) -> tuple[list[str], list[str]] | None:
        s = self._scheme_of(module)
        if s is None:
            return None
        if s.fmt == "pack-quantized":
            required, optional = ("weight_packed", "weight_scale"), ("weight_zero_point", "weight_g_idx",
                                                                      "weight_shape")
        else:
            required, optional = ("weight", "weight_scale"), ("input_scale", "weight_zero_point", "input_zero_point")
        return [f"{module}.{r}" for r in required], [f"{module}.{r}" for r in optional]

    def read(self, module: str, tensors: dict[str, Tensor], in_f: int, out_f: int) -> ImportedLinear:
        s = self._scheme_of(module)
        assert s is not None, f"{module} is not targeted by a config group"
        if s.fmt == "pack-quantized":
            return self._read_packed(module, s, tensors, in_f, out_f)
        return self._read_8bit(module, s, tensors, in_f, out_f)

    def _read_packed(self, module: str, s: _CTScheme, tensors: dict[str, Tensor], in_f: int,
                     out_f: int) -> ImportedLinear:
        bits = s.weights["num_bits"]
        per_word, offset = 32 // bits, 1 << (bits - 1)
        group_size = s.weights["group_size"] if s.weights["strategy"] == "group" else -1
        num_groups = _groups(in_f, group_size, module)
        names = {r: f"{module}.{r}" for r in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                                               "weight_shape")}
        packed, scale = tensors[names["weight_packed"]], tensors[names["weight_scale"]]
        words = -(-in_f // per_word)
        _check(names["weight_packed"], packed, (torch.int32,), (out_f, words), f"{bits}-bit codes packed along "
               f"in_features {in_f}")
        _check(names["weight_scale"], scale, FLOATS, (out_f, num_groups), f"{num_groups} scales per output row")
        _check_scales(names["weight_scale"], scale)
        shape = tensors.get(names["weight_shape"])
        if shape is not None and [int(v) for v in shape.reshape(-1)] != [out_f, in_f]:
            raise PrequantizedError(f"tensor {names['weight_shape']!r} is {shape.tolist()}; expected [{out_f}, {in_f}] "
                                  f"(the linear's [out_features, in_features])")
        codes = _unpack(packed, bits, 1)[:, :in_f]  # [N, K] unsigned: signed code + 2^(b-1)
        if s.weights.get("symmetric", True):
            zeros = torch.full((out_f, num_groups), offset, dtype=torch.int32)  # signed zero point 0
        else:
            zp = tensors.get(names["weight_zero_point"])
            if zp is None:
                raise PrequantizedError(f"tensor {names['weight_zero_point']!r} is missing; an asymmetric "
                                      f"pack-quantized linear stores its zero points ({-(-out_f // per_word)} x "
                                      f"{num_groups} int32)")
            _check(names["weight_zero_point"], zp, (torch.int32,), (-(-out_f // per_word), num_groups),
                   f"{bits}-bit zero points packed along out_features {out_f}")
            zeros = _unpack(zp, bits, 0)[:out_f]  # [N, G] unsigned, same offset as the codes
        g_idx = tensors.get(names["weight_g_idx"])
        if g_idx is not None:
            _check(names["weight_g_idx"], g_idx, (torch.int32, torch.int64), (in_f,),
                   "the group of each input channel")
            _check_group_ids(g_idx, num_groups, names["weight_g_idx"])
        g = g_idx.long() if g_idx is not None else torch.arange(in_f) // (in_f if group_size == -1 else group_size)
        # the format's dequantization: w = (q_signed - zp_signed) * scale, the group of column k being g[k]
        reference = ((codes - offset) - (zeros[:, g] - offset)).float() * scale.float()[:, g]
        perm = _contiguous_groups(g_idx, num_groups, group_size, names["weight_g_idx"]) if g_idx is not None else None
        ir, quant = _weight_only(codes, zeros, scale, bits, group_size, perm, "compressed-tensors", module)
        return ImportedLinear(self._ir_scheme(s), ir, quant, reference, [n for n in names.values() if n in tensors])

    def _read_8bit(self, module: str, s: _CTScheme, tensors: dict[str, Tensor], in_f: int,
                   out_f: int) -> ImportedLinear:
        zero_points = [f"{module}.{r}" for r in ("weight_zero_point", "input_zero_point")]
        for zp in (n for n in zero_points if n in tensors):
            if bool(tensors[zp].ne(0).any()):
                raise PrequantizedError(f"tensor {zp!r} holds non-zero zero points; imported: symmetric weights and "
                                      f"activations")
        static = s.inputs is not None and not s.inputs.get("dynamic", False)
        lin = _read_8bit(module, tensors, in_f, out_f, self._ir_scheme(s), s.weights["strategy"] == "channel",
                         static, "compressed-tensors", f"config group {s.name}")
        lin.consumed += [n for n in zero_points if n in tensors]
        return lin


def _read_8bit(module: str, tensors: dict[str, Tensor], in_f: int, out_f: int, ir_scheme: str, per_channel: bool,
               static: bool, source: str, where: str) -> ImportedLinear:
    """A linear stored as 8-bit codes ``weight`` [N, K] (e4m3 for fp8, int8 otherwise) with ``weight_scale`` per
    tensor or output channel and, with static activations, one ``input_scale``: IR fp8 / w8a8_int8, or w8a16 (int8
    weights only: the unsigned layout, zero point 128). ``where`` names what asks for static activations.

    Static int8 activations take the full int8 range in both formats that store them: compressed-tensors quantizes
    round(clamp(x / input_scale, q_min, q_max)) with q_min, q_max = -128, 127 for 8-bit ints (``calculate_range``,
    its scales amax / 127.5, so that -amax itself is code -128), ModelOpt's W8A8_SQ_PER_CHANNEL clamps
    round(x * 127 / amax) to -128..127 (its input quantizer's narrow_range is false): the IR linear's
    ``act_qmin`` -128, not the SmoothQuant pass's -127."""
    names = {r: f"{module}.{r}" for r in ("weight", "weight_scale", "input_scale")}
    fp8 = ir_scheme == "fp8"
    weight, scale = tensors[names["weight"]], tensors[names["weight_scale"]]
    _check(names["weight"], weight, (torch.float8_e4m3fn,) if fp8 else (torch.int8,), (out_f, in_f),
           "the linear's codes [out_features, in_features]")
    shapes = [(out_f, 1), (out_f,)] if per_channel else [(1,), (), (1, 1)]
    if scale.dtype not in FLOATS or tuple(scale.shape) not in shapes:
        raise PrequantizedError(f"tensor {names['weight_scale']!r} is {str(scale.dtype).removeprefix('torch.')} "
                              f"{tuple(scale.shape)}; expected a float tensor of shape {shapes[0]} (one scale "
                              f"{'per output channel' if per_channel else 'for the whole tensor'})")
    _check_scales(names["weight_scale"], scale)
    w_scale = scale.float().reshape(-1)
    reference = weight.float() * w_scale.reshape(-1, 1)  # the format's dequantization: q * scale
    input_scale = tensors.get(names["input_scale"])
    if static and input_scale is None:
        raise PrequantizedError(f"tensor {names['input_scale']!r} is missing; {where} quantizes activations with a "
                              f"static per-tensor scale")
    if ir_scheme == "w8a16":  # int8 weights only: the unsigned w8a16 layout, zero point 128
        tensors_ir = {"qweight": (weight.to(torch.int16) + 128).to(torch.uint8),
                      "scales": w_scale.reshape(out_f, 1).contiguous(),
                      "zeros": torch.full((out_f, 1), 128, dtype=torch.uint8)}
        quant = {"bits": 8, "group_size": -1, "source": source}
    else:
        tensors_ir = {"qweight": weight.contiguous(), "weight_scale": w_scale.contiguous()}
        quant = {"activations": "static" if static else "dynamic", "source": source}
        if fp8:
            quant["weight_granularity"] = "channel" if per_channel else "tensor"
        if static:
            _check(names["input_scale"], input_scale.reshape(-1), FLOATS, (1,), "one activation scale")
            if not (bool(torch.isfinite(input_scale).all()) and float(input_scale.reshape(-1)[0]) > 0):
                raise PrequantizedError(f"tensor {names['input_scale']!r} is {float(input_scale.reshape(-1)[0])}; "
                                        f"expected a positive finite activation scale")
            tensors_ir["input_scale"] = input_scale.float().reshape(1)
            if ir_scheme == "w8a8_int8":  # codes -128..127 (the docstring); the IR's default stops at -127
                quant["act_qmin"] = -128
    return ImportedLinear(ir_scheme, tensors_ir, quant, reference, [n for n in names.values() if n in tensors])


def _read_pre_quant_scale(name: str, tensors: dict[str, Tensor], in_f: int, ir: dict[str, Tensor],
                          why: str) -> None:
    """A ModelOpt linear's ``pre_quant_scale`` [in] (its input quantizer's per-input-channel scale s, the model's
    dtype; ``why`` whose), where the export kept one: the IR's pre_quant_scale role, in fp32 (exact). Its values as
    the runtime allows them at load (runtime/executor.py ``_check_input_tensors``): finite (one inf or nan makes every
    output of the linear inf or nan) and not all 0 (the linear's whole input zeroed), so that a build fails here
    instead of writing an artifact the runtime refuses. A few zeros (dropped input channels) and negative values stay
    allowed: W (x * s) with the codes made for s is exact whatever its sign (signed exports, AutoRound-style)."""
    pqs = tensors.get(name)
    if pqs is None:
        return
    _check(name, pqs, FLOATS, (in_f,), f"one scale per input feature of the {in_f}: the linear computes "
                                       f"W (x * pre_quant_scale)")
    values = pqs.float()
    allowed = f"expected finite scales, not all 0 ({why}; a few zeros and negative values are allowed)"
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        at = int(torch.nonzero(~finite)[0, 0])
        raise PrequantizedError(f"tensor {name!r} holds {float(values[at])} (input feature {at}); {allowed}")
    if values.numel() and not bool(values.ne(0).any()):
        raise PrequantizedError(f"tensor {name!r} is 0 in all {values.numel()} values, which zeroes the linear's "
                                f"whole input; {allowed}")
    ir["pre_quant_scale"] = values.contiguous()


def _fp8_inputs(a: dict | None) -> bool:
    return a is not None and a.get("num_bits") == 8 and a.get("type") == "float" and a.get("symmetric", True) \
        and ((a.get("strategy") == "token" and a.get("dynamic") is True)
             or (a.get("strategy") == "tensor" and not a.get("dynamic")))


def _int8_inputs(a: dict | None) -> bool:
    return a is None or (a.get("num_bits") == 8 and a.get("type", "int") == "int" and a.get("symmetric", True)
                         and ((a.get("strategy") == "token" and a.get("dynamic") is True)
                              or (a.get("strategy") == "tensor" and not a.get("dynamic"))))


def _patterns(cfg_file: Path, section: dict, key: str, where: str, regex: str = "") -> list[str]:
    """``section[key]``: a list of module names / patterns (absent or null: none), each a non-empty string;
    ``regex``: the prefix that makes an entry a regular expression (``re:``), checked to compile. ``where`` names the
    key in errors."""
    value = section.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(cfg_file, f"{where} is {json.dumps(value)[:80]}; expected a list of module names or patterns")
    for i, p in enumerate(value):
        if not isinstance(p, str) or not p:
            raise _fail(cfg_file, f"{where}[{i}] is {json.dumps(p)[:80]}; expected a module name or pattern (a "
                                  f"non-empty string)")
        if regex and p.startswith(regex):
            try:
                re.compile(p[len(regex):])
            except re.error as e:
                raise _fail(cfg_file, f"{where}[{i}] {json.dumps(p)[:80]} is not a valid regular expression ({e})") \
                    from None
    return list(value)


def _ct_matches(patterns: list[str], module: str) -> bool:
    """compressed-tensors targets / ignore: a module path, ``re:`` and a regex (matched from the start), or a
    class name (every module here is a Linear)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == "Linear" or p == module:
            return True
    return False


class FineGrainedFP8(QuantFormat):
    """transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8): ``quant_method: fp8`` with ``weight_block_size``;
    every linear but the lm_head and ``modules_to_not_convert`` holds e4m3 codes and block scales."""

    SETTINGS = {  # key -> (the value imported, what else means)
        "activation_scheme": ("dynamic", "a static activation_scale per linear is not imported"),
        "scale_fmt": ("float", "ue8m0 (power-of-two) scales are not imported"),
        "fmt": ("e4m3", "e5m2 codes are not imported"),
    }

    def __init__(self, cfg_file: Path, section: dict) -> None:
        super().__init__("fp8", cfg_file, section)
        block = section.get("weight_block_size")
        block = list(block) if isinstance(block, (list, tuple)) else block
        if not block_size_ok(block):
            raise _fail(cfg_file, f"quantization_config.weight_block_size is {json.dumps(block)}; imported: [rows, "
                                  f"columns] of integers in 1..{MAX_SCALE_BLOCK}, e.g. [128, 128] (per-tensor FP8, "
                                  f"null, is not)")
        for key, (want, other) in self.SETTINGS.items():
            value = section.get(key)
            value = want if value is None else value  # absent or null: the default; false or "" are not it
            if str(value).lower() != want:
                raise _fail(cfg_file, f"quantization_config.{key} is {json.dumps(value)}; imported: {want} ({other})")
        self.block_size = block
        # the checkpoint's own list, and the lm_head, which transformers adds to it
        self.not_converted = ["lm_head", *_patterns(cfg_file, section, "modules_to_not_convert",
                                                    "quantization_config.modules_to_not_convert")]
        self.bits, self.group_size, self.scheme = 8, block[1], "fp8_block"
        self.details = {"weight_block_size": block, "activations": "dynamic", "weight_granularity": "block"}

    names_modules = True

    def tensor_names(self, module: str) -> tuple[list[str], list[str]] | None:
        if _hf_not_converted(self.not_converted, module):
            return None
        return [f"{module}.weight", f"{module}.weight_scale_inv"], []

    def read(self, module: str, tensors: dict[str, Tensor], in_f: int, out_f: int) -> ImportedLinear:
        (bn, bk), names = self.block_size, {r: f"{module}.{r}" for r in ("weight", "weight_scale_inv")}
        weight, scale = tensors[names["weight"]], tensors[names["weight_scale_inv"]]
        _check(names["weight"], weight, (torch.float8_e4m3fn,), (out_f, in_f),
               "the linear's codes [out_features, in_features]")
        blocks = (-(-out_f // bn), -(-in_f // bk))
        _check(names["weight_scale_inv"], scale, FLOATS, blocks,
               f"one scale per {bn} x {bk} block of the {out_f} x {in_f} weight, partial blocks included")
        _check_scales(names["weight_scale_inv"], scale)
        # the format's dequantization: w[n, k] = q[n, k] * weight_scale_inv[n // bn, k // bk]
        rows, cols = torch.arange(out_f) // bn, torch.arange(in_f) // bk
        reference = weight.float() * scale.float()[rows][:, cols]
        ir = {"qweight": weight.contiguous(), "weight_scale": scale.float().contiguous()}
        quant = {"block_size": list(self.block_size), "activations": "dynamic", "source": "fp8"}
        return ImportedLinear("fp8_block", ir, quant, reference, list(names.values()))


def _hf_not_converted(patterns: list[str], module: str) -> bool:
    """transformers' ``modules_to_not_convert``: a pattern names a module and what it holds, matched from the start
    to a module boundary (as a regex) or as a suffix at one."""
    for p in patterns:
        if module == p or module.endswith(f".{p}"):
            return True
        try:
            if re.match(rf"(?:{p})(?:\.|$)", module):
                return True
        except re.error:  # not a regex: a plain name, matched above
            pass
    return False


MODELOPT_ALGOS = {  # ModelOpt's quant_algo -> (IR scheme, weight scale per channel (else per tensor), static inputs)
    "FP8": ("fp8", False, True),
    "FP8_PER_CHANNEL_PER_TOKEN": ("fp8", True, False),
    "W8A16": ("w8a16", True, False),
    "W4A16_AWQ": ("w4a16", False, False),  # scales per group of group_size inputs (:meth:`ModelOpt._read_int4`)
    "W8A8_SQ_PER_CHANNEL": ("w8a8_int8", True, True),  # static int8 inputs -128..127, a pre_quant_scale per linear
}
PRE_QUANT_SCALED = ("w4a16", "w8a8_int8")  # the IR schemes of the algorithms whose linears may keep a pre_quant_scale
MODELOPT_REFUSED = {  # why other algorithms are not imported
    "FP8_PB_WO": "FP8 weights in blocks with unquantized activations; the IR's fp8_block quantizes its activations",
    "W4A8_AWQ": "int4 weights with a second, fp8 scale and static fp8 activations (an int4 x fp8 matmul) have no IR "
                "scheme",
    "NVFP4": "FP4 (e2m1) weights with fp8 scales per 16 have no IR scheme (an export of NVFP4 alone is decoded to "
             "float weights; here it is one of a mixed-precision export's)",
    "NVFP4_AWQ": "FP4 (e2m1) weights with fp8 scales per 16 have no IR scheme (an export of NVFP4_AWQ alone is "
                 "decoded to float weights; here it is one of a mixed-precision export's)",
}


class ModelOpt(QuantFormat):
    """NVIDIA TensorRT Model Optimizer's ``export_hf_checkpoint``: ``hf_quant_config.json`` beside config.json (read
    first: exports before ModelOpt 0.29 have only it, later ones also a flat ``quantization_config`` with
    ``quant_method: modelopt``). ``quant_algo`` for every linear not in ``exclude_modules`` (fnmatch patterns), or
    MIXED_PRECISION with one per module in ``quantized_layers`` (each with its own group_size where it has one)."""

    def __init__(self, cfg_file: Path, section: dict) -> None:
        super().__init__("modelopt", cfg_file, section)
        q = section.get("quantization", section)  # hf_quant_config.json nests it; config.json's is flat
        self.where = "quantization" if "quantization" in section else "quantization_config"
        if not isinstance(q, dict):
            raise _fail(cfg_file, f"quantization is {json.dumps(q)[:80]}; expected an object with quant_algo")
        key = "exclude_modules" if "exclude_modules" in q else "ignore"
        self.exclude = _patterns(cfg_file, q, key, f"{self.where}.{key}")
        kv = q.get("kv_cache_quant_algo", q.get("kv_cache_scheme"))
        if isinstance(kv, dict):  # config.json's form of FP8: {"num_bits": 8, "type": "float", ...}
            kv = "FP8" if kv.get("num_bits") == 8 and kv.get("type") == "float" else json.dumps(kv)
        if kv not in (None, "FP8"):
            raise _fail(cfg_file, f"{self.where}.kv_cache_quant_algo is {json.dumps(kv)}; imported: FP8 (its "
                                  f"k_scale / v_scale are read) or none")
        self.kv_algo = kv
        algo = q.get("quant_algo")
        if algo is None:
            raise _fail(cfg_file, f"{self.where}.quant_algo is null: the linears are not quantized (an export of the "
                                  f"KV cache alone, whose k_scale / v_scale are not imported); build from the "
                                  f"unquantized checkpoint with runtime.kv_cache_dtype: fp8")
        self.layers: dict[str, str] | None = None  # MIXED_PRECISION: module -> its algo
        self.groups: dict[str, int] = {}  # MIXED_PRECISION: W4A16_AWQ module -> its group size
        if str(algo).upper() == "MIXED_PRECISION":
            layers = q.get("quantized_layers")
            if not isinstance(layers, dict) or not layers:
                raise _fail(cfg_file, f"{self.where}.quant_algo is MIXED_PRECISION but quantized_layers is missing "
                                      f"or empty; expected module -> {{quant_algo}}")
            self.layers = {}
            for m, c in layers.items():
                where = f"{self.where}.quantized_layers.{m}"
                self.layers[m] = self._algo((c or {}).get("quant_algo") if isinstance(c, dict) else c,
                                            f"{where}.quant_algo")
                if MODELOPT_ALGOS[self.layers[m]][0] == "w4a16":
                    self.groups[m] = self._int4_group(c, where)
            first = next(iter(self.layers.values()))
            group = next(iter(self.groups.values()), -1)
        else:
            first = self._algo(algo, f"{self.where}.quant_algo")
            group = self._int4_group(q, self.where) if MODELOPT_ALGOS[first][0] == "w4a16" else -1
        self.algo = "MIXED_PRECISION" if self.layers is not None else first
        scheme, per_channel, static = MODELOPT_ALGOS[first]
        self.scheme, self.bits, self.group_size = scheme, 4 if scheme == "w4a16" else 8, group
        self.details = {"quant_algo": self.algo, "kv_cache_quant_algo": kv,
                        "version": (section.get("producer") or {}).get("version")}
        if self.layers is None and scheme == "fp8":
            self.details.update(activations="static" if static else "dynamic",
                                weight_granularity="channel" if per_channel else "tensor")
        if self.layers is None and scheme == "w8a8_int8":
            self.details.update(activations="static")

    def _algo(self, value: Any, where: str) -> str:
        algo = str(value).upper()
        if algo not in MODELOPT_ALGOS:
            why = MODELOPT_REFUSED.get(algo, "it is not an algorithm the import reads")
            raise _fail(self.cfg_file, f"{where} is {json.dumps(value)}: {why}; imported: "
                                       f"{', '.join(MODELOPT_ALGOS)}")
        return algo

    def _int4_group(self, q: Any, where: str) -> int:
        """W4A16_AWQ's group size (ModelOpt's awq_block_size: input features per weight_scale), and a check that it
        stores no zero points."""
        q = q if isinstance(q, dict) else {}
        group = q.get("group_size")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise _fail(self.cfg_file, f"{where}.group_size is {json.dumps(group)}; W4A16_AWQ needs the positive "
                                       f"number of input features that share one weight_scale (e.g. 128; ModelOpt "
                                       f"writes it to hf_quant_config.json, not to config.json's quantization_config: "
                                       f"keep that file beside config.json)")
        if q.get("has_zero_point", False) is not False:
            raise _fail(self.cfg_file, f"{where}.has_zero_point is {json.dumps(q.get('has_zero_point'))}; imported: "
                                       f"false (ModelOpt's W4A16_AWQ is symmetric: codes -8..7 times weight_scale)")
        return group

    def algo_of(self, module: str) -> str | None:
        """The module's quant_algo; None: left in floating point."""
        if self.layers is not None:
            return self.layers.get(module)
        return None if any(fnmatch.fnmatchcase(module, p) for p in self.exclude) else self.algo

    names_modules = True

    def tensor_names(self, module: str) -> tuple[list[str], list[str]] | None:
        algo = self.algo_of(module)
        if algo is None:
            return None
        scheme, _, static = MODELOPT_ALGOS[algo]
        required = ("weight", "weight_scale") + (("input_scale",) if static else ())
        optional = ("k_scale", "v_scale") + (("pre_quant_scale",) if scheme in PRE_QUANT_SCALED else ())
        return [f"{module}.{r}" for r in required], [f"{module}.{r}" for r in optional]

    def read(self, module: str, tensors: dict[str, Tensor], in_f: int, out_f: int) -> ImportedLinear:
        algo = self.algo_of(module)
        scheme, per_channel, static = MODELOPT_ALGOS[algo]
        if scheme == "w4a16":
            lin = self._read_int4(module, tensors, in_f, out_f, self.groups.get(module, self.group_size))
        else:
            lin = _read_8bit(module, tensors, in_f, out_f, scheme, per_channel, static, "modelopt",
                             f"quant_algo {algo}")
            if scheme == "w8a8_int8":  # SmoothQuant's s on every linear (never folded into a norm): W (x * s)
                name = f"{module}.pre_quant_scale"
                _read_pre_quant_scale(name, tensors, in_f, lin.tensors, "SmoothQuant's")
                lin.consumed += [name] if name in tensors else []
        for name in (f"{module}.{r}" for r in ("k_scale", "v_scale") if f"{module}.{r}" in tensors):
            # the KV cache's scales (the amax of k, v over 448), on k_proj / v_proj: read, not applied (the KV cache
            # is runtime.kv_cache_dtype's)
            _check(name, tensors[name].reshape(-1), FLOATS, (1,), f"one KV-cache scale, kv_cache_quant_algo "
                                                                  f"{self.kv_algo}")
            lin.consumed.append(name)
        return lin

    @staticmethod
    def _read_int4(module: str, tensors: dict[str, Tensor], in_f: int, out_f: int, group: int) -> ImportedLinear:
        """W4A16_AWQ (``pack_int4_in_uint8``): signed 4-bit codes packed along out_features, two rows a byte, ``weight``
        uint8 [N/2, K] holding row 2i in its low nibble and row 2i+1 in its high one (two's complement, -8..7);
        ``weight_scale`` [N, K / group] (amax / 7, fp32 as exported): w[n, k] = q[n, k] * weight_scale[n, k // group].
        IR w4a16 with zero point 8 (codes + 8, as the IR's unsigned layout stores a symmetric code). Where the export
        could not fold AWQ's per-input-channel scale s into the norm before the linear (o_proj, down_proj), it keeps
        it as ``pre_quant_scale`` [K] (the model dtype) and the linear computes W (x * s): the IR's pre_quant_scale
        role, kept in fp32 (exact)."""
        if in_f % group:
            raise PrequantizedError(f"{module}: W4A16_AWQ's group_size {group} does not divide its in_features {in_f}; "
                                    f"its weight_scale groups must tile the input (a group_size dividing every "
                                    f"quantized linear's in_features, e.g. 128 or 64)")
        num_groups = in_f // group
        if out_f % 2:
            raise PrequantizedError(f"{module}: out_features {out_f} is odd; W4A16_AWQ packs two output rows a byte")
        names = {r: f"{module}.{r}" for r in ("weight", "weight_scale", "pre_quant_scale")}
        weight, scale = tensors[names["weight"]], tensors[names["weight_scale"]]
        _check(names["weight"], weight, (torch.uint8, torch.int8), (out_f // 2, in_f),
               f"4-bit codes of the {out_f} x {in_f} weight, two output rows a byte")
        _check(names["weight_scale"], scale, FLOATS, (out_f, num_groups),
               f"one scale per output row and group of {group} of the {in_f} input features")
        _check_scales(names["weight_scale"], scale)
        packed = weight.view(torch.uint8).to(torch.int32)
        nibbles = torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(out_f, in_f)  # row 2i low, 2i + 1 high
        codes = nibbles - 16 * (nibbles >= 8).to(torch.int32)  # two's complement: -8..7
        # the format's dequantization: w[n, k] = q[n, k] * weight_scale[n, k // group]
        reference = codes.float() * scale.float()[:, torch.arange(in_f) // group]
        zeros = torch.full((out_f, num_groups), 8, dtype=torch.int32)
        ir, quant = _weight_only(codes + 8, zeros, scale, 4, group, None, "modelopt", module)
        _read_pre_quant_scale(names["pre_quant_scale"], tensors, in_f, ir, "AWQ's")
        return ImportedLinear("w4a16", ir, quant, reference, [n for n in names.values() if n in tensors])


# --- config -----------------------------------------------------------------------------------------
REFUSED = {
    "bitsandbytes": "bitsandbytes NF4 / LLM.int8 weights are not imported",
}


MODELOPT_FILE = "hf_quant_config.json"  # ModelOpt's own record of the export, beside config.json


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot be read as JSON ({e}); export the checkpoint again") from None
    if not isinstance(data, dict):
        raise _fail(path, f"holds a JSON {type(data).__name__}; expected an object with producer and quantization")
    return data


def _modelopt_quantization(path: Path, data: dict) -> dict:
    """hf_quant_config.json's ``quantization`` object ({} when absent)."""
    q = data.get("quantization")
    if q is None:
        return {}
    if not isinstance(q, dict):
        raise _fail(path, f"quantization is {json.dumps(q)[:80]}; expected an object with quant_algo; export the "
                          f"checkpoint again")
    return q


def nvfp4_export(cfg_file: Path, config: dict) -> str | None:
    """The quant_algo of a ModelOpt NVFP4 export (NVFP4, or NVFP4_AWQ whose linears may keep AWQ's pre_quant_scale,
    for every quantized linear: its weights are decoded as they are read, ``builder.checkpoint._nvfp4_weights``), or
    None for any other checkpoint (a mixed precision export too). Its KV cache algorithm must be none or FP8 (whose
    scales are left unread)."""
    section = config.get("quantization_config")
    if isinstance(section, dict) and section.get("quant_method") == "modelopt":
        q = section
    else:
        modelopt = cfg_file.parent / MODELOPT_FILE
        if not (section is None and modelopt.is_file()):
            return None
        q = _modelopt_quantization(modelopt, _read_json(modelopt))
    algo = str(q.get("quant_algo")).upper()
    if algo not in ("NVFP4", "NVFP4_AWQ"):
        return None
    kv = q.get("kv_cache_quant_algo", q.get("kv_cache_scheme"))  # config.json's form names it kv_cache_scheme
    if isinstance(kv, dict):
        kv = "FP8" if kv.get("num_bits") == 8 and kv.get("type") == "float" else json.dumps(kv)
    if kv not in (None, "FP8"):
        raise _fail(cfg_file, f"kv_cache_quant_algo is {json.dumps(kv)} beside NVFP4 weights; imported: FP8 (its "
                              f"scales are left unread: the KV cache is the recipe's) or none")
    return algo


def read_quant_config(cfg_file: Path, config: dict) -> QuantFormat | None:
    """The checkpoint's quantization format from config.json (None for a floating-point checkpoint); a format or
    setting the import does not read is a PrequantizedError naming it and what is imported."""
    key = next((k for k in ("quantization_config", "compression_config") if config.get(k) is not None), None)
    modelopt = cfg_file.parent / MODELOPT_FILE
    if nvfp4_export(cfg_file, config):  # decoded to float weights as they are read (builder/checkpoint.py)
        return None
    if key is None:  # ModelOpt before 0.29 wrote hf_quant_config.json alone
        section = _read_json(modelopt) if modelopt.is_file() else {}
        return ModelOpt(modelopt, section) if "quantization" in section else None
    section = config[key]
    if not isinstance(section, dict):
        raise _fail(cfg_file, f"{key} is {json.dumps(section)[:80]}; expected an object with quant_method")
    method = section.get("quant_method") or ("compressed-tensors" if key == "compression_config" else None)
    if method == "mxfp4":  # decoded to float weights as they are read (builder/checkpoint.py): exact, not an import
        return None
    if method == "gptq":
        return GPTQ(cfg_file, section)
    if method == "awq":
        return AWQ(cfg_file, section)
    if method == "compressed-tensors":
        return CompressedTensors(cfg_file, section, key)
    if method == "fp8":
        return FineGrainedFP8(cfg_file, section)
    if method == "modelopt":
        if not modelopt.is_file():
            return ModelOpt(cfg_file, section)
        full = _read_json(modelopt)
        ours, theirs = section.get("quant_algo"), _modelopt_quantization(modelopt, full).get("quant_algo")
        if ours is not None and str(ours).upper() != str(theirs).upper():
            raise _fail(cfg_file, f"{key}.quant_algo is {json.dumps(ours)} but {modelopt.name} beside it says "
                                  f"{json.dumps(theirs)}; export the checkpoint again")
        return ModelOpt(modelopt, full)
    why = REFUSED.get(str(method), "it is not a format the import reads")
    raise _fail(cfg_file, f"{key}.quant_method is {json.dumps(method)}: {why}; imported: {SUPPORTED}; or build "
                          f"from the unquantized checkpoint and quantize with the recipe's quantization section")


def recipe_disagreement(fmt: QuantFormat, sections: list) -> str | None:
    """Why the recipe's quantization sections do not describe this checkpoint's quantization (None: they do).
    A section agrees when its algo writes the checkpoint's scheme (and, for GPTQ and AWQ checkpoints, is that
    method) and every bits / group_size it sets is the checkpoint's, as are the activations / weight_granularity of
    an fp8 section where the format records them."""
    for q in sections:
        schemes = ALGO_SCHEMES.get(q.algo, ())
        method_ok = q.algo == fmt.source if fmt.source in ("gptq", "awq") else True
        if fmt.scheme not in schemes or not method_ok:
            return f"algo {q.algo}"
        if q.lm_head or q.targets or q.ignore:
            return f"algo {q.algo} with its own targets / ignore / lm_head (the checkpoint's config says which " \
                   f"modules are quantized)"
        for key in ("bits", "group_size"):
            value = getattr(q, key, None)
            if value is not None and value != getattr(fmt, key):
                return f"{key} {value} (the checkpoint's is {getattr(fmt, key)})"
        for key in ("activations", "weight_granularity"):
            value, have = getattr(q, key, None), fmt.details.get(key)
            if value is not None and have is not None and value != have:
                return f"{key} {value} (the checkpoint's is {have})"
    return None


# --- binding to the traced graph --------------------------------------------------------------------
@dataclass
class Imported:
    """What the import made of a pre-quantized checkpoint's linears."""

    fmt: QuantFormat
    linears: dict[str, ImportedLinear]  # module path -> its IR tensors and reference weight
    consumed: set[str]  # checkpoint tensors the import read
    # mixture-of-experts weights (the graph's stacked name, e.g. ``...mlp.experts.gate_up_proj``) -> the format's own
    # dequantization of every expert's linears, stacked as transformers stacks them (None once handed over)
    experts: dict[str, Tensor | None] = field(default_factory=dict)
    expert_linears: int = 0  # per-expert checkpoint linears imported into them
    # the model's experts modules (``...mlp.experts``) whose linears quantize their inputs -> (scheme, group width):
    # fp8 per token, fp8_block per token and group along the input; for the reference model
    expert_inputs: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    # the dequantized references are kept for the verify pass's Hugging Face model only; a build that does not verify
    # lets each go once it is checked (a float copy of every quantized weight is the model's size again: 60 GB of
    # bf16 experts for a 30B mixture of experts stored in 31 GB of FP8)
    keep_references: bool = True

    def pop_reference_weights(self) -> dict[str, Tensor]:
        """``<module>.weight`` (and the stacked experts' weight names) -> the format's own dequantization, for the
        Hugging Face reference model; handed over (the import keeps none of them: a float copy of every quantized
        weight is the model's size again)."""
        if not self.keep_references:
            raise ValueError("the import was told not to keep its reference weights (keep_references=False)")
        out = {f"{m}.weight": lin.reference for m, lin in self.linears.items() if lin.reference is not None}
        out.update({name: w for name, w in self.experts.items() if w is not None})
        for lin in self.linears.values():
            lin.reference = None
        self.experts = dict.fromkeys(self.experts)
        return out

    def input_scales(self) -> dict[str, Tensor]:
        """module -> the per-input-channel scale (fp32 [in]) its linear multiplies its input by before the matmul
        (ModelOpt AWQ's pre_quant_scale), for the reference model: applied before any activation quantization."""
        return {m: lin.tensors["pre_quant_scale"] for m, lin in self.linears.items()
                if "pre_quant_scale" in lin.tensors}

    def activation_quant(self) -> dict[str, tuple[str, Tensor | None, int | None, int]]:
        """module -> (scheme, static input scale or None, group width along K or None, lowest int8 code) of the
        W8A8 linears, whose activations the format quantizes too (fp8 / int8 per token or with the static scale, int8
        codes down to act_qmin; fp8_block per token and group)."""
        return {m: (lin.scheme, lin.tensors.get("input_scale"), lin.quant.get("block_size", [None, None])[1],
                    lin.quant.get("act_qmin", -127))
                for m, lin in self.linears.items() if lin.scheme in ("fp8", "w8a8_int8", "fp8_block")}

    def summary(self) -> dict[str, Any]:
        """The manifest's record of the import."""
        schemes: dict[str, int] = {}
        for lin in self.linears.values():
            schemes[lin.scheme] = schemes.get(lin.scheme, 0) + 1
        out = {**self.fmt.summary(), "num_linears": len(self.linears), "schemes": schemes,
               "act_order_linears": sum("perm" in lin.tensors for lin in self.linears.values()),
               "pre_quant_scale_linears": sum("pre_quant_scale" in lin.tensors for lin in self.linears.values())}
        if self.experts:
            out["moe_weights"] = len(self.experts)
            out["expert_linears"] = self.expert_linears
        return out


def import_linears(graph, ckpt, fmt: QuantFormat, dtype: torch.dtype, require: bool = True,
                   keep_references: bool = True) -> Imported:
    """Give each linear (and an untied lm_head) the checkpoint stores quantized its IR scheme, from the
    checkpoint's own tensors; the others keep their meta ``weight`` for the float loader. Each linear's reference
    weight is kept in ``dtype`` (the build's), with ``keep_references`` (the verify pass's reference model needs
    them), else dropped once checked. Raises PrequantizedError on a missing or malformed tensor, naming it, and
    (``require``) when no linear is quantized (:func:`check_imported`: experts may be, see :func:`import_experts`)."""
    from passes.quantize import replace_weight

    imported = Imported(fmt, {}, set(), keep_references=keep_references)
    for node in list(graph.nodes):
        name = node.weights.get("weight", "")
        if node.op not in ("linear", "lm_head") or not name.endswith(".weight") or not graph.params[name].is_meta:
            continue
        if any(name in n.weights.values() for n in graph.nodes if n is not node):  # tied to the embedding
            continue
        module = name.removesuffix(".weight")
        names = fmt.tensor_names(module)
        if names is None:
            continue
        required, optional = names
        present = [n for n in required if n in ckpt.weight_map]
        if not present and not fmt.names_modules:
            continue  # GPTQ / AWQ: a module left in floating point (an lm_head, modules_to_not_convert)
        missing = [n for n in required if n not in ckpt.weight_map]
        if missing:
            have = ", ".join(n.rsplit(".", 1)[1] for n in present) or "none of them"
            raise PrequantizedError(f"{ckpt.path}: tensor {missing[0]!r} is missing; a {fmt.source} quantized linear "
                                  f"stores {', '.join(n.rsplit('.', 1)[1] for n in required)} (found {have})")
        out_f, in_f = graph.params[name].shape
        tensors = ckpt.load_tensors(present + [n for n in optional if n in ckpt.weight_map])
        check_finite(ckpt.path, tensors)
        try:
            lin = fmt.read(module, tensors, int(in_f), int(out_f))
        except PrequantizedError as e:
            raise PrequantizedError(f"{ckpt.path}: {e}") from None
        ours = ir_dequantize(lin)
        assert torch.equal(ours, lin.reference), f"{module}: the IR's dequantization differs from {fmt.source}'s"
        lin.reference = lin.reference.to(dtype) if keep_references else None
        replace_weight(graph, node, lin.scheme, lin.tensors, lin.quant)
        imported.linears[module] = lin
        imported.consumed.update(lin.consumed)
    if require:
        check_imported(imported, ckpt)
    return imported


def check_finite(path: Path, tensors: dict[str, Tensor]) -> None:
    """Refuse a pre-quantized checkpoint whose scales or FP8 codes hold NaN or infinity (a corrupt file): named,
    with the first such element, before any dequantization compares them."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        bad = ~torch.isfinite(t if t.element_size() > 1 else t.float())
        if bad.any():
            at = [int(i) for i in bad.nonzero()[0]]
            value = t[tuple(at)].float().item()
            raise PrequantizedError(f"{path}: tensor {name!r} holds {value} at {at} ({int(bad.sum())} of {t.numel()} "
                                    f"values are not finite); the checkpoint is corrupt, download it again")


def check_imported(imported: Imported, ckpt) -> None:
    """PrequantizedError when the import found no quantized linear and no quantized experts."""
    if imported.linears or imported.experts:
        return
    fmt = imported.fmt
    example = fmt.tensor_names("model.layers.0.mlp.down_proj")  # None where the config leaves it unquantized
    raise PrequantizedError(f"{ckpt.path}: {fmt.cfg_file.name} says the checkpoint is {fmt.source}-quantized but "
                            f"no linear of the model has its quantized tensors"
                            + (f" (e.g. {', '.join(example[0])})" if example else ""))


EXPERT_ROLES = ("w_gate_up", "w_down")  # a moe node's stacked expert weights: [E, 2I, hidden], [E, hidden, I]


def expert_modules(ckpt, fmt: QuantFormat, taken: set[str]) -> dict[str, str]:
    """``<module>.weight`` -> module for the checkpoint's modules stored quantized (their format's required tensors
    present, and no ``weight`` but the format's own: FP8 formats store the codes as ``weight``) that no linear
    imported (``taken``: tensors read already): a mixture of experts' per-expert linears, which the model holds
    stacked. The ``.weight`` name stands for the module's quantized tensors where transformers' loading rules
    (stacking the experts) are applied to names."""
    out = {}
    for module in sorted({n.rsplit(".", 1)[0] for n in ckpt.weight_map if n not in taken and "." in n}):
        names = fmt.tensor_names(module)
        if names and names[0] and all(n in ckpt.weight_map for n in names[0]) \
                and (f"{module}.weight" not in ckpt.weight_map or f"{module}.weight" in names[0]):
            out[f"{module}.weight"] = module  # FP8 formats store the codes as the module's weight itself
    return out


def _expert_scheme(lin: ImportedLinear, what: str) -> tuple:
    """The moe scheme an expert linear imports as, with what must agree across a layer: ("w4a16", group size) or
    ("fp8",); PrequantizedError for anything the moe op does not run."""
    if lin.scheme == "w4a16" and not {"perm", "pre_quant_scale"} & set(lin.tensors):
        return "w4a16", lin.quant["group_size"]
    if lin.scheme == "fp8" and "input_scale" not in lin.tensors:
        return ("fp8",)
    if lin.scheme == "fp8_block":
        return "fp8_block", tuple(lin.quant["block_size"])
    kind = ("act-order (desc_act)" if "perm" in lin.tensors else
            "scaled on its input (a pre_quant_scale, which the moe op does not apply)" if "pre_quant_scale" in
            lin.tensors else "FP8 with a static input scale" if lin.scheme == "fp8" else lin.scheme)
    raise PrequantizedError(f"{what} is {kind}; quantized experts import as 4-bit weight-only codes in groups along "
                            f"the input without act-order (the moe op's w4a16 scheme), as FP8 per channel or tensor "
                            f"with inputs quantized per token (its fp8 scheme) or as FP8 in blocks (fp8_block)")


def _scheme_name(scheme: tuple) -> str:
    return {"fp8": "fp8", "fp8_block": f"fp8_block with block_size {list(scheme[1:])}"}.get(
        scheme[0], f"{scheme[0]} with group_size {scheme[-1]}")


def _stack_experts(per_expert: list[list[ImportedLinear]], scheme: tuple) -> tuple[dict[str, Tensor], Any]:
    """The moe layout of one projection's experts (``per_expert[e]``: its linears in the conversion's order, gate
    then up), and a function giving expert e's dequantization [out, in] in fp32 (one expert at a time: the stacked
    fp32 copy of a 30B model's experts would be 4x their FP8 bytes)."""
    if scheme[0] == "w4a16":
        tensors = {key: torch.stack([torch.cat([lin.tensors[key] for lin in parts]) for parts in per_expert])
                   .contiguous() for key in ("qweight", "scales", "zeros")}
        return tensors, lambda e: dequantize_weight(tensors["qweight"][e], tensors["scales"][e], tensors["zeros"][e],
                                                    4, scheme[1], torch.float32)

    codes = torch.stack([torch.cat([lin.tensors["qweight"] for lin in parts]) for parts in per_expert]).contiguous()
    if scheme[0] == "fp8_block":  # block rows stacked: every member but the last whole blocks of rows (the caller)
        scales = torch.stack([torch.cat([lin.tensors["weight_scale"].float() for lin in parts])
                              for parts in per_expert]).contiguous()
        return ({"qweight": codes, "weight_scale": scales},
                lambda e: dequantize_weight_fp8_blocks(codes[e], scales[e], list(scheme[1])))

    def row_scales(lin: ImportedLinear) -> Tensor:  # a per-tensor scale repeated per row
        return lin.tensors["weight_scale"].float().reshape(-1).expand(lin.tensors["qweight"].shape[0])

    scales = torch.stack([torch.cat([row_scales(lin) for lin in parts]) for parts in per_expert]).contiguous()
    return {"qweight": codes, "weight_scale": scales}, lambda e: codes[e].float() * scales[e, :, None]


def import_experts(graph, ckpt, fmt: QuantFormat, dtype: torch.dtype, imported: Imported,
                   sources: dict[str, tuple[dict[str, list[str]], Any]]) -> None:
    """Mixture-of-experts layers whose experts the checkpoint stores quantized, one linear per expert and projection
    (``experts.3.gate_proj.qweight`` ...): each expert's linear read as the dense linears are
    (:meth:`QuantFormat.read`), then stacked into the ``moe`` node's layout, gate rows then up rows: W4A16
    (passes/moe_int4.py: codes, scales and zeros [E, out, ...]) or FP8 (passes/fp8.py: e4m3 codes [E, out, in] and
    per-channel scales [E, out], a per-tensor scale repeated per row; inputs quantized per token, as the format's
    dynamic activations are) or block FP8 (scheme fp8_block: e4m3 codes and the blocks' scales [E, out / bn, in / bk]
    kept as stored, gate rows whole blocks). ``sources``: the moe weight's graph name -> (its source pattern -> the
    ``<module>.weight`` names, in expert order, transformers stacks it from; ``stack(references)``, transformers' own
    conversion of float tensors by those names), from ``builder/checkpoint.py``. The stacked IR tensors'
    dequantization must equal the format's own, stacked by that conversion, bit for bit. Experts without act-order,
    one scheme (and group size) for the layer; anything else is refused, naming it."""
    from kernels.moe import INT4_MIN_BLOCK_K

    for node in graph.nodes:
        if node.op != "moe":
            continue
        found = [r for r in EXPERT_ROLES if node.weights[r] in sources]
        if not found:
            continue
        if len(found) < len(EXPERT_ROLES):
            what = {"w_gate_up": "gate and up", "w_down": "down"}[found[0]]
            raise PrequantizedError(f"{ckpt.path}: the experts of {node.source} store their {what} projections "
                                    f"{fmt.source}-quantized and the others in floating point; a moe layer's experts "
                                    f"are imported quantized all together or not at all")
        scheme: tuple = ()
        made: dict[str, tuple[dict[str, Tensor], Tensor, list[str]]] = {}
        for role in EXPERT_ROLES:
            name = node.weights[role]
            by_pattern, stack = sources[name]
            num_experts, out_total, in_f = graph.params[name].shape
            out_f = out_total // len(by_pattern)
            per_expert: list[list[ImportedLinear]] = [[] for _ in range(num_experts)]
            consumed: list[str] = []
            references: dict[str, Tensor] = {}
            stored = {pseudo: [n for n in sum(fmt.tensor_names(pseudo.removesuffix(".weight")), [])
                               if n in ckpt.weight_map] for names in by_pattern.values() for pseudo in names}
            loaded = ckpt.load_tensors([n for names in stored.values() for n in names])  # one read per file
            check_finite(ckpt.path, loaded)
            for pattern, names in by_pattern.items():
                if len(names) != num_experts:
                    raise PrequantizedError(f"{ckpt.path}: {len(names)} quantized experts match {pattern!r} in "
                                            f"{node.source}; its config has {num_experts}")
                for e, pseudo in enumerate(names):
                    module = pseudo.removesuffix(".weight")
                    tensors = {n: loaded.pop(n) for n in stored[pseudo]}
                    try:
                        lin = fmt.read(module, tensors, int(in_f), int(out_f))
                    except PrequantizedError as err:
                        raise PrequantizedError(f"{ckpt.path}: {err}") from None
                    what = f"{ckpt.path}: expert linear {module}"
                    this = _expert_scheme(lin, what)
                    if scheme and this != scheme:
                        raise PrequantizedError(f"{what} is {_scheme_name(this)}, other experts of {node.source} "
                                                f"{_scheme_name(scheme)}: a moe layer's experts take one scheme and "
                                                f"group size")
                    scheme = this
                    per_expert[e].append(lin)
                    consumed += lin.consumed
                    references[pseudo] = lin.reference
            if scheme[0] == "fp8_block" and len(by_pattern) > 1 and out_f % scheme[1][0]:
                raise PrequantizedError(f"{ckpt.path}: the experts of {node.source} have {out_f} rows per gate / up "
                                        f"projection, not a multiple of their FP8 blocks' {scheme[1][0]}: stacked "
                                        f"gate then up, their block scales would not line up")
            tensors, dequantized = _stack_experts(per_expert, scheme)
            del per_expert  # each expert's own copies of its codes and scales
            reference = stack(references)
            del references
            if reference.shape != (num_experts, out_total, in_f) or not all(
                    torch.equal(dequantized(e), reference[e].float()) for e in range(num_experts)):
                raise PrequantizedError(f"{ckpt.path}: the experts of {node.source} ({name}) are stacked by "
                                        f"transformers in a layout the import does not rebuild (its conversion gives "
                                        f"{tuple(reference.shape)}); import of these experts is not supported")
            made[role] = (tensors, reference.to(dtype) if imported.keep_references else None, consumed)
            del reference  # this projection's float copy, before the next's is made
        if scheme[0] == "w4a16" and scheme[1] != -1 and scheme[1] % INT4_MIN_BLOCK_K:
            raise PrequantizedError(f"{ckpt.path}: the experts of {node.source} are quantized in groups of "
                                    f"{scheme[1]}; the fused experts kernel takes group sizes that are multiples of "
                                    f"{INT4_MIN_BLOCK_K} (its least K step) or -1 (per channel), so these experts "
                                    f"cannot run as stored: build the unquantized model with the awq or gptq method "
                                    f"instead")
        for role, (tensors, reference, consumed) in made.items():
            name = node.weights[role]
            for key, t in tensors.items():
                graph.params[f"{name}.{key}"] = t
            node.weights[role] = f"{name}.qweight"
            if scheme[0] == "w4a16":
                node.weights[f"{role}_scales"], node.weights[f"{role}_zeros"] = f"{name}.scales", f"{name}.zeros"
            else:
                node.weights[f"{role}_scale"] = f"{name}.weight_scale"
            graph.params.pop(name)
            imported.experts[name] = reference
            imported.consumed.update(consumed)
            imported.expert_linears += tensors["qweight"].shape[0] * len(sources[name][0])  # experts x projections
        experts_module = node.weights["w_gate_up"].removesuffix(".qweight").rsplit(".", 1)[0]
        if scheme[0] == "w4a16":
            node.attrs["quant"] = {"scheme": "w4a16", "bits": 4, "group_size": scheme[1], "symmetric": False,
                                   "source": fmt.source}
        elif scheme[0] == "fp8_block":
            node.attrs["quant"] = {"scheme": "fp8_block", "block_size": list(scheme[1]), "source": fmt.source}
            imported.expert_inputs[experts_module] = ("fp8_block", scheme[1][1])
        else:
            node.attrs["quant"] = {"scheme": "fp8", "activations": "dynamic", "weight_granularity": "channel",
                                   "source": fmt.source}
            imported.expert_inputs[experts_module] = ("fp8", None)

"""Offline generation over a loaded artifact: prefill, then decode with a KV cache.

    engine = Engine.load("artifacts/quickstart")
    out = engine.generate("def fibonacci(n):", SamplingParams(max_tokens=64))

One request at a time here; the serving scheduler drives the same ``Executor`` with many.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.artifact import Artifact, ArtifactError, open_artifact
from runtime.executor import LONG_ROPE_OFFSET, Executor, GraphFormatError, SeqSlice, StepInput, check_graph
from runtime.kv_cache import SequenceKV
from runtime.outputs import TokenLogprob
from runtime.sampling import INVALID_TOKEN, SamplingParams, compute_logprobs, make_generator, sample
from runtime.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as asked (prompt too long, empty prompt...)."""


def check_vocab_params(params: SamplingParams, vocab: int) -> None:
    """RequestError for sampling parameters that name tokens past a vocabulary of ``vocab`` (0: unknown, no check):
    ``logit_bias`` ids (a bias past the logits' width would index out of bounds on the device). The message starts
    with the field's name (the server's 400 names it as its param)."""
    if vocab and params.logit_bias and max(params.logit_bias) >= vocab:
        raise RequestError(f"logit_bias: token id {max(params.logit_bias)} is outside this model's vocabulary; ids "
                           f"must be in [0, {vocab})")


class DeviceError(ValueError):
    """A device name that is unknown, or names a device this machine does not have."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The device to run on. "auto": CUDA when this machine has it, else the CPU (logged either way);
    "cpu", "cuda" and "cuda:N" as named, checked against the machine. Raises DeviceError naming what is
    wrong and what to pass instead."""
    name = str(device).strip()
    if name == "auto":
        if torch.cuda.is_available():
            log.info("device auto: CUDA is available, using cuda")
            return torch.device("cuda")
        log.info("device auto: CUDA is not available, using the CPU")
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m is None:
        raise DeviceError(f"device {name!r} is not one of auto, cpu, cuda, cuda:N (N a CUDA device index)")
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else ", a build without CUDA"
        raise DeviceError(f"device {name!r}: CUDA is not available on this machine (torch {torch.__version__}{build}); "
                          f"use cpu, or auto to take CUDA only where there is one")
    if m[1] is None:
        return torch.device("cuda")
    index, count = int(m[1]), torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                          f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


@dataclass
class Generation:
    """The result of one request."""

    text: str  # generated text (stop string excluded)
    token_ids: list[int]  # generated token ids
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"
    prefill_s: float = 0.0  # time to first token
    decode_s: float = 0.0  # time for the remaining tokens
    logprobs: list[float] = field(default_factory=list)  # log p of each generated token (raw logits)
    # with params.logprobs set: each generated token's logprob and its params.logprobs most likely alternatives
    top_logprobs: list[TokenLogprob] | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclass(frozen=True)
class RuntimeLimits:
    """Limits the artifact was built for (recipe's runtime section)."""

    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int  # most tokens in one forward step; longer prompts prefill in chunks
    tokens_per_block: int


class Engine:
    """An artifact loaded for generation on one device."""

    def __init__(self, artifact: Artifact, executor: Executor, tokenizer: Tokenizer,
                 device: torch.device) -> None:
        self.artifact = artifact
        self.executor = executor
        self.tokenizer = tokenizer
        self.device = device
        manifest = artifact.manifest
        self.limits = RuntimeLimits(**{k: manifest["runtime"][k] for k in
                                       ("max_batch_size", "max_seq_len", "max_num_tokens", "tokens_per_block")})
        self.kv_layout = executor.kv_layout()
        tokenizer.token_bytes()  # a byte-level tokenizer's table for streaming, built now, not in a first request
        tokenizer.special_token_ids()

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", check_hashes: bool = True,
             allow_failed_gate: bool = False, use_kernels: bool | None = None) -> Engine:
        """Verify and load an artifact directory (raises ArtifactError if it is modified or truncated,
        or if it failed its quality gates and ``allow_failed_gate`` is not set). ``device``: see
        ``resolve_device`` ("auto" takes CUDA where there is one; DeviceError for a device this machine
        does not have). ``use_kernels``: run the Triton kernels (default: on CUDA when triton is
        installed; see ``Executor``)."""
        start = time.perf_counter()
        device = resolve_device(device)
        from runtime.tensor_parallel import torchrun_rank

        # a sharded artifact's other weight files are hashed by the ranks that load them
        artifact = open_artifact(path, check_hashes=check_hashes, rank=torchrun_rank() or 0)
        gates = artifact.manifest.get("quantization", {}).get("gates")
        if gates and not gates.get("passed", True) and not allow_failed_gate:
            raise ArtifactError(f"{path} failed its quality gates ({', '.join(gates.get('failed', []))}) when it "
                                f"was built; load it anyway with allow_failed_gate=True (--allow-failed-gate)")
        if use_kernels is None:
            use_kernels = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        try:  # a graph a newer (or broken) toolchain wrote, refused before any rank or kernel starts
            check_graph(artifact.graph)
        except GraphFormatError as e:
            raise ArtifactError(f"{path}: this runtime cannot run the artifact's graph: {e}") from e
        if artifact.tp_size > 1:  # starts the other ranks; this process is rank 0 (see runtime/tensor_parallel.py)
            from runtime import tensor_parallel

            executor = tensor_parallel.start(artifact, device, use_kernels, check_hashes)
        else:
            weights = artifact.load_weights(device)
            try:
                executor = Executor(artifact.graph, weights, use_kernels=use_kernels,
                                    fp8_accumulation=artifact.manifest["runtime"].get("fp8_accumulation"))
            except torch.OutOfMemoryError:
                raise
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, RuntimeError) as e:
                # attrs or weights that do not fit each other in a way check_graph does not see: named, one line
                raise ArtifactError(f"{path}: its graph and weights do not fit together ({type(e).__name__}: "
                                    f"{str(e)[:300]}); the artifact was edited after the build or written by a "
                                    f"faulty toolchain: rebuild it") from e
        tokenizer = artifact.load_tokenizer()  # only the files the manifest lists
        log.info("loaded %s in %.2fs", path, time.perf_counter() - start)
        return cls(artifact, executor, tokenizer, device)

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker ranks and leave their process group (no-op for one rank)."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    # --- forward helpers ---------------------------------------------------------------------
    def _new_cache(self, num_tokens: int) -> SequenceKV:
        return SequenceKV(self.kv_layout, num_tokens, self.device)

    def _run(self, kv: SequenceKV, token_ids: list[int], start: int, all_logits: bool,
             long_rope: bool = False) -> torch.Tensor:
        """Feed ``token_ids`` at positions start.. in chunks of max_num_tokens; returns logits. ``long_rope``: the
        sequence is past LongRoPE's switch (its positions offset onto the second table, ``LONG_ROPE_OFFSET``)."""
        outs = []
        step = self.limits.max_num_tokens
        offset = LONG_ROPE_OFFSET if long_rope else 0
        for lo in range(0, len(token_ids), step):
            chunk = token_ids[lo:lo + step]
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            positions = torch.arange(offset + start + lo, offset + start + lo + len(chunk), device=self.device)
            last = torch.tensor([len(chunk) - 1], device=self.device)
            inp = StepInput(ids, positions, [SeqSlice(kv, start + lo, len(chunk))], None if all_logits else last)
            outs.append(self.executor.forward(inp))
            kv.num_tokens = start + lo + len(chunk)
        return torch.cat(outs) if all_logits else outs[-1]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``token_ids`` ([num_tokens, vocab], fp32), as one sequence."""
        self._check_prompt(token_ids)
        return self._run(self._new_cache(len(token_ids)), token_ids, 0, all_logits=True,
                         long_rope=self._long_rope(len(token_ids)))

    def _long_rope(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` is past LongRoPE's switch (see runtime.executor.LONG_ROPE_OFFSET)."""
        switch = self.executor.long_rope_from
        return switch is not None and num_tokens > switch

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (and the logits' width) as the artifact records them; 0 where it does not."""
        return int(self.executor.graph.get("meta", {}).get("vocab_size")
                   or self.artifact.manifest.get("model", {}).get("vocab_size") or 0)

    def check_token_ids(self, token_ids: list[int]) -> None:
        """RequestError unless every id has an embedding row (the offline and the serving engines' check)."""
        vocab = self.vocab_size
        if vocab and any(not 0 <= t < vocab for t in token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab}) for this model")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        self.check_token_ids(token_ids)
        if len(token_ids) >= self.limits.max_seq_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; this engine's max_seq_len is "
                               f"{self.limits.max_seq_len} (prompt plus at least one generated token)")

    # --- generation --------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield generated text piece by piece; the final Generation is the generator's return value."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(prompt_ids)
        check_vocab_params(params, self.vocab_size)
        total = min(self.limits.max_seq_len, len(prompt_ids) + params.max_tokens)
        kv = self._new_cache(total)
        generator = make_generator(params.seed, self.device)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stops = StopChecker(params.stop)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        stop_ids = eos | set(params.stop_token_ids)

        t0 = time.perf_counter()
        long_rope = self._long_rope(len(prompt_ids))
        logits = self._run(kv, prompt_ids, 0, all_logits=False, long_rope=long_rope)  # [1, vocab]
        prefill_s = time.perf_counter() - t0
        out_ids: list[int] = []
        logprobs: list[float] = []
        top_logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        num_top = 0 if params.logprobs is None else params.logprobs
        text, emitted, finish = "", 0, "length"
        while True:
            banned = [stop_ids] if len(out_ids) < params.min_tokens else None  # min_tokens: no end yet
            tokens = sample(logits, [params], [generator], [prompt_ids], [out_ids],  # tokens: [1]
                            use_kernels=self.executor.use_kernels, banned=banned)
            if int(tokens[0]) == INVALID_TOKEN:
                raise RuntimeError(f"sampling failed after {len(out_ids)} tokens: the model's logits gave no valid "
                                   f"token distribution (NaN or inf after penalties and temperature)")
            entry = compute_logprobs(logits, tokens, [num_top])[0]
            token = entry.token_id
            logprobs.append(entry.logprob)
            if top_logprobs is not None:
                top_logprobs.append(entry)
            out_ids.append(token)
            if token in stop_ids:
                finish = "stop"
                break
            text += detok.push(token)
            cut, safe = stops.check(text)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if len(out_ids) >= params.max_tokens or kv.num_tokens + 1 > total:
                break
            if not long_rope and self._long_rope(kv.num_tokens + 1):
                # past LongRoPE's switch: every position again on the second table, as Hugging Face recomputes
                long_rope = True
                kv = self._new_cache(total)
                logits = self._run(kv, prompt_ids + out_ids, 0, all_logits=False, long_rope=True)
            else:
                logits = self._run(kv, [token], kv.num_tokens, all_logits=False, long_rope=long_rope)
        if finish == "length":
            text += detok.flush()
            cut, _ = stops.check(text)
            if cut is not None:
                text, finish = text[:cut], "stop"
        if len(text) > emitted:
            yield text[emitted:]
        decode_s = time.perf_counter() - t0 - prefill_s
        return Generation(text, out_ids, prompt_ids, finish, prefill_s, decode_s, logprobs, top_logprobs)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> Generation:
        """Generate to completion and return the text and token ids."""
        it = self.stream(prompt, params)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Generation:
        """Render ``messages`` with the checkpoint's chat template, then generate."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt, add_special_tokens=False), params)

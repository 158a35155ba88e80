"""Choosing the next token from logits, and reporting its log-probability.

Per row, in order: penalties (repetition over the prompt and the output so far; presence and frequency
over the output), the logit bias (OpenAI's ``logit_bias``: a number added to given tokens' logits), tokens a
request may not take yet (EOS and stop ids before its ``min_tokens``, from the engines), the structured-output
mask (tokens the request's grammar forbids get -inf; see runtime.structured), then greedy argmax, or temperature /
top-k / top-p / min-p and a draw. Logprobs are reported separately, of the model's raw logits (before penalties,
bias and temperature), as OpenAI does.

Penalties and filtering are vectorized over the batch (per-row penalties, k, p and min-p are tensors);
only the final draw of seeded rows loops over rows, because each draws with its own generator (unseeded
rows share one draw from the global RNG). Every step is
row-wise, which is what makes a seeded request reproducible whatever else shares its batch.

Numerics: everything runs in fp32; the parameters' ranges keep every accepted value finite through the
math (see their bounds below), penalized logits are clamped, and the top token always survives the
filters. A row whose logits give no distribution anyway (NaN or +inf from the model, nothing finite)
comes back as INVALID_TOKEN instead of raising, found on the device without a host sync, so that the
caller fails that row's request alone.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.outputs import TokenLogprob
from runtime.structured import StructuredOutput, StructuredOutputError

# Temperatures below this act as greedy: dividing logits by a tiny temperature overflows fp32.
MIN_TEMPERATURE = 1e-5
# At 100 a realistic logit spread (tens) is flattened to within a few percent of uniform; higher values change
# nothing a client could want, and past fp32's range (3.4e38) they would turn into inf.
MAX_TEMPERATURE = 100.0
# A seen token's logit is divided or multiplied by the repetition penalty: at the bounds it moves by a factor
# of 100, which already makes a repeat certain or impossible for any model's logits. Further out the factor adds
# nothing but overflow (1e-38 turns a logit of 1 into inf in fp32) and divisions by denormals. vLLM and HF only
# ask for > 0; this range is what is meaningful.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Penalized logits are clamped to +-LOGIT_LIMIT, so that dividing them by MIN_TEMPERATURE stays finite in fp32.
LOGIT_LIMIT = 1e30
INVALID_TOKEN = -1  # what ``sample`` returns for a row whose logits give no valid distribution
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts [0, 2**64)
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
# stop strings are checked against the new text at every step of the shared engine loop: bounded, so one request's
# list cannot slow the others (OpenAI takes 4)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 1024
# logit_bias: OpenAI's limits (at most 300 tokens, each biased by a number in [-100, 100])
MAX_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS = 300, 100.0


class SamplingError(ValueError):
    """Sampling parameters outside their allowed range."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Shown:
    """A value as an error message shows it: its repr, cut short (a request's list can be megabytes)."""

    def __init__(self, value: Any, limit: int = 200) -> None:
        text = repr(value)
        if len(text) > limit:
            size = f", {len(value)} items" if isinstance(value, (list, tuple, str)) else ""
            text = f"{text[:limit]}... ({len(text)} characters{size})"
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(value: Any) -> Any:
    return _Shown(value) if isinstance(value, (list, tuple, str, dict)) else value


def _token_key(key: object) -> int | None:
    """A logit_bias key as a token id: an int >= 0, or its decimal string (JSON object keys are strings)."""
    if _is_int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:
        return int(key)
    return None


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 64  # number of new tokens, >= 1
    temperature: float = 0.0  # in [0, MAX_TEMPERATURE]; 0 (or below MIN_TEMPERATURE) -> greedy (argmax)
    top_k: int = 0  # 0 -> off; else keep the k most likely tokens
    top_p: float = 1.0  # in (0, 1]: keep the smallest set of tokens whose probability reaches top_p (>= 1 token)
    min_p: float = 0.0  # in [0, 1): drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # per-request reproducibility, independent of batch composition
    stop: list[str] = field(default_factory=list)  # generation ends before any of these strings
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends on any of these ids
    ignore_eos: bool = False  # keep going past the tokenizer's EOS ids (benchmarks)
    # in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]; 1 -> off. Tokens in the prompt or the output so far:
    # logit > 0 divided by it, <= 0 multiplied (CTRL)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per time a token has been generated
    logprobs: int | None = None  # None -> off; n -> the sampled token's logprob and the n most likely (n <= 20)
    # None -> free text; else the grammar the output must match (a dict of its fields is taken too: that is how it
    # crosses the engine process boundary). Needs the serving engine, which compiles it and masks every step
    structured: StructuredOutput | None = None
    # None -> off; else token id -> a number in [-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS] added to that token's logit
    # before sampling (OpenAI's logit_bias: -100 all but excludes the token, 100 all but forces it), at most
    # MAX_LOGIT_BIAS tokens. Keys may come as decimal strings (JSON); they are kept as ints. Ids past the model's
    # vocabulary are the engines' to refuse (runtime.engine.check_vocab_params)
    logit_bias: dict[int, float] | None = None
    # vLLM's min_tokens: until this many tokens are out, EOS and stop_token_ids are kept from being sampled (the
    # engines pass them as ``sample``'s ``banned``; stop strings still apply); at most max_tokens
    min_tokens: int = 0

    def __post_init__(self) -> None:
        """Reject out-of-range values with a message naming the field, the value and what is allowed."""
        if isinstance(self.structured, dict):
            try:
                self.structured = StructuredOutput(**self.structured)
            except (TypeError, StructuredOutputError) as e:
                raise SamplingError(f"structured: {e}") from None
        self._require("structured", self.structured is None or isinstance(self.structured, StructuredOutput),
                      "None or a StructuredOutput")
        self._require("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1")
        self._require("temperature", _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
                      f"in [0, {MAX_TEMPERATURE:g}]; 0 and anything below {MIN_TEMPERATURE:g} decode greedily")
        self._require("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 means off)")
        self._require("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1,
                      "in (0, 1]; 1 keeps every token, and the most likely token is always kept, so any top_p "
                      "below its probability samples only it")
        self._require("min_p", _is_number(self.min_p) and 0 <= self.min_p < 1,
                      "in [0, 1); 0 is off, larger values drop more of the unlikely tokens")
        self._require("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
                      f"None or an int in [0, {MAX_SEED}]")
        self._require("stop", isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS
                      and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
                      f"a list of at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters")
        self._require("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple))
                      and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                      and all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
                      f"a list of at most {MAX_STOP_TOKEN_IDS} ints >= 0")
        self._require("ignore_eos", isinstance(self.ignore_eos, bool), "True or False")
        self._require("repetition_penalty", _is_number(self.repetition_penalty)
                      and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                      f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]; 1 is off, > 1 discourages "
                      f"repeats and < 1 encourages them (at the bounds a seen token is already certain or excluded)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._require(name, _is_number(value) and abs(value) <= MAX_ABS_PENALTY,
                          f"in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]")
        self._require("logprobs", self.logprobs is None
                      or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                      f"None or an int in [0, {MAX_LOGPROBS}]")
        self._require("logit_bias", self.logit_bias is None or (
            isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
            and all(_token_key(k) is not None and _is_number(v) and abs(v) <= MAX_ABS_LOGIT_BIAS
                    for k, v in self.logit_bias.items())),
            f"None or a map of at most {MAX_LOGIT_BIAS} token ids (ints >= 0, or their decimal strings) to numbers "
            f"in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():  # "5" and 5 both given: their biases add up, as one entry
                bias[_token_key(k)] = bias.get(_token_key(k), 0.0) + float(v)
            self.logit_bias = bias or None
        self._require("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                      f"an int in [0, max_tokens] (max_tokens is {_shown(self.max_tokens)!r})")
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)

    def _require(self, name: str, ok: bool, allowed: str) -> None:
        if not ok:
            value = _shown(getattr(self, name))
            if allowed.startswith(("in ", "True")):
                raise SamplingError(f"{name}: {value!r} is not {allowed}")
            raise SamplingError(f"{name}: {value!r} is not allowed; it must be {allowed}")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (no randomness, no generator needed)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits need more than a mask before this request's choice (penalties or a logit bias)."""
        return self.has_penalties or self.logit_bias is not None

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on (and so sampling this request needs its token history)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request on ``device``; None (the global RNG) when there is no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without a host sync: CUDA copies from pageable memory may
    wait for the stream (which would stall the overlapped decode pipeline), so the list goes through pinned
    memory and a non-blocking copy."""
    t = torch.tensor(values)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class TokenBitmask:
    """The tokens some rows of a batch may take next (structured output; runtime.structured.fill_bitmasks fills it).
    Bit t % 32 of word t // 32 of a row set: token t allowed."""

    rows: list[int]  # which rows of the batch are masked (the others are free)
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the logits' device

    def select(self, row: int) -> TokenBitmask:
        """The mask of one row, for a batch of that row alone."""
        if row not in self.rows:
            return TokenBitmask([], self.bitmask[:0])
        j = self.rows.index(row)
        return TokenBitmask([0], self.bitmask[j:j + 1])


_BITS: dict[torch.device, torch.Tensor] = {}  # per device: [32] int32, the value of each bit (1 << b)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """``logits`` ([num_seqs, vocab]) with the tokens the mask forbids at -inf, in the masked rows; a new tensor (the
    model's raw logits stay as they were: logprobs report them). Runs on the device, no host sync."""
    if not mask.rows:
        return logits
    num_seqs, vocab = logits.shape
    assert mask.bitmask.shape[-1] * 32 >= vocab, \
        f"a bitmask of {mask.bitmask.shape[-1]} words cannot cover a vocabulary of {vocab}"
    if logits.is_cuda:  # one kernel launch instead of the five ops below (kernels.token_mask)
        from kernels.token_mask import masked_logits

        return masked_logits(logits, mask.bitmask, mask.rows)
    bits = _BITS.get(logits.device)
    if bits is None:  # bit 31 is the sign bit: -2**31 in int32
        bits = _BITS[logits.device] = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)],
                                                   dtype=torch.int32, device=logits.device)
    # allowed: [num_masked, words, 32] -> [num_masked, vocab]
    allowed = ((mask.bitmask[:, :, None] & bits) != 0).flatten(1)[:, :vocab]
    if mask.rows == list(range(num_seqs)):  # every row masked (the common case of a constrained batch)
        return logits.masked_fill(~allowed, float("-inf"))
    rows = to_device(mask.rows, logits.device)  # rows: [num_masked]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           prompt_ids: list[Sequence[int]] | None = None,
           output_ids: list[Sequence[int]] | None = None, token_bitmask: TokenBitmask | None = None,
           generator_states: list[torch.Tensor | None] | None = None, use_kernels: bool = False,
           banned: list[Sequence[int] | None] | None = None) -> torch.Tensor:
    """Pick the next token of each sequence.

    logits: [num_seqs, vocab] (any float dtype); returns ids [num_seqs] (int64, same device).
    prompt_ids / output_ids: each sequence's prompt and generated tokens so far; required (both) when
    any row has a penalty, ignored otherwise.
    token_bitmask: the allowed tokens of the rows with structured output; required when any row has it (the
    caller owns the grammars: the serving engine), and a masked row must allow at least one token.
    Penalties first (see ``apply_penalties``), on greedy rows too, then the logit bias (``apply_logit_bias``), then
    ``banned`` (per row, token ids that may not come now, e.g. EOS before a request's min_tokens: -inf), then
    the mask. Greedy rows then take the argmax.
    Sampled rows: fp32 logits / temperature, then top-k, then top-p (smallest set whose cumulative
    probability >= top_p, always keeping the top token), then min-p, then one draw with that row's
    generator. A row's token depends only on its own logits, params, history and generator, never on
    the other rows.
    generator_states: when given (a list of num_seqs Nones), each seeded sampled row's entry is set to its
    generator's state right after that row's draw. Rows sharing a generator draw from it in row order, so a
    caller that samples several positions of one request at once (speculative verification) can rewind it to just
    after the last draw it keeps.
    A row with no valid distribution (a greedy row with a NaN logit; a sampled row whose probabilities
    are NaN: NaN or +inf logits, or none finite) gets INVALID_TOKEN, and the other rows are drawn as
    without it (seeded rows exactly). The check runs on the device: reading the result stays the caller's
    only sync.
    use_kernels: an all-greedy batch of CUDA logits takes ``kernels.argmax`` (Triton) where it is installed; the
    same tokens as torch's argmax and NaN check (the executor's ``use_kernels``: a reference path stays on torch).
    """
    num_seqs = logits.shape[0]
    if len(params) != num_seqs or len(generators) != num_seqs:
        raise ValueError(f"sample: {num_seqs} rows of logits but {len(params)} params "
                         f"and {len(generators)} generators")
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if banned is not None and not any(banned):
        banned = None
    if (not rows and token_bitmask is None and banned is None and use_kernels and logits.is_cuda
            and _triton_installed() and not any(p.adjusts_logits or p.structured is not None for p in params)):
        # all greedy, nothing to add to the logits: two small kernels on them as they are (a bf16 row's argmax is
        # its fp32 copy's; the copy was an elementwise pass over the whole [num_seqs, vocab], 0.2 ms a step at 512
        # rows of a 128k vocabulary on the H200)
        from kernels.argmax import greedy_argmax

        with torch.cuda.device(logits.device):  # Triton launches on the current device
            return greedy_argmax(logits, INVALID_TOKEN)
    logits = logits.float()  # logits: [num_seqs, vocab]
    if any(p.has_penalties for p in params):
        missing = [name for name, ids in (("prompt_ids", prompt_ids), ("output_ids", output_ids)) if ids is None]
        if missing:
            rows = [i for i, p in enumerate(params) if p.has_penalties]
            raise ValueError(f"sample: rows {rows} have penalties, which need each sequence's token history; "
                             f"pass {' and '.join(missing)}")
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
    if any(p.logit_bias is not None for p in params):
        logits = apply_logit_bias(logits, params)
    if banned is not None:
        logits = ban_tokens(logits, banned)
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    elif any(p.structured is not None for p in params):
        rows = [i for i, p in enumerate(params) if p.structured is not None]
        raise ValueError(f"sample: rows {rows} ask for structured output, which needs the grammar's token mask "
                         f"(token_bitmask); the serving engine (runtime.serving.ServingEngine) computes it")
    if not rows and use_kernels and logits.is_cuda and _triton_installed():  # all greedy, after penalties or a mask
        from kernels.argmax import greedy_argmax

        with torch.cuda.device(logits.device):  # Triton launches on the current device
            return greedy_argmax(logits, INVALID_TOKEN)
    out = torch.argmax(logits, dim=-1)  # out: [num_seqs]
    if len(rows) < num_seqs:  # greedy rows: the argmax of a row holding NaN is meaningless
        # argmax propagates NaN (it picks a NaN when the row has one): one gather, not a pass over the vocab
        invalid = torch.isnan(logits.gather(1, out[:, None])[:, 0])  # invalid: [num_seqs]
    else:
        invalid = torch.zeros(num_seqs, dtype=torch.bool, device=logits.device)
    if rows:
        row_index = to_device(rows, logits.device)  # row_index: [num_sampled]
        probs = _filtered_probs(logits.index_select(0, row_index), [params[i] for i in rows])  # [num_sampled, vocab]
        no_distribution = torch.isnan(probs).any(dim=-1)  # [num_sampled]
        invalid[row_index] = no_distribution
        # such a row draws from uniform weights instead (multinomial rejects NaN), then reads INVALID_TOKEN
        probs.masked_fill_(no_distribution[:, None], 1.0)
        states = [None] * len(rows) if generator_states is not None else None
        out[row_index] = _draw(probs, [generators[i] for i in rows], states)
        if states is not None:
            for i, state in zip(rows, states):
                generator_states[i] = state
    return out.masked_fill(invalid, INVALID_TOKEN)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None],
          states: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], valid weights): a seeded row draws from its own generator,
    whatever shares its batch; the unseeded rows share one draw from the global RNG. Returns [rows] int64.
    ``states``: when given, each seeded row's generator state after its draw (see ``sample``)."""
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.multinomial(probs, 1)[:, 0]
    out = torch.empty(len(generators), dtype=torch.long, device=probs.device)
    for j, g in enumerate(generators):
        if g is not None:
            out[j] = torch.multinomial(probs[j], 1, generator=g)[0]
            if states is not None:
                states[j] = g.get_state()
    if unseeded:
        index = to_device(unseeded, probs.device)
        out[index] = torch.multinomial(probs.index_select(0, index), 1)[:, 0]
    return out


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[Sequence[int]],
                    output_ids: list[Sequence[int]]) -> torch.Tensor:
    """Logits after each row's repetition, presence and frequency penalties, as fp32.

    logits: [num_seqs, vocab]; prompt_ids / output_ids: one token sequence per row. Per row, in order:
      repetition (HF / CTRL): every token in the prompt or the output, logit > 0 -> logit / penalty,
                              logit <= 0 -> logit * penalty;
      presence and frequency (OpenAI), over the output only:
                              logit -= presence * (count > 0) + frequency * count.
    Rows whose penalties are all off come back bit-identical. Penalized rows are clamped to
    +-LOGIT_LIMIT (NaN stays NaN, for ``sample`` to find). The input is never modified; when no row has a
    penalty it is returned as is (cast to fp32).
    """
    num_seqs = logits.shape[0]
    if len(params) != num_seqs or len(prompt_ids) != num_seqs or len(output_ids) != num_seqs:
        raise ValueError(f"apply_penalties: {num_seqs} rows of logits but {len(params)} params, "
                         f"{len(prompt_ids)} prompts and {len(output_ids)} outputs")
    logits = logits.float()
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    chosen = [params[i] for i in rows]
    row_index = torch.tensor(rows, device=device)  # row_index: [num_penalized]
    penalized = logits.index_select(0, row_index)  # penalized: [num_penalized, vocab]
    output_counts = _token_counts([output_ids[i] for i in rows], vocab, device)  # [num_penalized, vocab]

    if any(p.repetition_penalty != 1.0 for p in chosen):
        # A penalized row with repetition_penalty 1 passes through unchanged: x / 1 and x * 1 are exact.
        prompt_counts = _token_counts([prompt_ids[i] if p.repetition_penalty != 1.0 else ()
                                       for i, p in zip(rows, chosen)], vocab, device)
        seen = (prompt_counts + output_counts) > 0  # seen: [num_penalized, vocab]
        repetition = torch.tensor([p.repetition_penalty for p in chosen], device=device)[:, None]
        scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
        penalized = torch.where(seen, scaled, penalized)
    presence = torch.tensor([p.presence_penalty for p in chosen], device=device)[:, None]  # [num_penalized, 1]
    frequency = torch.tensor([p.frequency_penalty for p in chosen], device=device)[:, None]
    penalized = penalized - presence * (output_counts > 0) - frequency * output_counts
    return logits.index_copy(0, row_index, penalized.clamp(-LOGIT_LIMIT, LOGIT_LIMIT))


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 logits ([num_seqs, vocab]) plus each row's ``logit_bias`` at its tokens; a new tensor (the input, the
    model's raw logits, stays as it was: logprobs report them). Rows without a bias come back bit-identical; -inf
    (a masked or penalized-out token) stays -inf and NaN stays NaN. Token ids must be inside the vocabulary: the
    engines check them when a request arrives (``runtime.engine.check_vocab_params``)."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += list(p.logit_bias)
            values += list(p.logit_bias.values())
    if cols and max(cols) >= logits.shape[-1]:
        raise ValueError(f"apply_logit_bias: token id {max(cols)} is outside the logits' vocabulary of "
                         f"{logits.shape[-1]}")
    return _scatter(logits, rows, cols, values, accumulate=True)


def ban_tokens(logits: torch.Tensor, banned: list[Sequence[int] | None]) -> torch.Tensor:
    """fp32 logits with each row's ``banned`` token ids at -inf (ids past the vocabulary skipped: no such token can
    come anyway); a new tensor."""
    if len(banned) != logits.shape[0]:
        raise ValueError(f"ban_tokens: {logits.shape[0]} rows of logits but {len(banned)} lists of banned tokens")
    vocab = logits.shape[-1]
    pairs = [(i, t) for i, ids in enumerate(banned) if ids for t in ids if 0 <= t < vocab]
    return _scatter(logits, [i for i, _ in pairs], [t for _, t in pairs], float("-inf"), accumulate=False)


def _scatter(logits: torch.Tensor, rows: list[int], cols: list[int], values: list[float] | float,
             accumulate: bool) -> torch.Tensor:
    """fp32 ``logits`` with ``values`` put (or added) at (rows[j], cols[j]): a new tensor, one scatter on the device,
    no host sync (the indices go through pinned memory)."""
    logits = logits.float()
    if not rows:
        return logits
    device = logits.device
    values = to_device(values, device) if isinstance(values, list) else torch.tensor(values, device=device)
    return logits.index_put((to_device(rows, device), to_device(cols, device)), values, accumulate=accumulate)


def _token_counts(token_ids: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's ids: [rows, vocab] fp32 (exact up to 2**24).

    One scatter_add over the ids padded to the longest row; padding adds 0 (to token 0)."""
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(len(token_ids), vocab, device=device)
    if width == 0:
        return counts
    padded = torch.tensor([list(ids) + [0] * (width - len(ids)) for ids in token_ids], dtype=torch.long,
                          device=device)  # padded: [rows, width]
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)  # lengths: [rows]
    real = (torch.arange(width, device=device)[None, :] < lengths[:, None]).float()  # real: [rows, width]
    return counts.scatter_add_(1, padded, real)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: list[int | None]) -> list[TokenLogprob | None]:
    """Each asking row's chosen token's logprob and its ``num_top`` most likely alternatives.

    logits: [num_seqs, vocab], the model's raw logits (before penalties and temperature); token_ids:
    [num_seqs], the tokens chosen from them; num_top: per row, None (no logprobs: that row gets None) or
    how many alternatives to list (0 -> just the chosen token's logprob). One log_softmax (fp32) and one
    topk over the asking rows, one copy to the host.
    """
    num_seqs = logits.shape[0]
    if token_ids.shape != (num_seqs,) or len(num_top) != num_seqs:
        raise ValueError(f"compute_logprobs: {num_seqs} rows of logits but token_ids of shape "
                         f"{tuple(token_ids.shape)} and {len(num_top)} num_top")
    result: list[TokenLogprob | None] = [None] * num_seqs
    rows = [i for i, n in enumerate(num_top) if n is not None]
    if not rows:
        return result
    row_index = torch.tensor(rows, device=logits.device)  # row_index: [num_asked]
    logprobs = torch.log_softmax(logits.index_select(0, row_index).float(), dim=-1)  # [num_asked, vocab]
    tokens = token_ids.to(logits.device).index_select(0, row_index)  # tokens: [num_asked]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # chosen: [num_asked]
    k = min(max(num_top[i] for i in rows), logprobs.shape[-1])
    top_logprobs, top_ids = torch.topk(logprobs, k, dim=-1)  # both: [num_asked, k], most likely first
    tokens_host, chosen_host = tokens.tolist(), chosen.tolist()
    top_logprobs_host, top_ids_host = top_logprobs.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = num_top[i]
        result[i] = TokenLogprob(tokens_host[j], chosen_host[j],
                                 tuple(zip(top_ids_host[j][:n], top_logprobs_host[j][:n])))
    return result


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, in vocabulary order.

    logits: [rows, vocab] fp32. Filtering runs in descending-probability order (one sort per row); the
    resulting keep-mask is scattered back so the draw happens in vocabulary order, which keeps a row's
    result the same whether or not its batch needed sorting."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = to_device([p.temperature for p in params], device)  # [rows]
    logits = logits / temperature[:, None]  # logits: [rows, vocab]
    if all(p.top_k == 0 and p.top_p >= 1 and p.min_p == 0 for p in params):
        return torch.softmax(logits, dim=-1)
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)  # [rows]
    top_p = to_device([p.top_p for p in params], device)  # [rows]
    min_p = to_device([p.min_p for p in params], device)  # [rows]

    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # both: [rows, vocab]
    keep = _top_k_mask(top_k, vocab)  # keep: [rows, vocab], in sorted order
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    keep &= _top_p_mask(torch.softmax(sorted_logits, dim=-1), top_p)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    keep &= _min_p_mask(torch.softmax(sorted_logits, dim=-1), min_p)
    keep_vocab = torch.zeros_like(keep).scatter(-1, order, keep)  # keep_vocab: [rows, vocab]
    return torch.softmax(logits.masked_fill(~keep_vocab, float("-inf")), dim=-1)


def _top_k_mask(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Keep the first k positions of each sorted row. top_k: [rows] -> mask [rows, vocab]."""
    positions = torch.arange(vocab, device=top_k.device)  # positions: [vocab]
    return positions[None, :] < top_k[:, None]


def _top_p_mask(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix whose cumulative probability reaches top_p: a token stays if the mass before
    it is still below top_p. The top token always stays (explicitly: a top_p below fp32's smallest number
    reads 0 on the device); top_p == 1 keeps everything, so fp32 rounding of the cumulative sum cannot drop
    rare tokens. sorted_probs: [rows, vocab] descending; top_p: [rows] -> mask [rows, vocab]."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass_before: [rows, vocab]
    first = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device) == 0  # first: [vocab]
    return (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0) | first[None, :]


def _min_p_mask(sorted_probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens at least min_p times as likely as the most likely one (sorted position 0).
    sorted_probs: [rows, vocab] descending; min_p: [rows] -> mask [rows, vocab]."""
    return sorted_probs >= min_p[:, None] * sorted_probs[:, :1]

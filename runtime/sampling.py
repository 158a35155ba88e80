"""Choosing the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling.

Filtering is vectorized over the batch (per-row k, p and min-p are tensors); only the final draw loops
over rows, because each row draws with its own generator. That is what makes a seeded request
reproducible whatever else shares its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Temperatures below this act as greedy: dividing logits by a tiny temperature overflows fp32.
MIN_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts [0, 2**64)


class SamplingError(ValueError):
    """Sampling parameters outside their allowed range."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 64  # number of new tokens, >= 1
    temperature: float = 0.0  # 0 -> greedy (argmax); must be >= 0
    top_k: int = 0  # 0 -> off; else keep the k most likely tokens
    top_p: float = 1.0  # in (0, 1]: keep the smallest set of tokens whose probability reaches top_p
    min_p: float = 0.0  # in [0, 1): drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # per-request reproducibility, independent of batch composition
    stop: list[str] = field(default_factory=list)  # generation ends before any of these strings
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends on any of these ids
    ignore_eos: bool = False  # keep going past the tokenizer's EOS ids (benchmarks)

    def __post_init__(self) -> None:
        """Reject out-of-range values with a message naming the field, the value and what is allowed."""
        self._require("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1")
        self._require("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number >= 0")
        self._require("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 means off)")
        self._require("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        self._require("min_p", _is_number(self.min_p) and 0 <= self.min_p < 1, "in [0, 1)")
        self._require("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
                      f"None or an int in [0, {MAX_SEED}]")
        self._require("stop", isinstance(self.stop, (list, tuple))
                      and all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings")
        self._require("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple))
                      and all(_is_int(i) and i >= 0 for i in self.stop_token_ids), "a list of ints >= 0")
        self._require("ignore_eos", isinstance(self.ignore_eos, bool), "True or False")
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)

    def _require(self, name: str, ok: bool, allowed: str) -> None:
        if not ok:
            value = getattr(self, name)
            if allowed.startswith(("in ", "True")):
                raise SamplingError(f"{name}: {value!r} is not {allowed}")
            raise SamplingError(f"{name}: {value!r} is not allowed; it must be {allowed}")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (no randomness, no generator needed)."""
        return self.temperature < MIN_TEMPERATURE


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request on ``device``; None (the global RNG) when there is no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Pick the next token of each sequence.

    logits: [num_seqs, vocab] (any float dtype); returns ids [num_seqs] (int64, same device).
    Greedy rows take the argmax. Sampled rows: fp32 logits / temperature, then top-k, then top-p
    (smallest set whose cumulative probability >= top_p, always keeping the top token), then min-p,
    then one draw with that row's generator. A row's token depends only on its own logits, params
    and generator, never on the other rows.
    """
    num_seqs = logits.shape[0]
    if len(params) != num_seqs or len(generators) != num_seqs:
        raise ValueError(f"sample: {num_seqs} rows of logits but {len(params)} params "
                         f"and {len(generators)} generators")
    logits = logits.float()  # logits: [num_seqs, vocab]
    out = torch.argmax(logits, dim=-1)  # out: [num_seqs]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    row_index = torch.tensor(rows, device=logits.device)  # row_index: [num_sampled]
    chosen = [params[i] for i in rows]
    probs = _filtered_probs(logits.index_select(0, row_index), chosen)  # probs: [num_sampled, vocab]
    for j, i in enumerate(rows):
        out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return out


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, in vocabulary order.

    logits: [rows, vocab] fp32. Filtering runs in descending-probability order (one sort per row); the
    resulting keep-mask is scattered back so the draw happens in vocabulary order, which keeps a row's
    result the same whether or not its batch needed sorting."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [rows]
    logits = logits / temperature[:, None]  # logits: [rows, vocab]
    if all(p.top_k == 0 and p.top_p >= 1 and p.min_p == 0 for p in params):
        return torch.softmax(logits, dim=-1)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)  # [rows]
    top_p = torch.tensor([p.top_p for p in params], device=device)  # [rows]
    min_p = torch.tensor([p.min_p for p in params], device=device)  # [rows]

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
    it is still below top_p. The top token always stays (the mass before it is exactly 0 < top_p);
    top_p == 1 keeps everything, so fp32 rounding of the cumulative sum cannot drop rare tokens.
    sorted_probs: [rows, vocab] descending; top_p: [rows] -> mask [rows, vocab]."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass_before: [rows, vocab]
    return (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)


def _min_p_mask(sorted_probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens at least min_p times as likely as the most likely one (sorted position 0).
    sorted_probs: [rows, vocab] descending; min_p: [rows] -> mask [rows, vocab]."""
    return sorted_probs >= min_p[:, None] * sorted_probs[:, :1]

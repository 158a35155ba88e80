"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one step.

A decode request with k draft tokens d_1..d_k is fed to the target as k + 1 tokens (its last sampled token, then
the drafts) at consecutive positions, through the same varlen path as a prompt chunk, and every one of the k + 1
rows gets logits. Row j's logits are the target's distribution p_j for the token after d_1..d_j, so one forward
scores every prefix of the draft (``runtime.serving.ServingEngine`` packs, samples and records the step):

    fed:      t      d_1    d_2   ...   d_k        positions n-1, n, ..., n-1+k of the KV cache
    logits:   p_0    p_1    p_2   ...   p_k
    target:   x_0    x_1    x_2   ...   x_k        x_j: the token the sampler picks from p_j
    emitted:  d_1 .. d_a while d_j == x_{j-1}, then x_a (the correction, or the bonus token when a == k)

Exactness (``accept_drafts``, ``accept_rows``): x_j is drawn exactly as a non-speculative step would draw it (same
sampler, same per-request generator, consumed in the same order; the generator is rewound to just after x_a, so the
draws of rows past it are never used). Greedy rows take the argmax, so greedy output is token for token what
non-speculative decoding emits. With sampling, this is rejection sampling for a one-hot draft distribution (the
n-gram proposer's, or any greedy draft): d_j is accepted with probability p_{j-1}(d_j) (x_{j-1} == d_j), and on
rejection the emitted x_{j-1} is a draw from p_{j-1} conditioned on differing from d_j, i.e. p_{j-1} with d_j
removed and renormalised; when every draft is accepted the bonus x_k is a draw from p_k. The output distribution is
the target's, and a seeded request draws the tokens it draws without speculation. Both hold up to the
floating-point differences between one k + 1-token step and k + 1 one-token steps (other kernels, other summation
orders), which can flip a near-tie: not seen in fp32, seen with a bf16 artifact on a GPU where the top two logits
were less than 0.1 apart. A proposer with a non-one-hot draft distribution q (a draft model sampling at a
temperature) would need the general rule, accept with min(1, p(d) / q(d)) and resample from max(p - q, 0)
renormalised, in place of ``accept_drafts``; none exists yet.

KV cache: the drafts' slots are reserved as lookahead slots (``KVCacheManager.allocate_slots``, never published
to the prefix cache); after verification the accepted drafts' slots are committed and the blocks past the
request's last committed token are returned (``KVCacheManager.free_lookahead``). On CUDA a verify step replays the
graphs of steps carrying prefill (``runtime.cuda_graphs.StepGraphs``), but synchronously: the next step's drafts
depend on its tokens, so the overlapped pipeline cannot launch ahead of it. A proposer that drafts on the device
returns ``PendingDrafts`` from ``propose_pending``: the verify step is fed the drafts there, and they are read back
with its tokens, so a speculative step waits for the device once.

Proposers (``Proposer``): ``NgramProposer`` (prompt lookup over the request's own prompt and output) and
``runtime.draft_model.DraftModelProposer`` (a second artifact of the same vocabulary with its own engine and KV
cache, k greedy tokens: one-hot q, so the verification above applies as is; ``release`` frees its per-request
state). ``runtime.eagle.EagleProposer`` (an EAGLE-1/2 head: one or a few decoder layers over the target's own final
hidden states and the next token, the target's embedding and lm_head; or an EAGLE-3 head over the target's residual
streams at a few layers, with its own draft vocabulary; ``needs_hidden``: the serving engine hands it every step's
hidden states of the requests that may speculate, ``record_hidden``). MTP heads are not implemented.

Adaptivity (``SpeculationPolicy``): no speculation in a step with more than ``max_running`` decoding requests
(the target step stops being bandwidth-bound and drafts cost real compute); per request, the number of drafts
falls to one more than were accepted after a miss, and after a step whose drafts were all accepted goes back to k
(n-gram drafts cost nothing to make) or grows by one (a draft model's); speculation stops for
``PROBE_INTERVAL`` engine steps when the acceptance rate (an EWMA of accepted / proposed) falls below
``min_acceptance``, then probes again with one draft. And by measurement (``RateCheck``, ``min_gain``): the engine
times its decode steps with and without drafts, per number of decoding requests, and speculates only while the
decoding requests' tokens per second with drafts are at least ``min_gain`` times those without; the mode not in use
is probed for ``RATE_PROBE_STEPS`` of every ``RATE_CYCLE_STEPS`` engine steps. Acceptance alone cannot say whether
speculation pays: a verify step and the draft's proposal cost what they cost on this machine (at batch 1 a small
model's steps are host time, and the bundled draft at 63% acceptance decodes slower than no draft, session 36).
"""

from __future__ import annotations

import abc
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from runtime.env import env_number

if TYPE_CHECKING:  # the config is read by the server's command line before torch is imported
    import torch

# proposers implemented ("draft": a draft-model artifact; "eagle": an EAGLE-1/2/3 head over the target's hidden
# states, runtime.eagle); MTP heads are not yet
METHODS = ("ngram", "draft", "eagle")
MAX_SPECULATIVE_TOKENS = 16  # most draft tokens per request and step
# num_speculative_tokens when a section leaves it out. n-gram drafts cost nothing to make and a verify step costs
# about the same for k = 1-8 (Llama-3-8B shape and the bundled model, H100, session 24): bundled model, code-editing
# prompts, on the H200 k = 8 gave 1.497x against 1.428x at k = 4 (docs/BENCHMARKS.md, session 41). With n-grams of 3-6
# tokens (the n-gram defaults below), k = 12 (session 45, CPU counts of verify steps and tokens under the bundled
# model's measured verify cost of ~2 plain steps: 1.54x -> 1.71x estimated on the code-editing prompts, 1.93x -> 2.08x
# on held-out text; not yet measured on a GPU). A draft model pays one forward per draft: 4
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 12, "draft": 4, "eagle": 4}
ACCEPTANCE_EWMA_WEIGHT = 0.3  # weight of the newest verified step in a request's acceptance rate
# engine steps a request runs without drafts once its acceptance fell below min_acceptance; 8 (was 32): a copy
# workload's acceptance dips where the model stops copying and recovers a few tokens later (the bundled model on
# code-editing prompts, CPU: 1.62x -> 1.85x at k = 4, docs/BENCHMARKS.md, session 40)
PROBE_INTERVAL = 8
RATE_CYCLE_STEPS = 256  # RateCheck: every this many engine steps, the mode not in use is probed ...
RATE_PROBE_STEPS = 16  # ... for this many steps
RATE_MIN_SAMPLES = 6  # timed steps of both modes (at one batch size) before the rates decide
RATE_EWMA_WEIGHT = 0.2  # weight of the newest timed step in a mode's rate


class SpeculativeConfigError(ValueError):
    """A speculative decoding setting outside what is allowed."""


def _env(name: str, default: float, kind: type, low: float, high: float | None = None) -> Any:
    """A setting's default from the environment variable ``name``, checked here so that an error names the
    variable (the user set no field)."""
    value = env_number(name, default, kind, SpeculativeConfigError)
    if not (value >= low and (high is None or value <= high)):  # NaN fails
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise SpeculativeConfigError(f"{name}={os.environ.get(name)!r} is not {allowed} (unset it for the default "
                                     f"{default})")
    return value


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (the ``speculative`` section of the serving config). ``method`` None: off."""

    method: str | None = None  # None (off) or one of METHODS
    # most draft tokens per request and step (k), 1..MAX_SPECULATIVE_TOKENS; None: the method's default
    # (DEFAULT_SPECULATIVE_TOKENS), set when the config is made
    num_speculative_tokens: int | None = None
    # n-gram: the last n tokens (n from max_ngram down to min_ngram) are looked up in the request's earlier tokens;
    # 3-6 (were 2-4): fewer verify steps, each accepting more (session 45: 2.70 -> 4.00 tokens a verify on the
    # code-editing prompts, 4.27 -> 5.79 on held-out text, with k = 12), which pays wherever a verify step costs more
    # than a plain one
    min_ngram: int = 3
    max_ngram: int = 6
    # draft: the draft model's artifact directory (same tokenizer as the target, built by the same toolchain);
    # eagle: the EAGLE head's checkpoint directory (config.json and model.safetensors, runtime.eagle)
    draft_model: str | None = None
    # no speculation in a step with more decoding requests than this; default from RUNTIME_SPEC_MAX_RUNNING, else 8
    max_running: int = field(default_factory=lambda: _env("RUNTIME_SPEC_MAX_RUNNING", 8, int, 1))
    # a request stops speculating (for PROBE_INTERVAL engine steps) while its acceptance rate, an EWMA of accepted /
    # proposed drafts, is below this; in [0, 1], 0 never stops; default from RUNTIME_SPEC_MIN_ACCEPTANCE, else 0.2
    min_acceptance: float = field(default_factory=lambda: _env("RUNTIME_SPEC_MIN_ACCEPTANCE", 0.2, float, 0, 1))
    # speculate only while the decoding requests' measured tokens per second with drafts are at least min_gain times
    # those without (RateCheck); >= 0, 0 never stops for it; default from RUNTIME_SPEC_MIN_GAIN, else 1.0
    min_gain: float = field(default_factory=lambda: _env("RUNTIME_SPEC_MIN_GAIN", 1.0, float, 0))
    # False: every request asks for num_speculative_tokens drafts at every step, whatever its acceptance or the
    # rates (the step limit max_running still holds); for measuring a verify step's cost (builder.bench.speculative)
    adaptive: bool = True

    def __post_init__(self) -> None:
        """Reject out-of-range values with a message naming the field, the value and what is allowed."""
        if self.method is not None and self.method not in METHODS:
            planned = " (MTP head proposers are not implemented yet)" if self.method == "mtp" else ""
            raise SpeculativeConfigError(f"speculative method {self.method!r} is not available{planned}; use one of "
                                         f"{', '.join(METHODS)}, or leave method unset (None) for no speculation")
        if self.num_speculative_tokens is None and self.method is not None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS[self.method]
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS), ("min_ngram", 1, None),
                                ("max_ngram", 1, None), ("max_running", 1, None)):
            value = getattr(self, name)
            if value is None and name == "num_speculative_tokens":  # no method: nothing to draft
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                allowed = f"in [{low}, {high}]" if high else f">= {low}"
                raise SpeculativeConfigError(f"speculative {name}: {value!r} is not an int {allowed}")
        if (self.method in ("draft", "eagle")) != (self.draft_model is not None):
            raise SpeculativeConfigError("speculative methods 'draft' and 'eagle' need draft_model (the draft "
                                         "artifact's directory, or the EAGLE head checkpoint's), and draft_model "
                                         f"needs one of them; got method {self.method!r} and draft_model "
                                         f"{self.draft_model!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise SpeculativeConfigError(f"speculative draft_model: {self.draft_model!r} is not a path (a string)")
        if self.min_ngram > self.max_ngram:
            raise SpeculativeConfigError(f"speculative min_ngram {self.min_ngram} is above max_ngram "
                                         f"{self.max_ngram}; pick min_ngram <= max_ngram")
        if not isinstance(self.adaptive, bool):
            raise SpeculativeConfigError(f"speculative adaptive: {self.adaptive!r} is not true or false")
        if isinstance(self.min_acceptance, bool) or not isinstance(self.min_acceptance, (int, float)) \
                or not 0 <= self.min_acceptance <= 1:
            raise SpeculativeConfigError(f"speculative min_acceptance: {self.min_acceptance!r} is not a number in "
                                         f"[0, 1] (0: never stop speculating)")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not self.min_gain >= 0:
            raise SpeculativeConfigError(f"speculative min_gain: {self.min_gain!r} is not a number >= 0 (the least "
                                         f"measured speedup speculation must keep; 0: never stop for it)")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> SpeculativeConfig:
        """The config from a ``speculative`` section (a dict, e.g. parsed JSON); unknown keys are refused."""
        if not isinstance(section, dict):
            raise SpeculativeConfigError(f"the speculative section must be an object of settings, got "
                                         f"{type(section).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise SpeculativeConfigError(f"unknown speculative setting(s) {', '.join(map(repr, unknown))}; "
                                         f"known: {', '.join(sorted(known))}")
        return cls(**section)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config from a JSON object (``--speculative-config``)."""
        try:
            section = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"the speculative config is not valid JSON: {e}") from None
        return cls.from_dict(section)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- proposers ---------------------------------------------------------------------------------------------------
@dataclass
class DraftRequest:
    """One decoding request a proposer is asked to draft for."""

    request_id: str
    token_ids: Sequence[int]  # prompt, then generated tokens; the last one is fed to the target in this step
    max_tokens: int  # most draft tokens wanted (>= 1)


class PendingDrafts:
    """Drafts still on the device (a draft model's chain queued, not waited for): per request, the indices of its
    drafts in the flat tensor ``tokens``, in order. The serving engine feeds them to the verify step on the device
    (its draft rows' inputs) and reads them with the verify step's tokens: one wait per speculative step instead of
    two, and the host packs the verify step while the device drafts. ``resolve`` reads them back (once) and runs
    ``on_read`` with them, the proposer's bookkeeping of what its caches hold; it must be called before the next
    proposal, which reuses the buffer behind ``tokens``."""

    def __init__(self, tokens: torch.Tensor, sources: list[list[int]],
                 on_read: Callable[[list[list[int]]], None] | None = None) -> None:
        self.tokens, self.sources = tokens, sources
        self._on_read = on_read
        self._values: list[list[int]] | None = None

    @property
    def counts(self) -> list[int]:
        """Drafts per request, known before their values."""
        return [len(s) for s in self.sources]

    def resolve(self, flat: list[int] | None = None) -> list[list[int]]:
        """The drafts' values, per request (read back the first time, waiting for the device; ``flat``: the
        values of ``tokens``, read by the caller with its own)."""
        if self._values is None:
            if flat is None:
                flat = self.tokens.tolist() if any(self.sources) else []
            self._values = [[flat[i] for i in src] for src in self.sources]
            if self._on_read is not None:
                self._on_read(self._values)
        return self._values


class Proposer(abc.ABC):
    """Proposes draft tokens for decoding requests; the target verifies them (see the module docstring).

    Drafts must be deterministic given the request's tokens (a one-hot draft distribution), which is what
    ``accept_drafts`` verifies exactly."""

    method: ClassVar[str]

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Up to ``max_tokens`` draft tokens per request (possibly none), in the order given."""

    def propose_pending(self, requests: Sequence[DraftRequest]) -> list[list[int]] | PendingDrafts:
        """As ``propose``, but a proposer that drafts on the device may return its drafts before they are computed
        (``PendingDrafts``); the caller resolves them before it proposes again. By default: ``propose``."""
        return self.propose(requests)

    def may_propose(self, token_ids: Sequence[int], request_id: str | None = None) -> bool:
        """Whether proposing for a request whose known tokens are ``token_ids`` would likely give drafts. The engine
        asks before a step leaves the overlapped pipeline for the synchronous one (where the tokens are one step
        behind): a proposer that often has nothing to offer would otherwise cost every step its overlap. Cheap and
        without side effects beyond the proposer's own bookkeeping of ``request_id``; True by default (a draft
        model always drafts)."""
        return True

    def release(self, request_id: str) -> None:
        """Forget a finished request (a proposer with per-request state, e.g. a draft model's KV cache)."""

    def weights_bytes(self) -> int:
        """Device memory the proposer's weights take (a draft model's), planned beside the target's weights."""
        return 0

    def kv_bytes(self) -> int:
        """The most device memory the proposer's own caches take (a draft model's), reserved beside the KV pool."""
        return 0

    def close(self) -> None:
        """Release what outlives the proposer (a draft model's CUDA graphs); the serving engine's close calls it."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the request's last n tokens.

    n runs from ``max_ngram`` down to ``min_ngram``; the longest n with an earlier occurrence wins, since a longer
    match predicts its continuation better. The continuation is read from the tokens with the drafts appended as
    they are made, so a repeating stretch keeps being drafted past the end of the known tokens (tokens
    ``...A B C A B`` with the match ``A B`` give ``C A B C ...``)."""

    method = "ngram"

    def __init__(self, min_ngram: int = 3, max_ngram: int = 6) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise SpeculativeConfigError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got min_ngram "
                                         f"{min_ngram} and max_ngram {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        # per request (its token list, which only grows): where each min_ngram-gram ended, kept up as it grows, so a
        # step looks up its suffix's earlier occurrences instead of scanning every position (50-150 us of Python a
        # call at 400-2,000 tokens on the 2-core CPU, twice a step: may_propose, then propose); released with the
        # request, most recent last
        self._indexes: OrderedDict[str, _NgramIndex] = OrderedDict()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(r.token_ids, r.max_tokens, r.request_id) for r in requests]

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def may_propose(self, token_ids: Sequence[int], request_id: str | None = None) -> bool:
        """Whether the tokens' suffix recurs (one step behind, the next suffix usually does too, and does not
        where the text has no repeats: random prompts measured 0.87-0.91x throughput on an H100 when every step
        left the pipeline to find no draft)."""
        return self._match(token_ids, request_id) is not None

    def propose_one(self, token_ids: Sequence[int], max_tokens: int, request_id: str | None = None) -> list[int]:
        """Up to ``max_tokens`` drafts following ``token_ids`` (none when no n-gram of the allowed sizes recurs);
        ``request_id``: the request whose tokens they are, looked up in its index (else scanned)."""
        if max_tokens < 1:
            raise SpeculativeConfigError(f"max_tokens must be >= 1 to draft, got {max_tokens}")
        start = self._match(token_ids, request_id)
        if start is None:
            return []
        num_tokens, drafts = len(token_ids), []
        for i in range(start, start + max_tokens):  # past the known tokens, the continuation reads the drafts
            drafts.append(token_ids[i] if i < num_tokens else drafts[i - num_tokens])
        return drafts

    def _match(self, token_ids: Sequence[int], request_id: str | None = None) -> int | None:
        """Where the continuation starts: the position after the most recent earlier occurrence of the longest
        suffix of ``max_ngram`` .. ``min_ngram`` tokens, or None. A request's token list is looked up in its index:
        the earlier occurrences of its last ``min_ngram`` tokens, most recent first, each extended backwards; any
        other sequence, or one without a request id, is scanned (``_scan``, the same answer)."""
        num_tokens = len(token_ids)
        if num_tokens <= self.min_ngram:
            return None
        if request_id is None or not isinstance(token_ids, list):
            return self._scan(token_ids)
        index = self._index(request_id, token_ids)
        index.extend(num_tokens - 1, self.min_ngram)  # occurrences ending before the last token
        ends = index.ends.get(tuple(token_ids[num_tokens - self.min_ngram:]))
        if not ends:
            return None
        best_len, best_start = 0, None
        longest = min(self.max_ngram, num_tokens - 1)
        for end in reversed(ends):  # the min_ngram tokens ending at ``end`` match the suffix's
            length = self.min_ngram
            while length < longest and length <= end and token_ids[end - length] == token_ids[-1 - length]:
                length += 1
            if length > best_len:  # most recent first: a tie keeps the more recent occurrence
                best_len, best_start = length, end + 1
                if length == longest:
                    break
        return best_start

    def _index(self, request_id: str, token_ids: list[int]) -> _NgramIndex:
        index = self._indexes.get(request_id)
        if index is None or index.tokens is not token_ids or index.count > len(token_ids):
            index = self._indexes[request_id] = _NgramIndex(token_ids)
        self._indexes.move_to_end(request_id)
        while len(self._indexes) > _MAX_NGRAM_INDEXES:  # requests that finished without a release
            self._indexes.popitem(last=False)
        return index

    def _scan(self, token_ids: Sequence[int]) -> int | None:
        """``_match`` by one backward scan over the end positions of the last token's earlier occurrences; the
        first full-length match ends it."""
        num_tokens = len(token_ids)
        last = token_ids[-1]
        best_len, best_start = 0, None
        longest = min(self.max_ngram, num_tokens - 1)
        for end in range(num_tokens - 2, self.min_ngram - 2, -1):  # end: the occurrence's last position
            if token_ids[end] != last:
                continue
            length = 1
            while length < longest and length <= end and token_ids[end - length] == token_ids[-1 - length]:
                length += 1
            if length > best_len:  # scanning backwards: a tie keeps the more recent occurrence
                best_len, best_start = length, end + 1
                if length == longest:
                    break
        return best_start if best_len >= self.min_ngram else None


# requests an n-gram proposer keeps an index of at most (each is released when its request finishes; the requests
# that speculate at once are max_running, 8 by default)
_MAX_NGRAM_INDEXES = 4096


class _NgramIndex:
    """Where each n-gram of one token list ended (its end positions, ascending), for the n-grams ending before
    position ``count``; the list only grows (a request's tokens), and is indexed again if it is replaced or
    shortened."""

    __slots__ = ("tokens", "ends", "count")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.count = 0

    def extend(self, upto: int, n: int) -> None:
        """Index the n-grams ending at positions ``count`` .. ``upto - 1``."""
        tokens, ends = self.tokens, self.ends
        for end in range(max(self.count, n - 1), upto):
            ends.setdefault(tuple(tokens[end - n + 1:end + 1]), []).append(end)
        self.count = max(self.count, upto)


# --- verification ------------------------------------------------------------------------------------------------
def accept_drafts(target_tokens: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """The tokens a verified decode emits: the drafts up to the first one that differs from the target's token at
    its position, then the target's token there (or the bonus token after the last draft when all match).

    target_tokens: [k + 1] the token the target's sampler picked at each fed position (see the module docstring
    for why this is exact); draft_tokens: [k]. Returns between 1 and k + 1 tokens."""
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"accept_drafts: {len(draft_tokens)} drafts need {len(draft_tokens) + 1} target tokens, "
                         f"got {len(target_tokens)}")
    num_accepted = 0
    while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return list(draft_tokens[:num_accepted]) + [target_tokens[num_accepted]]


def accept_rows(target_tokens: Sequence[int], draft_tokens: Sequence[Sequence[int]],
                generators: Sequence[torch.Generator | None],
                draw_states: Sequence[torch.Tensor | None]) -> list[list[int]]:
    """Split a step's sampled rows by request and verify each (``accept_drafts``): what every request emits.

    target_tokens: one token per logits row, as ``runtime.sampling.sample`` picked them; a request with k drafts
    (``draft_tokens``, [] for a plain decode) owns k + 1 consecutive rows, in order. generators: each request's
    own (None: the global RNG); draw_states: per row, its generator's state after the row's draw (``sample``'s
    ``generator_states``). A request that keeps fewer rows than it drew has its generator rewound to just after
    the last draw kept, so its next step draws as it would have after that many one-token steps."""
    emitted, row = [], 0
    for drafts, generator in zip(draft_tokens, generators, strict=True):
        num_rows = len(drafts) + 1
        tokens = accept_drafts(target_tokens[row:row + num_rows], drafts)
        last = row + len(tokens) - 1
        if len(tokens) < num_rows and generator is not None and draw_states[last] is not None:
            generator.set_state(draw_states[last])
        emitted.append(tokens)
        row += num_rows
    if row != len(target_tokens):
        raise ValueError(f"accept_rows: the drafts account for {row} rows, the step sampled {len(target_tokens)}")
    return emitted


# --- adaptivity --------------------------------------------------------------------------------------------------
@dataclass
class DraftState:
    """One request's speculation state (kept across preemption, dropped when it finishes)."""

    num_draft: int  # drafts to ask for next time
    acceptance: float = 1.0  # EWMA of accepted / proposed drafts over its verified steps
    resume_step: int = 0  # no drafts before this engine step (its acceptance fell below min_acceptance)


class RateCheck:
    """Whether speculating pays, measured (module docstring): per number of decoding requests, an EWMA of the tokens
    per second they get with drafts and one without, from the engine's timed decode steps. The mode chosen is the
    faster (speculation while its rate is at least ``min_gain`` times the other's, and until both are measured);
    the first ``RATE_PROBE_STEPS`` of every ``RATE_CYCLE_STEPS`` engine steps run the other mode, so both stay
    measured as the load and the text change."""

    def __init__(self, min_gain: float) -> None:
        self.min_gain = min_gain
        self.rates: dict[tuple[int, bool], float] = {}  # (decoding requests, speculated) -> tokens per second
        self.samples: dict[tuple[int, bool], int] = {}
        self.chosen: dict[int, bool] = {}  # decoding requests -> speculate (absent: yes, until measured)
        self.last: int | None = None  # the number of decoding requests last timed

    def speculates(self, num_decoding: int, step: int) -> bool:
        chosen = self.chosen.get(num_decoding, True)
        return chosen != (step % RATE_CYCLE_STEPS < RATE_PROBE_STEPS)  # a probe runs the other mode

    def record(self, num_decoding: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """One decode step of ``num_decoding`` requests, with drafts or not: ``num_tokens`` emitted in ``seconds``
        (the step's wall time, from the end of the step before)."""
        if seconds <= 0 or num_tokens <= 0:
            return
        key = (num_decoding, speculated)
        self.last = num_decoding
        rate = num_tokens / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + RATE_EWMA_WEIGHT * (rate - old)
        self.samples[key] = self.samples.get(key, 0) + 1
        if min(self.samples.get((num_decoding, m), 0) for m in (True, False)) >= RATE_MIN_SAMPLES:
            self.chosen[num_decoding] = \
                self.rates[num_decoding, True] >= self.min_gain * self.rates[num_decoding, False]

    def gain(self, num_decoding: int) -> float | None:
        """The measured rate with drafts over the rate without, at ``num_decoding`` requests (None: not both)."""
        spec, plain = self.rates.get((num_decoding, True)), self.rates.get((num_decoding, False))
        return spec / plain if spec is not None and plain else None


class SpeculationPolicy:
    """When and how much to speculate: per step by load and by the measured rates, per request by its acceptance
    (module docstring). Steps are counted by the engine's step counter, whichever path (synchronous, overlapped)
    ran them."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.rate_check = RateCheck(config.min_gain) \
            if config.enabled and config.adaptive and config.min_gain > 0 else None

    def new_state(self) -> DraftState:
        return DraftState(self.config.num_speculative_tokens)

    def step_allows(self, num_decoding: int, step: int | None = None) -> bool:
        """Whether a step with ``num_decoding`` decoding requests speculates at all (``step``: the engine step, for
        the rate check; None leaves it out)."""
        if not (self.config.enabled and num_decoding <= self.config.max_running):
            return False
        return step is None or self.rate_check is None or self.rate_check.speculates(num_decoding, step)

    def record_step(self, num_decoding: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A timed decode step, for the rate check (see ``RateCheck.record``)."""
        if self.rate_check is not None and num_decoding <= self.config.max_running:
            self.rate_check.record(num_decoding, speculated, num_tokens, seconds)

    def num_draft(self, state: DraftState, step: int) -> int:
        """Drafts to ask for in engine step ``step`` (0 while the request is paused)."""
        if not self.config.adaptive:
            return self.config.num_speculative_tokens
        return state.num_draft if step >= state.resume_step else 0

    def update(self, state: DraftState, num_proposed: int, num_accepted: int, step: int) -> None:
        """Record a verified step: adapt the next number of drafts, and pause a request whose acceptance fell."""
        assert 0 <= num_accepted <= num_proposed and num_proposed > 0, (num_proposed, num_accepted)
        if not self.config.adaptive:
            return
        k_max = self.config.num_speculative_tokens
        state.acceptance += ACCEPTANCE_EWMA_WEIGHT * (num_accepted / num_proposed - state.acceptance)
        if num_accepted < num_proposed:
            state.num_draft = min(num_accepted + 1, k_max)
        else:  # n-gram drafts cost nothing to make: all k again; a draft model's grow one at a time
            state.num_draft = k_max if self.config.method == "ngram" else min(state.num_draft + 1, k_max)
        if state.acceptance < self.config.min_acceptance:
            # probe again later with one draft, starting from the threshold: one good step resumes, a bad one pauses
            state.resume_step, state.num_draft = step + PROBE_INTERVAL, 1
            state.acceptance = self.config.min_acceptance

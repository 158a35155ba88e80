"""What the serving engine hands back per request and step, and what it reports about itself.

These cross the boundary from the engine's step loop (one thread) to the server (the event loop), so
they are plain values: no tensors, no references into the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability, with the most likely alternatives at that position."""

    token_id: int
    logprob: float  # log p(token) under the model's raw distribution (before penalties/temperature)
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first; len == requested top-n


@dataclass
class RequestOutput:
    """A delta: what one request produced in one engine step (streamed), plus its totals so far."""

    request_id: str
    text: str  # new text made stable this step (may be "", e.g. mid-character or held back by a stop string)
    token_ids: list[int]  # new token ids this step
    logprobs: list[TokenLogprob] | None  # one per new token if the request asked for logprobs, else None
    finished: bool
    finish_reason: str | None  # when finished: "stop", "length", "abort", "timeout" or "error"
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far, including this step's
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    error: str | None = None  # with finish_reason "error" or "timeout": what happened


@dataclass
class EngineStats:
    """A snapshot of the engine for /metrics and logs."""

    num_running: int  # requests in the running batch
    num_waiting: int  # admitted requests not yet running (including preempted ones)
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_blocks: int  # KV blocks in the pool
    num_free_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of those, tokens found (cumulative)
    num_preemptions: int  # cumulative
    num_steps: int  # cumulative engine steps that ran the model
    # speculative decoding (runtime.speculative), cumulative; all 0 when it is off
    spec_num_steps: int = 0  # engine steps that verified draft tokens
    spec_num_verified: int = 0  # decodes verified with drafts (one request in one step)
    spec_num_draft_tokens: int = 0  # draft tokens proposed and verified
    spec_num_accepted_tokens: int = 0  # of those, accepted (each verified decode also emits one token of its own)
    # the rate check (runtime.speculative.RateCheck) at the number of decoding requests it last timed: tokens per
    # second with drafts over without (0 until both are measured), and whether it lets drafts run there (1) or not (0)
    spec_measured_gain: float = 0.0
    spec_drafting: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens since start (0 before any)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_tokens(self) -> float:
        """Accepted draft tokens per verified decode since start (tokens emitted per verified decode: this + 1)."""
        return self.spec_num_accepted_tokens / self.spec_num_verified if self.spec_num_verified else 0.0


def merge_deltas(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one (text, token ids and logprobs joined; totals and finish from the
    last): what a stream sends when it fell behind by several steps."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    logprobs = None if all(o.logprobs is None for o in outs) else [e for o in outs for e in (o.logprobs or [])]
    return RequestOutput(last.request_id, "".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
                         logprobs, last.finished, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                         last.num_cached_tokens, last.error)

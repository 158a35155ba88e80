"""Iteration-level scheduling (continuous batching): which requests run in the next step, and how many
of their tokens.

Layers, each knowing only its own things:

    Scheduler        budgets and policy: token and sequence budgets, admission, preemption
    KVCacheManager   requests -> block tables, prefix-cache lookups (runtime.kv_manager)
    BlockPool        blocks, reference counts, LRU free queue (runtime.block_pool)

One step, built by ``schedule``:

    1. running requests with one token pending (decodes), oldest first, each with the speculative draft
       tokens the serving engine proposed for it (``schedule(drafts)``), within the token budget
    2. running requests with more pending (a prompt being prefilled in chunks, or a preempted request
       recomputing), oldest first, each taking what is left of the token budget
    3. waiting requests, oldest first, while there is token budget, a free sequence slot, and KV blocks;
       the last one admitted may get only a chunk of its prompt (chunked prefill). While requests decode,
       new prompts may be held back briefly to be prefilled together (``SchedulerConfig.prefill_hold_s``)

    packed step: | decode | decode | ... | prefill chunk | prefill chunk | new prompt (or its chunk) |
                 |<----------------- at most max_num_batched_tokens tokens ------------------------->|

When a running request cannot get a block, the most recently admitted running request not yet
scheduled in this step is preempted: its blocks are freed (its full blocks stay in the prefix cache
until evicted) and it goes back to the front of the waiting queue with its generated tokens, to be
recomputed later - usually mostly from the prefix cache. No request is admitted in a step that
preempted, so a preempted request is never overtaken.

A request may arrive not yet ready to run (its structured-output grammar still compiling off the step thread):
it is PREPARING, counts against the waiting queue's bound and can be finished, but is not scheduled until
``mark_ready`` moves it to the back of the waiting queue, so a large grammar never holds up the requests behind it.

NOTE (write before read): prefix-cache blocks are registered when allocated, before the step writes
them, so a request admitted in this step can hit blocks another request of the same step is filling.
The pack order is the scheduling order, and a hit always refers to a block allocated earlier in it (or
in an earlier step). The executor's attention writes each sequence's new K/V before the sequences
after it in the pack read the cache, so the hit reads computed values.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from runtime.executor import LONG_ROPE_OFFSET
from runtime.kv_manager import KVCacheManager
from runtime.sampling import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is full: the request is rejected at once (HTTP 429)."""


class RequestStatus(enum.Enum):
    PREPARING = "preparing"  # admitted, not schedulable yet (its grammar is compiling)
    WAITING = "waiting"  # admitted, not holding blocks (new, or preempted)
    RUNNING = "running"  # holds blocks; in the running batch
    FINISHED = "finished"


@dataclass
class SchedulerConfig:
    """Budgets of the scheduler."""

    max_num_seqs: int  # most requests in the running batch
    max_num_batched_tokens: int  # most tokens in one step (decodes + prefill chunks)
    max_seq_len: int  # most tokens of one request, prompt plus generated
    max_waiting: int = 256  # most new requests queued; past it, add_request raises QueueFullError
    # While requests are decoding, new prompts wait up to prefill_hold_s (from the oldest one's arrival) unless
    # prefill_hold_tokens or more of their tokens are waiting, so that they are prefilled together and the steps
    # between them stay decode-only (a decode-only step replays a CUDA graph; one carrying a prompt runs eagerly).
    # 0: admit at once. With fewer than prefill_hold_min_running requests running the hold does not apply: a small
    # batch gains little from fewer eager steps, and a prompt at low load would only wait.
    prefill_hold_s: float = 0.0
    prefill_hold_tokens: int = 0
    prefill_hold_min_running: int = 16
    # LongRoPE's switch (runtime.executor.long_rope_from): a request longer than this many tokens runs on the second
    # rotary table throughout; one that grows past it while running is recomputed (Request.long_rope). None: no
    # LongRoPE
    long_rope_from: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 1:  # every request is admitted through the waiting queue: 0 would admit none
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not self.prefill_hold_s >= 0 or self.prefill_hold_tokens < 0:
            raise ValueError(f"prefill_hold_s and prefill_hold_tokens must be >= 0, got {self.prefill_hold_s} and "
                             f"{self.prefill_hold_tokens}")


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which the request is aborted (timeout)
    token_ids: list[int] = field(init=False)  # prompt, then generated tokens
    num_computed_tokens: int = 0  # leading token_ids whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission (-1: not yet)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    order: int = field(default_factory=lambda: next(_ids))  # admission order, for stable tie-breaks
    # past LongRoPE's switch: its positions are offset onto the second rotary table (runtime.executor.LONG_ROPE_OFFSET),
    # and its KV blocks hash apart from the first table's (kv_extra); set once, never cleared
    long_rope: bool = False

    @property
    def kv_extra(self) -> tuple:
        """What this request's KV block hashes carry besides the tokens: the rotary table its keys were made with."""
        return ("long_rope",) if self.long_rope else ()

    @property
    def rope_offset(self) -> int:
        """What its positions carry for the rotary embedding (runtime.executor.LONG_ROPE_OFFSET on the second table)."""
        return LONG_ROPE_OFFSET if self.long_rope else 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet in the cache: 1 for a decode, more for a prefill or recompute."""
        return self.num_tokens - self.num_computed_tokens


@dataclass
class ScheduledSeq:
    """One request's share of a step."""

    request: Request
    num_context: int  # tokens already in its cache
    # tokens this step feeds: token_ids[num_context:num_context + num_new - num_draft], then draft_token_ids
    num_new: int
    # set by the serving engine's pipeline: the one new token is the one row ``in_flight_row`` of the step still in
    # flight sampled (not on the host yet; its slot is a lookahead slot until that step is read back)
    in_flight_row: int | None = None
    # speculative decoding: draft tokens fed after a decode's last known token, in lookahead slots (counted in
    # num_new and in the step's token budget; runtime.speculative)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_draft(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so its logits give the next token."""
        return (self.in_flight_row is not None
                or self.num_context + self.num_new - self.num_draft == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    """What the next step runs."""

    seqs: list[ScheduledSeq]  # in packing order
    preempted: list[Request]  # requests preempted while building this step (now waiting)
    num_batched_tokens: int  # sum of num_new (draft tokens included)

    @property
    def num_draft_tokens(self) -> int:
        return sum(q.num_draft for q in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Decides each step's batch within the budgets; owns the waiting queue and the running batch."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preparing: dict[str, Request] = {}  # admitted, not schedulable until mark_ready
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative
        self._num_new_waiting = 0  # waiting requests that never ran (bounded by max_waiting)

    # --- requests ------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def has_capacity(self) -> bool:
        """Whether ``add_request`` would accept one more request now."""
        return self._num_new_waiting < self.config.max_waiting

    def admits_now(self, now: float | None = None) -> bool:
        """Whether ``schedule`` would admit waiting requests now, budgets and blocks aside: there are some, a
        sequence slot is free, and the prefill hold (SchedulerConfig) does not apply or has run out."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        hold = self.config.prefill_hold_s
        if hold <= 0 or len(self.running) < max(self.config.prefill_hold_min_running, 1):
            return True
        now = time.monotonic() if now is None else now
        if now - self.waiting[0].arrival_time >= hold:  # oldest first: a preempted request waited longest
            return True
        waiting_tokens = 0
        for request in self.waiting:
            waiting_tokens += request.num_tokens - request.num_computed_tokens
            if waiting_tokens >= self.config.prefill_hold_tokens:
                return True
        return False

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this shape could never run (empty, too long for max_seq_len, more
        KV blocks than the pool has). Reads only fixed configuration, so any thread may call it."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= self.config.max_seq_len:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens; max_seq_len is "
                             f"{self.config.max_seq_len} (prompt plus at least one generated token)")
        num_blocks = -(-min(self.config.max_seq_len, num_prompt_tokens + max_tokens) // self.kv.block_size)
        if num_blocks > self.kv.pool.num_blocks:
            raise ValueError(f"the request needs up to {num_blocks} KV blocks; the pool has "
                             f"{self.kv.pool.num_blocks}")

    def add_request(self, request: Request, *, ready: bool = True) -> None:
        """Queue a new request; raises QueueFullError if the waiting queue is full, ValueError if the
        request can never run (too long for max_seq_len) or its id is in use. ``ready=False``: it is PREPARING
        until ``mark_ready`` (see the module docstring)."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check(len(request.prompt_token_ids), request.params.max_tokens)
        if not self.has_capacity:
            raise QueueFullError(f"{self._num_new_waiting} requests are already waiting "
                                 f"(max_waiting {self.config.max_waiting})")
        self._requests[request.request_id] = request
        self._num_new_waiting += 1
        self._check_long_rope(request)
        if ready:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
        else:
            request.status = RequestStatus.PREPARING
            self.preparing[request.request_id] = request

    def mark_ready(self, request_id: str) -> None:
        """A PREPARING request may run: it joins the back of the waiting queue."""
        request = self.preparing.pop(request_id)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_request(self, request_id: str) -> Request | None:
        """Remove a request (done, aborted or timed out) and free its blocks now. Unknown ids: None. The request
        leaves ``num_unfinished`` only once its blocks are free, so a reader on another thread that sees no
        unfinished request sees every block back in the pool."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            if request.status is RequestStatus.PREPARING:
                del self.preparing[request_id]
            else:
                self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                self._num_new_waiting -= 1
        request.status = RequestStatus.FINISHED
        try:
            self.kv.free(request_id)
        finally:
            del self._requests[request_id]
        return request

    # --- a step --------------------------------------------------------------------------------
    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Build the next step (see the module docstring for the order). Allocates the KV slots of
        every scheduled token; ``update`` must follow once the step has run.

        ``drafts``: request id -> speculative draft tokens of decoding requests. A decode feeds them after its last
        token, as far as the token budget allows, in lookahead slots (not committed: the serving engine commits
        the accepted ones after the step and returns the rest, see KVCacheManager.free_lookahead). When the pool
        cannot hold a request's drafts, it decodes without them before anyone is preempted for it."""
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        preempted: list[Request] = []
        drafts = drafts or {}

        decodes = [r for r in self.running if r.num_pending == 1]
        prefills = [r for r in self.running if r.num_pending > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self._check_long_rope(request):  # grew past LongRoPE's switch: recomputed on the second table
                self._requeue(request)
                continue
            num_new = min(request.num_pending, budget)
            draft = drafts.get(request.request_id, []) if request.num_pending == 1 else []
            draft = draft[:budget - num_new]
            while self.kv.allocate_slots(request.request_id, request.token_ids, num_new,
                                         num_lookahead_tokens=len(draft)) is None:
                if draft:  # drop the drafts before preempting anyone for them
                    draft = []
                    continue
                victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            seqs.append(ScheduledSeq(request, request.num_computed_tokens, num_new + len(draft),
                                     draft_token_ids=list(draft)))
            scheduled.add(id(request))
            budget -= num_new + len(draft)

        if self.admits_now() and not preempted:
            budget = self.admit(seqs, budget)
        return SchedulerOutput(seqs, preempted, self.config.max_num_batched_tokens - budget)

    def admit(self, seqs: list[ScheduledSeq], budget: int) -> int:
        """Admit waiting requests, oldest first, while the token budget, a sequence slot and free blocks last
        (prefix-cache hits included): each one's first chunk is appended to ``seqs``. Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            self._check_long_rope(request)  # (a preempted request may have grown past LongRoPE's switch)
            computed, num_computed = self.kv.get_computed_blocks(request.request_id, request.token_ids,
                                                                 extra=request.kv_extra)
            num_new = min(request.num_tokens - num_computed, budget)
            if self.kv.allocate_slots(request.request_id, request.token_ids, num_new, computed,
                                      extra=request.kv_extra, count_stats=request.num_cached_tokens < 0) is None:
                break  # not enough free blocks: wait for running requests to finish
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                self._num_new_waiting -= 1
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seqs.append(ScheduledSeq(request, num_computed, num_new))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and put it at the front of the waiting queue, to recompute later."""
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, request: Request) -> None:
        """Free a running request's blocks and put it at the front of the waiting queue: its tokens are computed
        again when it is admitted."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _check_long_rope(self, request: Request) -> bool:
        """Put ``request`` on LongRoPE's second table once it is longer than the switch; returns True where it had
        KV from the first table, which must be computed again: Hugging Face rotates a sequence past the switch with
        the second table throughout (Phi-3's generation drops its cache and recomputes there)."""
        switch = self.config.long_rope_from
        if switch is None or request.long_rope or request.num_tokens <= switch:
            return False
        request.long_rope = True
        return request.num_computed_tokens > 0 or request.request_id in self.kv

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Record that the step ran: scheduled tokens are computed, and each request that sampled gets
        its new token appended (``sampled``: request id -> token id). Draft tokens are not counted as computed:
        the serving engine records the accepted ones itself (``ServingEngine._record_verified``)."""
        for seq in output.seqs:
            request = seq.request
            # max: the serving pipeline may record a step that sampled nothing before the step launched ahead of it
            request.num_computed_tokens = max(request.num_computed_tokens,
                                              seq.num_context + seq.num_new - seq.num_draft)
            token = sampled.get(request.request_id)
            if token is not None:
                request.token_ids.append(token)

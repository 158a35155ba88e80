"""The serving engine: many requests on one model, one iteration-level step at a time.

    engine = ServingEngine.load("artifacts/quickstart", config=ServingConfig())
    engine.add_request([...prompt ids...], SamplingParams(max_tokens=32), request_id="a")
    while engine.has_unfinished:
        for out in engine.step(): ...   # RequestOutput deltas

A step: drop aborted and timed-out requests (their blocks are free before anything else runs), ask
the scheduler for the batch, pack it into one ``StepInput`` over the paged KV cache, run the graph,
sample the requests whose step reached their last token, then detokenize, check stop conditions and
free the blocks of finished requests. Thread-safety: ``abort`` may be called from any thread; the
rest belongs to the thread that calls ``step`` (``runtime.async_engine`` runs it in its own thread).

Structured output (``SamplingParams.structured``): the request's grammar compiles on a worker thread while the
request is PREPARING (not schedulable; cached by hash, so a repeated schema is ready at once). At each step that
samples it, its grammar state fills its row of an allowed-token bitmask on the host, the mask is applied to its
logits on the device before the draw, and the emitted token advances the state; the request stops when the grammar
is complete (or on EOS, which the mask allows only then). With the overlapped pipeline, the step after one in flight
is launched first and its sampling waits until the tokens in flight are read back and advanced: the host computes
the masks while the device runs that step's forward. Preemption keeps the state (recompute emits nothing again).

Speculative decoding (``ServingConfig.speculative``, runtime.speculative): before a step is scheduled, the proposer
drafts tokens for the decoding requests that may speculate (no logprobs, no penalties; not in a step with more than
``max_running`` decodes, nor for a request whose acceptance fell; a structured request's drafts cut to what its grammar
accepts, its verified rows masked by the grammar after each draft); each such decode is fed its last token
and its drafts and gets a logits row for each (``_verify``). The drafts up to the first one the sampler disagrees
with are kept, plus the sampler's own token, each through the stop checks in turn; their KV slots are committed and
the rest returned. Such a step runs synchronously (the overlapped pipeline, see ``step``, waits for it). A draft
model's drafts stay on the device until then (``PendingDrafts``): the host schedules and packs the verify step while
the device drafts, the draft rows are fed from the proposer's buffer, and the drafts are read back with the sampled
tokens, one wait per speculative step. ``step`` times each call for the policy's rate check (``_time_step``): drafts
only while they measure faster than none.

Failures: what belongs to one request - its sampling, logprobs, detokenization, stop check, grammar - finishes
that request alone with finish_reason "error" and a message, and the rest of the batch goes on. A
batched call that raises is retried row by row (only then: the hot path does no per-row work), and a
row the sampler finds without a valid distribution comes back as INVALID_TOKEN. Only a failure of the
shared step (scheduling, the forward pass) raises out of ``step``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from runtime.block_pool import BlockPool
from runtime.engine import Engine, RequestError, check_vocab_params
from runtime.env import env_number
from runtime.cuda_graphs import PackedStep, TableStaging
from runtime.executor import PagedAttentionMetadata, SeqSlice, StepInput, mixed_step
from runtime.kv_manager import KVCacheManager
from runtime.memory import MemoryPlan, estimate_workspace_bytes, plan_budget, plan_kv_blocks, tensor_bytes
from runtime.outputs import EngineStats, RequestOutput, TokenLogprob
from runtime.paged_kv import PagedKVStorage, PagedSequenceKV
from runtime.sampling import (INVALID_TOKEN, SamplingParams, TokenBitmask, compute_logprobs, make_generator, sample,
                              to_device)
from runtime.scheduler import Request, RequestStatus, ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from runtime.speculative import (METHODS, DraftRequest, DraftState, NgramProposer, PendingDrafts, Proposer,
                                 SpeculationPolicy, SpeculativeConfig, SpeculativeConfigError, accept_rows)
from runtime.structured import (GRAMMAR_ERROR_PREFIX, GrammarCompiler, GrammarState, StructuredOutputError,
                                fill_bitmasks, fill_bitmasks_with_drafts, is_limit_error)
from runtime.tokenizer import IncrementalDetokenizer, StopChecker

log = logging.getLogger(__name__)

INVALID_ROW_ERROR = ("sampling failed: the model's logits for this request gave no valid token distribution "
                     "(NaN or inf after penalties and temperature)")
MAX_TOKENS_PER_BLOCK = 1024  # ServingConfig.tokens_per_block's bound
COMPILE_POLL_S = 0.05  # with nothing to run but grammars compiling, how long a step waits for one


MAX_PREFILL_HOLD_MS = 60_000.0  # a new prompt's hold past a minute would only read as a hang (TTFT)


@dataclass
class ServingConfig:
    """Serving settings. None means the artifact's value (its recipe's runtime section)."""

    max_num_seqs: int | None = None  # running batch size; default: the artifact's max_batch_size
    max_num_batched_tokens: int | None = None  # tokens per step; default: the artifact's max_num_tokens
    max_seq_len: int | None = None  # may lower the artifact's, not raise it
    max_waiting: int = 256  # bounded admission queue; past it requests are rejected (429)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the device the plan may use
    kv_cache_bytes: int | None = None  # explicit KV pool size in bytes (CPU default: 1 GiB)
    num_blocks: int | None = None  # explicit number of KV blocks (tests, benchmarks); overrides the bytes
    # tokens per KV block (a power of two); default from RUNTIME_TOKENS_PER_BLOCK, else the artifact's
    # tokens_per_block. A block of a multiple of the decode attention's key tile (64 keys for FP8 / INT8 caches,
    # 32 for 16-bit ones past batch 2) gives each tile one block id and one base address: fewer instructions per
    # key (docs/BENCHMARKS.md, session 40); prefix caching then shares whole blocks of that size
    tokens_per_block: int | None = field(default_factory=lambda: env_number("RUNTIME_TOKENS_PER_BLOCK", None))
    request_timeout_s: float | None = None  # default per-request deadline, from arrival; None = none
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA with kernels only); off to debug
    # with cuda_graphs: steps that carry prefill (with the decodes beside them) of up to this many tokens replay
    # CUDA graphs too, one per (token bucket, sequence bucket) (runtime.cuda_graphs.StepGraphs); capped at
    # max_num_batched_tokens; 0 = eager; default from RUNTIME_PREFILL_GRAPH_TOKENS, else 2048
    prefill_graph_tokens: int = field(default_factory=lambda: env_number("RUNTIME_PREFILL_GRAPH_TOKENS", 2048))
    # with CUDA-graph decode: while requests decode, a new prompt waits up to this long (unless a quarter of
    # max_num_batched_tokens is waiting) so that arrivals are prefilled together and the steps between them replay
    # the decode graph instead of running eagerly (SchedulerConfig.prefill_hold_s); 0 admits at once. Default
    # from RUNTIME_PREFILL_HOLD_MS, else 0: on the H100 50 ms let Poisson load at 60 req/s meet p99 TTFT <= 500 ms
    # and TPOT <= 50 ms where no hold did not, but cost 12% in a closed loop of 256 clients (docs/BENCHMARKS.md)
    prefill_hold_ms: float = field(default_factory=lambda: float(env_number("RUNTIME_PREFILL_HOLD_MS", 0)))  # <= 60 s
    # with the overlapped pipeline: the masks of a structured step in flight are filled on a worker thread while the
    # step before is recorded (``ServingEngine._start_masks``); off fills them after (RUNTIME_MASK_OVERLAP=0: an A/B)
    mask_overlap: bool = field(default_factory=lambda: bool(env_number("RUNTIME_MASK_OVERLAP", 1)))
    # speculative decoding (runtime.speculative): a SpeculativeConfig, or its fields as a dict (the ``speculative``
    # section, e.g. across the engine process boundary); None: the artifact's (its recipe's runtime.speculative),
    # else off. SpeculativeConfig() (method None) turns it off whatever the artifact says
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig.from_dict(self.speculative)
        elif self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):  # None: the artifact's
            raise ValueError(f"speculative must be a SpeculativeConfig or a dict of its fields, got "
                             f"{type(self.speculative).__name__}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization {self.gpu_memory_utilization} is not in (0, 1]")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if not 0 <= self.prefill_hold_ms <= MAX_PREFILL_HOLD_MS:  # NaN too; inf held new prompts while any decoded
            raise ValueError(f"prefill_hold_ms must be in 0..{MAX_PREFILL_HOLD_MS:g} ms, got {self.prefill_hold_ms}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len", "kv_cache_bytes", "num_blocks",
                     "max_waiting"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.tokens_per_block is not None and not (
                type(self.tokens_per_block) is int and 0 < self.tokens_per_block <= MAX_TOKENS_PER_BLOCK
                and self.tokens_per_block & (self.tokens_per_block - 1) == 0):
            raise ValueError(f"tokens_per_block {self.tokens_per_block} must be a power of two from 1 to "
                             f"{MAX_TOKENS_PER_BLOCK} (e.g. 16 or 64)")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:  # NaN included
            raise ValueError(f"request_timeout_s must be > 0 seconds (None: no timeout), got {self.request_timeout_s}")


def make_proposer(config: SpeculativeConfig, target: Engine, max_seq_len: int, cuda_graphs: bool = True,
                  max_num_seqs: int | None = None) -> Proposer:
    """The proposer ``config.method`` names (runtime.speculative.METHODS) for ``target``: a draft model is loaded on
    its device and must share its vocabulary; ``max_seq_len``: the serving limit; ``cuda_graphs``: the draft's steps
    may be captured (ServingConfig.cuda_graphs); ``max_num_seqs``: the most requests that run at once (the draft's
    caches are planned for no more of them than that and ``max_running``)."""
    if config.method == "ngram":
        return NgramProposer(config.min_ngram, config.max_ngram)
    where = "" if config.draft_model is None or Path(config.draft_model).is_absolute() else \
        f" (a relative path, read from the working directory {Path.cwd()})"  # for the draft's errors
    if config.method == "draft":
        from runtime.artifact import ArtifactError
        from runtime.draft_model import DraftModelProposer

        vocab = int(target.executor.graph.get("meta", {}).get("vocab_size", 0))
        try:
            proposer = DraftModelProposer.load(
                config.draft_model, target.device, vocab, target.tokenizer, max_seq_len,
                max_seqs=min(config.max_running, max_num_seqs or config.max_running),  # speculating at once, at most
                max_draft_tokens=config.num_speculative_tokens, cuda_graphs=cuda_graphs)
        except ArtifactError as e:
            raise ArtifactError(f"speculative draft_model{where}: {e}") from None
        draft_bytes, target_bytes = proposer.weights_bytes(), tensor_bytes(target.executor.params.values())
        if draft_bytes >= target_bytes:
            log.warning("the draft model %s has %.1f MiB of weights, the target %.1f MiB: a draft as large as the "
                        "target reads as many bytes per token as the target saves; speculation will not pay",
                        config.draft_model, draft_bytes / 2**20, target_bytes / 2**20)
        return proposer
    if config.method == "eagle":
        from runtime.eagle import EagleProposer

        try:
            proposer = EagleProposer.load(config.draft_model, target, max_seq_len,
                                          max_seqs=min(config.max_running, max_num_seqs or config.max_running),
                                          max_draft_tokens=config.num_speculative_tokens, cuda_graphs=cuda_graphs)
        except SpeculativeConfigError as e:
            raise SpeculativeConfigError(f"speculative draft_model{where}: {e}") from None
        target.executor.keep_hidden = True  # before any CUDA graph is captured: they keep them too
        return proposer
    raise SpeculativeConfigError(f"no proposer for speculative method {config.method!r}; use one of "
                                 f"{', '.join(METHODS)}")


@dataclass
class _Track:
    """Per-request text state: detokenizer, stop strings, RNG, and what has been emitted."""

    detok: IncrementalDetokenizer
    stops: StopChecker
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    text: str = ""  # generated text so far (stop string excluded once found)
    num_emitted: int = 0  # characters of text already handed out
    num_tokens_emitted: int = 0  # token ids already handed out
    logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured output: where the output is in its grammar (once compiled)
    draft: DraftState | None = None  # speculative decoding: None when the request never speculates (see _speculates)


@dataclass
class _InFlight:
    """A step on the GPU whose sampled tokens the host has not read yet (see ``ServingEngine.step``).

    Launched with its forward; sampled at once, or - when structured requests sample in it and the step before is
    still in flight - once that step's tokens have advanced their grammars (``logits`` held until then)."""

    sched: SchedulerOutput
    sampling: list[Request]  # the requests that sample in it, in row order of ``tokens``
    logits: torch.Tensor | None  # [len(sampling), vocab] until sampled, then None
    tokens: torch.Tensor | None = None  # [len(sampling)] int64 on the device: the next step's input ids (INVALID_TOKEN:
    # failed row); None until sampled
    host_tokens: torch.Tensor | None = None  # the same, copied to pinned host memory once the step is done
    done: torch.cuda.Event | None = None  # recorded after that copy (None on the CPU, where the copy is synchronous)
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its sampling failed (row: INVALID_TOKEN)
    masks: Future | None = None  # its structured rows' masks, filled on the host while the step before is recorded

    @property
    def sampled(self) -> bool:
        return self.tokens is not None

    def launch_sampled(self, sampled: tuple[torch.Tensor, dict[str, str]]) -> _InFlight:
        """Take the sampled tokens and queue their copy to the host right behind the step. Reading them later
        waits for this event only; ``tokens.tolist()`` would wait for everything queued since, the next
        step included."""
        self.tokens, self.errors = sampled
        self.logits = None
        if not self.tokens.is_cuda:
            self.host_tokens = self.tokens
            return self
        self.host_tokens = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
        self.host_tokens.copy_(self.tokens, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()
        return self

    def read(self, failure: Callable[[], BaseException | None] | None = None) -> list[int]:
        """The sampled tokens, once the step is done. ``failure``: the engine's (a tensor-parallel engine's), polled
        while waiting and raised when set: a rank that died mid-step leaves this GPU waiting in the step's
        collectives for good, and the wait would never return."""
        if self.tokens is None:  # dropped before it sampled: wait for its forward all the same (see _drop_inflight)
            if self.logits is not None and self.logits.is_cuda:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.logits.device))
                wait_for_device(done, failure)
            return []
        if self.done is not None:
            wait_for_device(self.done, failure)
        return self.host_tokens.tolist()


def wait_for_device(event, failure: Callable[[], BaseException | None] | None) -> None:
    """``event.synchronize()``; with ``failure``, polled instead: ``failure()`` is raised as soon as it is set. The
    poll spins, yielding the GIL each turn, as the synchronize spins on its own: a sleep's granularity (~0.1 ms)
    would land on the step's critical path."""
    if failure is None:
        event.synchronize()
        return
    while not event.query():
        if (error := failure()) is not None:
            raise error
        time.sleep(0)


class _DeviceDrafts:
    """A step's drafts still on the device (``PendingDrafts``), with each request's index among the proposal's."""

    def __init__(self, pending: PendingDrafts, index: dict[str, int]) -> None:
        self.pending, self.index = pending, index

    def feed(self, seqs: list[ScheduledSeq], starts: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """``_feed``'s (tokens, rows, packed rows) for the draft rows of a packed verify step: a decode's drafts
        follow its last known token (``starts``: each seq's first packed row); the scheduler may have kept fewer
        than were proposed (the first ones)."""
        sources, targets = [], []
        for start, q in zip(starts, seqs):
            if q.num_draft:
                first = start + q.num_new - q.num_draft
                sources += self.pending.sources[self.index[q.request.request_id]][:q.num_draft]
                targets += range(first, first + q.num_draft)
        return self.pending.tokens, sources, targets

    def read_with(self, token_ids: torch.Tensor, seqs: list[ScheduledSeq]) -> list[int]:
        """Read the sampled ``token_ids`` and the drafts back in one copy; the drafts replace the seqs'
        placeholders (and the proposer records them); returns the sampled tokens."""
        n = token_ids.numel()
        both = torch.cat([token_ids.reshape(-1).to(self.pending.tokens.dtype), self.pending.tokens]).tolist()
        drafts = self.pending.resolve(both[n:])
        for q in seqs:
            if q.num_draft:
                q.draft_token_ids = drafts[self.index[q.request.request_id]][:q.num_draft]
        return both[:n]


def _feed(ids: torch.Tensor, feed: tuple[torch.Tensor, list[int], list[int]]) -> torch.Tensor:
    """``ids`` with ids[targets[i]] = tokens[sources[i]], on the device (tokens the step in flight sampled)."""
    tokens, sources, targets = feed
    return ids.index_copy_(0, to_device(targets, ids.device), tokens.index_select(0, to_device(sources, tokens.device)))


def _outside_grammar(token: int, grammar: GrammarState) -> str:
    """A sampled token the request's grammar refuses. The mask allowed it: a limit the grammar ran into when it
    took the token (llguidance's lexer or parser outgrew its bounds) is the grammar's, the client's error
    (GRAMMAR_ERROR_PREFIX); anything else the engine's fault, with llguidance's word on it."""
    if is_limit_error(grammar.error):
        return (f"{GRAMMAR_ERROR_PREFIX}the grammar became too complex to follow at token {token} "
                f"({grammar.error.splitlines()[0]}); bound its repetitions and lengths more tightly")
    return f"token {token} was sampled outside the request's grammar (structured output; {grammar.error})"


class ServingEngine:
    """An artifact served with continuous batching over a paged KV cache."""

    def __init__(self, engine: Engine, config: ServingConfig | None = None) -> None:
        config = config or ServingConfig()
        if config.speculative is None:  # the artifact's recipe section (runtime.speculative), else off
            section = dict(engine.artifact.manifest["runtime"].get("speculative") or {})
            if section.get("draft_model") is not None:  # a bundled draft: its directory inside the artifact
                section["draft_model"] = str(engine.artifact.path / section["draft_model"])
            config = replace(config, speculative=SpeculativeConfig.from_dict(section) if section
                             else SpeculativeConfig())
        self.engine = engine  # the offline engine: artifact, executor, tokenizer
        self.executor, self.tokenizer, self.device = engine.executor, engine.tokenizer, engine.device
        limits = engine.limits
        if config.max_seq_len is not None and config.max_seq_len > limits.max_seq_len:
            raise ValueError(f"max_seq_len {config.max_seq_len} is above the artifact's {limits.max_seq_len}")
        self.config = config
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs or limits.max_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens or limits.max_num_tokens,
            max_seq_len=config.max_seq_len or limits.max_seq_len,
            max_waiting=config.max_waiting, long_rope_from=engine.executor.long_rope_from)
        self.block_size = config.tokens_per_block or limits.tokens_per_block
        spec = config.speculative  # the proposer first: a draft model's weights are planned with the target's
        reserved = torch.cuda.memory_reserved(engine.device) if engine.device.type == "cuda" else 0
        self.proposer: Proposer | None = make_proposer(spec, engine, self.scheduler_config.max_seq_len,
                                                       config.cuda_graphs, self.scheduler_config.max_num_seqs
                                                       ) if spec.enabled else None
        # what the draft holds beyond its weights and caches (its CUDA graphs' pools, their static buffers): planned
        # beside them
        self._draft_extra_bytes = 0
        if self.proposer is not None and reserved:
            self._draft_extra_bytes = max(0, torch.cuda.memory_reserved(engine.device) - reserved
                                          - self.proposer.weights_bytes() - self.proposer.kv_bytes())
        self.spec_policy = SpeculationPolicy(spec)
        self.memory_plan = self._plan_memory()
        log.info(self.memory_plan.describe())
        layout = engine.kv_layout
        self.storage = PagedKVStorage(layout, self.memory_plan.num_blocks, self.block_size, self.device)
        dtypes = tuple(str(layout.dtype_of(i)) for i in range(len(layout.num_kv_heads)))
        self.kv = KVCacheManager(BlockPool(self.memory_plan.num_blocks), self.block_size,
                                 config.enable_prefix_caching, hash_extra=dtypes)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.graphs = None
        self.step_graphs = None  # StepGraphs: steps carrying prefill, of up to prefill_graph_tokens tokens
        self.verify_graphs = None  # DecodeGraphs(chained=True): verify steps of a few decodes, a row per token
        if config.cuda_graphs and self.device.type == "cuda" and self.executor.use_kernels:
            from runtime.cuda_graphs import (DEFAULT_STEP_TOKEN_BUCKETS, DecodeGraphs, StepGraphs, decode_graph_batch,
                                             powers, verify_buckets)

            graphs, step_graphs = DecodeGraphs, StepGraphs
            if getattr(self.executor, "tp_size", 1) > 1:  # every rank captures and replays its shard's steps
                from runtime.tensor_parallel import TPDecodeGraphs as graphs
                from runtime.tensor_parallel import TPStepGraphs as step_graphs
            sc = self.scheduler_config
            self.graphs = graphs(self.executor, self.storage, decode_graph_batch(sc.max_num_seqs,
                                                                                 sc.max_num_batched_tokens),
                                 sc.max_seq_len)
            max_tokens = min(config.prefill_graph_tokens, self.scheduler_config.max_num_batched_tokens)
            if max_tokens > 1:
                max_rows = self.scheduler_config.max_num_seqs
                spec = config.speculative
                buckets: dict[str, tuple[int, ...]] = {}
                if spec.enabled:  # verify steps replay them too: k + 1 logits rows per speculating decode
                    max_rows = max(max_rows, min(max_rows, spec.max_running) * (spec.num_speculative_tokens + 1))
                    small = verify_buckets()  # a few decodes' verify steps: small token and sequence buckets
                    buckets = {"token_buckets": tuple(sorted(set(DEFAULT_STEP_TOKEN_BUCKETS) | set(small))),
                               "seq_buckets": tuple(sorted(set(powers(4, min(max_rows, max_tokens))) | set(small)))}
                self.step_graphs = step_graphs(self.executor, self.storage, max_tokens, max_rows,
                                               self.scheduler_config.max_seq_len, **buckets)
            if config.speculative.enabled and graphs is DecodeGraphs:  # (one GPU: a TP worker has none of them)
                self.verify_graphs = self._verify_decode_graphs(config.speculative)
            # decode-only steps are graph replays and much cheaper than eager ones that carry a prompt
            self.scheduler_config.prefill_hold_s = config.prefill_hold_ms / 1000
            self.scheduler_config.prefill_hold_tokens = self.scheduler_config.max_num_batched_tokens // 4
        self._tracks: dict[str, _Track] = {}
        self._aborts: deque[tuple[str, str]] = deque()  # (request id, reason); appended from any thread
        self._compiling: dict[str, Future] = {}  # PREPARING request id -> its grammar's compile
        self._grammars: GrammarCompiler | None = None  # made by the first structured request
        self._grammars_lock = threading.Lock()  # the server's checks reach it from their own threads
        self._mask_filler: ThreadPoolExecutor | None = None  # fills an in-flight step's masks (see _start_masks)
        self._inflight: _InFlight | None = None  # a launched step not yet read back (overlap)
        # speculation's rate check (SpeculationPolicy.record_step): the end of the last step call, its requests, whether
        # it verified drafts and whether every request was decoding (no prompt, admission or compile in the way)
        self._rate_mark: tuple[float, int, bool, bool] | None = None
        self._verified_this_call = False
        self._clock: Callable[[], float] = time.perf_counter  # the rate check's (tests give it a virtual one)
        self.num_steps = 0
        self.spec_num_steps = 0  # steps that verified drafts
        self.spec_num_verified = 0  # decodes verified with drafts (a request in a step)
        self.spec_num_draft_tokens = 0  # draft tokens verified
        self.spec_num_accepted_tokens = 0  # of those, accepted

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", config: ServingConfig | None = None, *,
             check_hashes: bool = True, allow_failed_gate: bool = False,
             use_kernels: bool | None = None) -> ServingEngine:
        """Verify and load an artifact (see ``Engine.load``; ``device`` goes through ``resolve_device``),
        then plan memory and build the KV pool."""
        return cls(Engine.load(path, device, check_hashes=check_hashes, allow_failed_gate=allow_failed_gate,
                               use_kernels=use_kernels), config)

    @property
    def failure(self) -> BaseException | None:
        """Why this engine can never step again (a tensor-parallel rank died), or None."""
        return getattr(self.executor, "failure", None)

    @property
    def _device_failure(self) -> Callable[[], BaseException | None] | None:
        """What a wait for the device polls (``wait_for_device``): a tensor-parallel engine's failure; None (a plain
        synchronize) for one rank."""
        return (lambda: self.executor.failure) if hasattr(self.executor, "failure") else None

    def close(self) -> None:
        """Release what outlives the object: the decode and step CUDA graphs and a tensor-parallel engine's worker
        ranks (see Engine.close). The engine cannot step afterwards."""
        if self.graphs is not None:
            self._drop_inflight()
            self.graphs.close()  # before the ranks leave the process group: the graphs hold NCCL resources
            self.graphs = None
        if self.step_graphs is not None:
            self.step_graphs.close()  # likewise (tensor parallelism: every rank's step graphs record collectives)
            self.step_graphs = None
        if self.verify_graphs is not None:
            self.verify_graphs.close()
            self.verify_graphs = None
        if self._grammars is not None:
            self._grammars.close()
        if self._mask_filler is not None:
            self._mask_filler.shutdown(wait=True)
        if self.proposer is not None:
            self.proposer.close()
        self.engine.close()

    # --- memory --------------------------------------------------------------------------------
    def _verify_decode_graphs(self, spec: SpeculativeConfig, capture: bool = True):
        """The verify-step decode graphs (``DecodeGraphs(chained=True)``) for up to the rows a verify step may have
        (``max_running`` decodes of k + 1 rows each), in the buckets of ``verify_decode_buckets``; None where none
        applies."""
        from runtime.cuda_graphs import DecodeGraphs, verify_decode_buckets

        sizes = verify_decode_buckets()
        sc = self.scheduler_config
        top = min(sc.max_num_seqs, spec.max_running) * (spec.num_speculative_tokens + 1)
        if not sizes or top < 2:
            return None
        return DecodeGraphs(self.executor, self.storage, min(top, sizes[-1]), sc.max_seq_len, buckets=sizes,
                            chained=True, capture=capture)

    def _plan_memory(self) -> MemoryPlan:
        cfg, sc = self.config, self.scheduler_config
        layout = self.engine.kv_layout
        weights = tensor_bytes(self.executor.params.values()) + (self.proposer.weights_bytes() if self.proposer else 0)
        # a draft model's own caches (and on CUDA its graphs' memory), beside the pool
        draft_kv = self.proposer.kv_bytes() + self._draft_extra_bytes if self.proposer else 0
        per_block = layout.bytes_per_token() * self.block_size
        if cfg.num_blocks is not None or self.device.type != "cuda":
            workspace = estimate_workspace_bytes(self.executor.graph, sc.max_num_batched_tokens, sc.max_num_seqs,
                                                 self.executor.dtype)
        else:
            workspace = self._profile_cuda_workspace()
        figures = dict(gpu_memory_utilization=cfg.gpu_memory_utilization, kv_cache_bytes=cfg.kv_cache_bytes,
                       num_blocks=cfg.num_blocks)
        budget, other = plan_budget(self.device, weights_bytes=weights, workspace_bytes=workspace, other_bytes=draft_kv,
                                    bytes_per_block=per_block, **figures)
        plan = plan_kv_blocks(device=str(self.device), budget_bytes=budget, weights_bytes=weights,
                              workspace_bytes=workspace, other_bytes=other, layout=layout, block_size=self.block_size,
                              max_seq_len=sc.max_seq_len)
        agree = getattr(self.executor, "agree_kv_blocks", None)  # tensor parallelism: the least of every rank's
        return plan if agree is None else agree(plan, **figures)

    def _profile_cuda_workspace(self) -> int:
        """Peak activation bytes of one step of max_num_batched_tokens tokens over random ids."""
        sc = self.scheduler_config
        num_tokens = min(sc.max_num_batched_tokens, sc.max_seq_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        vocab = int(self.executor.graph.get("meta", {}).get("vocab_size", 2))
        ids = torch.randint(0, vocab, (num_tokens,), device=self.device)
        kv = self.engine._new_cache(num_tokens)
        positions = torch.arange(num_tokens, device=self.device)
        logits_rows = torch.arange(min(sc.max_num_seqs, num_tokens), device=self.device)
        forward = getattr(self.executor, "profile_forward", self.executor.forward)  # TP: every rank measures its own
        forward(StepInput(ids, positions, [SeqSlice(kv, 0, num_tokens)], logits_rows))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv
        torch.cuda.empty_cache()
        return int(peak)

    # --- requests ------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborts) or self._inflight is not None

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this model's vocabulary (made on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                vocab = int(self.executor.graph.get("meta", {}).get("vocab_size", 0)) or self.tokenizer.vocab_size
                self._grammars = GrammarCompiler(self.tokenizer, vocab)
            return self._grammars

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, timeout_s: float | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises RequestError for a request that can never run
        (empty, too long, bad token ids) and QueueFullError when the waiting queue is full."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        self.check_request(prompt_token_ids, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        timeout = timeout_s if timeout_s is not None else self.config.request_timeout_s
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=now,
                          deadline=None if timeout is None else now + timeout)
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        track = _Track(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids), StopChecker(params.stop),
                       eos | frozenset(params.stop_token_ids), make_generator(params.seed, self.device))
        if self.proposer is not None and self._speculates(params):
            track.draft = self.spec_policy.new_state()
        structured = params.structured is not None
        try:  # the track first: a request the scheduler holds always has one
            self.scheduler.add_request(request, ready=not structured)
        except ValueError as e:
            raise RequestError(str(e)) from e
        self._tracks[request_id] = track
        if structured:  # PREPARING until compiled, off this thread (_take_compiled)
            self._compiling[request_id] = self.grammars.submit(params.structured)
        return request_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request could never run here (empty, too long, token ids outside the
        vocabulary, larger than the KV pool). Reads only fixed state: safe from any thread."""
        self.engine.check_token_ids(prompt_token_ids)
        check_vocab_params(params, self.engine.vocab_size)
        try:
            self.scheduler.check(len(prompt_token_ids), params.max_tokens)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request (client gone, cancelled): its blocks are freed at the start of the next step.
        Safe from any thread; unknown or finished ids are ignored."""
        self._aborts.append((request_id, reason))

    def stats(self) -> EngineStats:
        pool, kv_stats = self.kv.pool, self.kv.stats
        return EngineStats(num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting) + len(self.scheduler.preparing),
                           kv_usage=pool.usage, num_blocks=pool.num_blocks, num_free_blocks=pool.num_free,
                           prefix_cache_queries=kv_stats.queries, prefix_cache_hits=kv_stats.hits,
                           num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
                           spec_num_steps=self.spec_num_steps, spec_num_verified=self.spec_num_verified,
                           spec_num_draft_tokens=self.spec_num_draft_tokens,
                           spec_num_accepted_tokens=self.spec_num_accepted_tokens, **self._rate_stats())

    def _rate_stats(self) -> dict:
        """The rate check's view for EngineStats (spec_measured_gain, spec_drafting); speculation off: zeros, and
        without the check, drafting whenever speculation is on."""
        if not self.spec_policy.config.enabled:
            return {}
        check = self.spec_policy.rate_check
        if check is None or check.last is None:  # no check, or nothing timed yet: drafts run
            return {"spec_drafting": 1}
        return {"spec_measured_gain": check.gain(check.last) or 0.0,
                "spec_drafting": int(check.chosen.get(check.last, True))}

    # --- a step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a delta for every request that produced tokens or finished.

        With CUDA graphs the host overlaps the GPU: a step is launched and left in flight, and the next call
        launches the step after it - its decodes fed with the tokens the first one sampled, still on the
        device; prompts waiting for admission and the next chunks of long ones join it - before it reads those
        tokens back, detokenizes and emits them. So the host's per-step work (scheduling, detokenization, stop
        checks, packing the next step) runs while the GPU computes, and a step's deltas come back one call
        later. A request that stops on a token (EOS, a stop string) has had one more step launched by then: its
        result is discarded and its blocks freed. Length limits are known ahead and never overrun. A step with
        structured requests is launched ahead too, but sampled only after the step before is read back (their
        masks need its tokens). The pipeline drains to the synchronous path when a KV block shortage calls for
        preemption, or a request asks for logprobs or penalties (both read the host's token history of the step
        before), or a request would speculate (its drafts are proposed from the tokens the step before sampled,
        and the verified tokens' count decides the next step's positions: see ``_propose``).
        """
        self._verified_this_call = False
        outputs = self._step()
        if self.spec_policy.rate_check is not None:
            self._time_step(outputs)
        return outputs

    def _time_step(self, outputs: list[RequestOutput]) -> None:
        """Time this step call for the speculation policy's rate check: a call between two in which every running
        request was decoding, the same requests, the same mode (drafts verified or not), gives the tokens they got
        over its wall time since the call before."""
        now = self._clock()
        running = self.scheduler.running
        if len(running) > self.spec_policy.config.max_running:  # no speculation at this load: nothing to compare
            self._rate_mark = None
            return
        steady = not self.scheduler.waiting and not self._compiling and all(r.num_pending <= 1 for r in running)
        prev, self._rate_mark = self._rate_mark, (now, len(running), self._verified_this_call, steady)
        if prev is None or not (prev[3] and steady) or prev[1:3] != (len(running), self._verified_this_call):
            return
        self.spec_policy.record_step(len(running), self._verified_this_call, sum(len(o.token_ids) for o in outputs),
                                     now - prev[0])

    def _step(self) -> list[RequestOutput]:
        """``step``'s work (its docstring)."""
        outputs = self._reap()
        if self._compiling:
            outputs += self._take_compiled()
        if self._inflight is not None:
            previous = self._inflight
            self._inflight = self._launch_next(previous)
            outputs += self._complete(previous)
            if self._inflight is not None:
                if not self._inflight.sampled:  # its grammars have taken previous's tokens: mask and sample now
                    step = self._inflight
                    step.launch_sampled(self._sample(step.logits, step.sampling, masks=step.masks))
                return outputs
        proposed, drafts = self._propose()
        sched = self.scheduler.schedule(proposed)
        if drafts is not None and not sched.num_draft_tokens:
            drafts.pending.resolve()  # the scheduler kept none of them: the proposer's bookkeeping now
            drafts = None
        if sched.empty:
            return outputs
        logits, sampling = self._run(sched, drafts=drafts)
        self.num_steps += 1
        if not sampling:
            self.scheduler.update(sched, {})
            return outputs
        if sched.num_draft_tokens:
            return outputs + self._verify(sched, logits, sampling, drafts)
        if self.graphs is not None and self._overlappable(sampling) and not self._wants_drafts(sampling):
            self._inflight = _InFlight(sched, sampling, logits).launch_sampled(self._sample(logits, sampling))
            return outputs
        token_ids, errors = self._sample(logits, sampling)
        tokens = token_ids.tolist()
        wanted = [r.params.logprobs if t != INVALID_TOKEN else None for r, t in zip(sampling, tokens)]
        logprobs = self._logprobs(logits, token_ids, wanted, sampling, errors)
        return outputs + self._record(sched, list(zip(sampling, tokens, logprobs)), errors)

    def _run(self, sched: SchedulerOutput, tokens: torch.Tensor | None = None,
             drafts: _DeviceDrafts | None = None) -> tuple[torch.Tensor, list[Request]]:
        """Launch the step: the decode graphs for a step of one-token decodes, else the step graphs of its
        buckets, else eagerly. Returns the logits of the requests that sample (one row each; k + 1 for a decode
        with k drafts), and those requests in order. ``tokens``: the step in flight's sampled tokens on the
        device, the inputs of the seqs with an ``in_flight_row`` (a failed row's INVALID_TOKEN computes from token
        0; that request is finished when the step in flight is read back). ``drafts``: drafts still on the device,
        the inputs of a verify step's draft rows (their ``draft_token_ids`` are placeholders until resolved)."""
        if tokens is not None:
            tokens = tokens.clamp(min=0)
        seqs = sched.seqs
        if self.graphs is not None and all(q.num_new == 1 for q in seqs) \
                and self.graphs.bucket_for(len(seqs)) is not None:
            ids = None
            rows = [q.in_flight_row for q in seqs]
            if all(r is not None for r in rows):  # every input still on the device
                ids = tokens if rows == list(range(len(tokens))) else tokens.index_select(0, to_device(rows, tokens.device))
            elif any(r is not None for r in rows):  # some on the device, some on the host
                dst = [i for i, r in enumerate(rows) if r is not None]
                ids = _feed(to_device([0 if r is not None else q.request.token_ids[q.num_context]
                                       for q, r in zip(seqs, rows)], self.device),
                            (tokens, [rows[i] for i in dst], dst))
            logits = self._replay(sched, ids)
            if self._hidden_wanted():
                self._record_hidden(sched, self.graphs.hidden, list(range(len(seqs) + 1)))
            return logits, [q.request for q in seqs]  # a one-token step always samples
        if self.verify_graphs is not None and self._chains(seqs):
            return self._replay_verify(sched, drafts)
        packed, sampling = self._pack(sched)
        moved = [(i, q.in_flight_row) for i, q in enumerate(seqs) if q.in_flight_row is not None]
        # (rows of the step in flight, packed rows they feed): a seq with an in-flight token has one new token
        feed = None
        if moved:
            starts = packed.cu_seqlens_q
            feed = (tokens, [r for _, r in moved], [starts[i] for i, _ in moved])
        if drafts is not None:  # a verify step's drafts, from the proposer's buffer (the synchronous path: no moved)
            assert feed is None, "a verify step runs on the synchronous path, with no step in flight"
            feed = drafts.feed(seqs, packed.cu_seqlens_q)
        # prefill with the decodes beside it, or a verify step (k + 1 logits rows for a decode with k drafts)
        num_rows = len(packed.logits_rows)
        if self.step_graphs is not None \
                and self.step_graphs.bucket_for(sched.num_batched_tokens, len(seqs), num_rows) is not None:
            logits = self.step_graphs.run(packed, feed)
            if self._hidden_wanted():
                self._record_hidden(sched, self.step_graphs.hidden, packed.cu_seqlens_q)
            return logits, sampling
        inp = self._prepare(sched, packed)
        if feed is not None:
            _feed(inp.input_ids, feed)
        logits = self.executor.forward(inp)  # [num_sampling, vocab] fp32
        if self._hidden_wanted():
            self._record_hidden(sched, self.executor.hidden, packed.cu_seqlens_q)
        return logits, sampling

    def _hidden_wanted(self) -> bool:
        """Whether this step's final hidden states go to the proposer (an EAGLE head's, ``needs_hidden``): at a
        load where steps may speculate (at most ``max_running`` requests running)."""
        return (getattr(self.proposer, "needs_hidden", False)
                and len(self.scheduler.running) <= self.spec_policy.config.max_running)

    def _record_hidden(self, sched: SchedulerOutput, hidden: torch.Tensor, starts: list[int]) -> None:
        """Hand the proposer each speculating request's rows of ``hidden`` (rows starts[i] .. starts[i + 1] are
        seq i's, at positions from its num_context on): copied on the stream, so a graph's buffer may be reused."""
        for i, q in enumerate(sched.seqs):
            track = self._tracks.get(q.request.request_id)
            if track is None or track.draft is None:
                continue
            self.proposer.record_hidden(q.request.request_id, q.num_context, hidden[starts[i]:starts[i + 1]])

    def _sample(self, logits: torch.Tensor, sampling: list[Request],
                draw_states: list[torch.Tensor | None] | None = None, masks: Future | None = None,
                filled: tuple[list[int], list[GrammarState], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, dict[str, str]]:
        """Each request's next token, on the logits' device (no host sync), and why sampling failed for the
        requests it raised for (their rows hold INVALID_TOKEN, as do rows without a valid distribution).
        A batched call that raises is retried row by row, each seeded row from its generator's state
        before the batched call, so the others keep the tokens they would have drawn.
        A request may have several consecutive rows (a verify step, see ``_verify``): they draw from its generator
        in turn, and ``draw_states`` (see ``sample``'s ``generator_states``) gets its state after each draw.
        ``masks``: the structured rows' masks being filled already (``_start_masks``); ``filled``: filled already
        (a verify step's, ``_verify_masks``); else they are filled here."""
        # (a request that finished while its sampling waited, see _InFlight, draws unseeded and unmasked: discarded)
        tracks = [self._tracks.get(r.request_id) for r in sampling]
        generators = [t.generator if t is not None else None for t in tracks]
        states = [g.get_state() if g is not None else None for g in generators]
        if masks is not None:
            filled = masks.result()
        elif filled is None:
            filled = self._fill_masks(sampling, tracks)
        mask, errors = self._token_bitmask(sampling, filled)
        # min_tokens: EOS and stop ids kept out until the request has that many tokens (not for structured output,
        # whose grammar decides where it ends); such a request runs on the synchronous path (_overlappable), so its
        # output count is exact here
        banned = [t.stop_ids if t is not None and r.params.structured is None
                  and r.num_output_tokens < r.params.min_tokens else None for r, t in zip(sampling, tracks)]
        try:
            return self._sample_rows(logits, sampling, generators, mask, draw_states,
                                     self.executor.use_kernels, banned), errors
        except Exception as e:  # one request's parameters or history, or the device: find out row by row
            log.warning("sampling a batch of %d failed (%s: %s); retrying row by row", len(sampling),
                        type(e).__name__, e)
        rows: list[torch.Tensor] = []  # row by row on torch's ops alone (use_kernels off: no kernel to blame)
        rewound: set[int] = set()
        for i, (request, generator, state) in enumerate(zip(sampling, generators, states)):
            if generator is not None and id(generator) not in rewound:  # once: a request's rows draw in turn
                generator.set_state(state)
                rewound.add(id(generator))
            row_states = [None] if draw_states is not None else None
            try:
                rows.append(self._sample_rows(logits[i:i + 1], [request], [generator],
                                              mask.select(i) if mask is not None else None, row_states,
                                              banned=banned[i:i + 1]))
                if draw_states is not None:
                    draw_states[i] = row_states[0]
            except Exception as e:
                errors[request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                rows.append(torch.full((1,), INVALID_TOKEN, dtype=torch.long, device=logits.device))
        return torch.cat(rows), errors

    def _fill_masks(self, sampling: list[Request], tracks: list[_Track | None]
                    ) -> tuple[list[int], list[GrammarState], torch.Tensor] | None:
        """The allowed tokens of the structured requests among ``sampling`` as a host bitmask (rows of ``sampling``,
        their grammar states, the bitmask), or None when there are none. Touches nothing but those states, so it
        may run on another thread (``_start_masks``)."""
        if not any(r.params.structured is not None for r in sampling):
            return None
        rows = [i for i, t in enumerate(tracks) if t is not None and t.grammar is not None]
        states = [tracks[i].grammar for i in rows]
        return rows, states, fill_bitmasks(states, self.grammars.num_words, pin_memory=self.device.type == "cuda")

    def _token_bitmask(self, sampling: list[Request],
                       filled: tuple[list[int], list[GrammarState], torch.Tensor] | None
                       ) -> tuple[TokenBitmask | None, dict[str, str]]:
        """The filled masks (``_fill_masks``) on the device without a host sync (None when there are none), and
        the requests whose grammar is dead (request id -> why: they fail)."""
        if filled is None:
            return None, {}
        rows, states, bitmask = filled
        errors = {sampling[i].request_id: f"{GRAMMAR_ERROR_PREFIX}the grammar cannot continue ({s.error})"
                  for i, s in zip(rows, states) if s.error is not None}
        return TokenBitmask(rows, bitmask.to(self.device, non_blocking=True)), errors

    def _start_masks(self) -> None:
        """Start filling the masks of the in-flight step's structured rows on a worker thread, once the step before
        has advanced their grammars (``_record``'s ``before_emit``): llguidance fills them without the GIL while
        this thread detokenizes and emits that step's tokens. ``_sample`` takes the result; ``_drop_inflight``
        waits for it (nothing else touches those states meanwhile: ``GrammarState.finished`` is cached)."""
        step = self._inflight
        if step is None or step.sampled or step.masks is not None:
            return
        tracks = [self._tracks.get(r.request_id) for r in step.sampling]
        if not any(t is not None and t.grammar is not None for t in tracks):
            return
        if self._mask_filler is None:
            self._mask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        step.masks = self._mask_filler.submit(self._fill_masks, step.sampling, tracks)

    @staticmethod
    def _sample_rows(logits: torch.Tensor, sampling: list[Request], generators: list[torch.Generator | None],
                     mask: TokenBitmask | None, draw_states: list | None = None,
                     use_kernels: bool = False, banned: list | None = None) -> torch.Tensor:
        """``sample`` over these requests' rows. Token histories (a copy of each request's output so far) are
        built only when a penalty needs them."""
        params = [r.params for r in sampling]
        if not any(p.has_penalties for p in params):
            return sample(logits, params, generators, token_bitmask=mask, generator_states=draw_states,
                          use_kernels=use_kernels, banned=banned)
        return sample(logits, params, generators, prompt_ids=[r.prompt_token_ids for r in sampling],
                      output_ids=[r.output_token_ids for r in sampling], token_bitmask=mask,
                      generator_states=draw_states, use_kernels=use_kernels, banned=banned)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None], sampling: list[Request],
                  errors: dict[str, str]) -> list[TokenLogprob | None]:
        """The logprobs of the rows that want them (see ``compute_logprobs``). A batched call that raises is
        retried row by row; a row that still fails records its request's error in ``errors``."""
        if all(n is None for n in wanted):
            return [None] * len(wanted)
        try:
            return compute_logprobs(logits, token_ids, wanted)
        except Exception as e:
            log.warning("logprobs of a batch of %d failed (%s: %s); retrying row by row", len(wanted),
                        type(e).__name__, e)
        result: list[TokenLogprob | None] = [None] * len(wanted)
        for i, (n, request) in enumerate(zip(wanted, sampling)):
            if n is None:
                continue
            try:
                result[i] = compute_logprobs(logits[i:i + 1], token_ids[i:i + 1], [n])[0]
            except Exception as e:
                errors[request.request_id] = f"computing logprobs failed: {type(e).__name__}: {e}"
        return result

    def _record(self, sched: SchedulerOutput, rows: list[tuple[Request, int, TokenLogprob | None]],
                errors: dict[str, str], verified: list[tuple[Request, list[int], list[int]]] = (),
                before_emit: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Record a step: append each request's sampled token and emit its delta. A request whose own
        sampling or logprobs failed (INVALID_TOKEN, or listed in ``errors``) gets no token and finishes
        with an error, as does one whose detokenization or stop check raises; the others go on.
        ``verified``: (request, its drafts, the tokens verification emits) of the requests that speculated (see
        ``_record_verified``); one whose last emitted token is INVALID_TOKEN fails, its accepted drafts unsent.
        Structured requests' grammars take their tokens first (a token the grammar refuses fails the request, and is
        not appended), then ``before_emit`` runs, then the deltas are made."""
        failed = {r.request_id for r, t, _ in rows if t == INVALID_TOKEN or r.request_id in errors}
        failed |= {r.request_id for r, _, emitted in verified if emitted[-1] == INVALID_TOKEN or r.request_id in errors}
        for request, token, _ in rows:
            track = self._tracks.get(request.request_id)
            if request.request_id not in failed and track is not None and track.grammar is not None \
                    and not track.grammar.advance(token):
                failed.add(request.request_id)
                errors[request.request_id] = _outside_grammar(token, track.grammar)
        self.scheduler.update(sched, {r.request_id: t for r, t, _ in rows if r.request_id not in failed})
        if before_emit is not None:
            before_emit()
        outputs = [self._deliver(request, failed, errors, f"token {token}",
                                 lambda r=request, t=token, lp=logprob: self._emit(r, t, lp))
                   for request, token, logprob in rows]
        outputs += [self._deliver(request, failed, errors, f"tokens {emitted}",
                                  lambda r=request, d=drafts, e=emitted: self._record_verified(r, d, e))
                    for request, drafts, emitted in verified]
        return outputs

    def _deliver(self, request: Request, failed: set[str], errors: dict[str, str], what: str,
                 emit: Callable[[], RequestOutput]) -> RequestOutput:
        """``emit()``, the request's delta for ``what`` it sampled, or its failure: when its row failed, or when
        detokenizing or the stop checks raise (that request alone fails)."""
        if request.request_id in failed:
            return self._fail(request, errors.get(request.request_id, INVALID_ROW_ERROR))
        try:
            return emit()
        except Exception as e:
            log.exception("request %s: emitting %s failed", request.request_id, what)
            return self._fail(request, f"detokenizing or checking the stop conditions of {what} failed: "
                                       f"{type(e).__name__}: {e}")

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """Finish one request with finish_reason "error" (a failure that belongs to it alone)."""
        log.error("request %s failed: %s", request.request_id, error)
        track = self._tracks.get(request.request_id)
        assert track is not None, f"request {request.request_id} failed after it finished"
        return self._delta(request, track, "error", error)

    @staticmethod
    def _overlappable(requests: list[Request]) -> bool:
        """Whether a step of these requests may run ahead of the host (see ``step``)."""
        return not any(r.params.has_penalties or r.params.logprobs is not None
                       or r.num_output_tokens < r.params.min_tokens for r in requests)

    # --- speculative decoding (runtime.speculative) ----------------------------------------------------------------
    @staticmethod
    def _speculates(params: SamplingParams) -> bool:
        """Whether a request of these parameters may speculate. Not: logprobs and penalties (every verified position
        would need its own token history and logprobs); such requests decode one token per step beside the others.
        Structured requests do: their drafts are cut to what the grammar accepts (``_propose``), each verified row
        is masked by the grammar after the drafts before it (``_verify_masks``), and the grammar takes the emitted
        tokens in turn (``_record_verified``)."""
        return params.logprobs is None and not params.has_penalties and not params.min_tokens

    def _wants_drafts(self, requests: list[Request]) -> bool:
        """Whether the next step of these decoding requests would speculate: then it runs on the synchronous path
        (the overlapped pipeline launches a step before the host knows the tokens drafts are proposed from). Only
        where the proposer may have drafts (``Proposer.may_propose`` on the tokens known now), so that text without
        repeats keeps the pipeline's overlap."""
        if self.proposer is None or not self.spec_policy.step_allows(len(requests), self.num_steps):
            return False
        for request in requests:
            track = self._tracks.get(request.request_id)
            draft = track.draft if track is not None else None
            if draft is not None and self.spec_policy.num_draft(draft, self.num_steps) > 0 \
                    and self.proposer.may_propose(request.token_ids, request.request_id):
                return True
        return False

    def _propose(self) -> tuple[dict[str, list[int]], _DeviceDrafts | None]:
        """Draft tokens for this step's decoding requests (request id -> drafts): none when speculation is off or
        the step has more decoding requests than ``SpeculativeConfig.max_running``. A request drafts at most what
        its max_tokens and max_seq_len leave after the bonus token, so a verify step never computes past them.
        Drafts a proposer left on the device (``PendingDrafts``) come as placeholders of their number, with the
        ``_DeviceDrafts`` that feeds them to the verify step and resolves them after it."""
        if self.proposer is None:
            return {}, None
        decoding = [r for r in self.scheduler.running if r.num_pending == 1]
        if not self.spec_policy.step_allows(len(decoding), self.num_steps):
            return {}, None
        max_seq_len, long_rope_from = self.scheduler_config.max_seq_len, self.scheduler_config.long_rope_from
        asks = []
        for request in decoding:
            track = self._tracks[request.request_id]
            if track.draft is None:
                continue
            num_draft = min(self.spec_policy.num_draft(track.draft, self.num_steps),
                            request.params.max_tokens - request.num_output_tokens - 1,
                            max_seq_len - request.num_tokens - 1)
            if long_rope_from is not None and not request.long_rope:  # its verify step stays before the switch
                num_draft = min(num_draft, long_rope_from - request.num_tokens)
            if num_draft > 0:
                asks.append(DraftRequest(request.request_id, request.token_ids, num_draft))
        if not asks:
            return {}, None
        proposals = self.proposer.propose_pending(asks)
        grammars = {ask.request_id: g for ask in asks if (g := self._tracks[ask.request_id].grammar) is not None}
        if grammars:  # structured requests keep the drafts their grammar accepts: their values are needed now
            if isinstance(proposals, PendingDrafts):
                proposals = proposals.resolve()
            proposals = [d[:grammars[ask.request_id].num_valid_prefix(d[:ask.max_tokens])]
                         if ask.request_id in grammars and d else d for ask, d in zip(asks, proposals)]
        if isinstance(proposals, PendingDrafts):
            counts = [min(n, ask.max_tokens) for ask, n in zip(asks, proposals.counts)]
            placeholders = {ask.request_id: [0] * n for ask, n in zip(asks, counts) if n}
            if not placeholders:
                proposals.resolve()
                return {}, None
            return placeholders, _DeviceDrafts(proposals, {ask.request_id: i for i, ask in enumerate(asks)})
        return {ask.request_id: drafts[:ask.max_tokens] for ask, drafts in zip(asks, proposals) if drafts}, None

    def _verify(self, sched: SchedulerOutput, logits: torch.Tensor, sampling: list[Request],
                device_drafts: _DeviceDrafts | None = None) -> list[RequestOutput]:
        """Sample and record a step that carried drafts (synchronous). A request with k drafts has k + 1 logits
        rows, sampled in turn from its generator as k + 1 one-token steps would be; ``accept_rows`` keeps the
        drafts up to the first that differs from the sampled token, then that token, and rewinds the generator to
        just after the last draw kept (so a seeded request's stream is the one it has without speculation).
        ``device_drafts``: drafts still on the device, read back with the sampled tokens (one wait)."""
        by_count = {id(q.request): q.num_draft for q in sched.seqs}
        # the request of each logits row (the drafts' values are not needed for sampling, only their number)
        rows = [r for r in sampling for _ in range(by_count.get(id(r), 0) + 1)]
        draw_states: list[torch.Tensor | None] = [None] * len(rows)
        token_ids, errors = self._sample(logits, rows, draw_states, filled=self._verify_masks(sched, sampling))
        if device_drafts is not None:
            tokens = device_drafts.read_with(token_ids, sched.seqs)
        else:
            tokens = token_ids.tolist()
        by_request = {id(q.request): q.draft_token_ids for q in sched.seqs}
        drafts = [by_request.get(id(r), []) for r in sampling]
        # (a speculating request never asks for logprobs: wanted is None on its rows)
        wanted = [r.params.logprobs if t != INVALID_TOKEN else None for r, t in zip(rows, tokens)]
        logprobs = self._logprobs(logits, token_ids, wanted, rows, errors)
        generators = [self._tracks[r.request_id].generator for r in sampling]
        emitted = accept_rows(tokens, drafts, generators, draw_states)
        plain, verified, row = [], [], 0
        for request, draft, emits in zip(sampling, drafts, emitted):
            if draft:
                verified.append((request, draft, emits))
            else:
                plain.append((request, emits[0], logprobs[row]))
            row += len(draft) + 1
        self.spec_num_steps += 1
        self._verified_this_call = True
        return self._record(sched, plain, errors, verified)

    def _verify_masks(self, sched: SchedulerOutput, sampling: list[Request]
                      ) -> tuple[list[int], list[GrammarState], torch.Tensor] | None:
        """``_fill_masks``' result for a verify step's rows: a structured request with k drafts has k + 1 rows, the
        grammar's mask at each (after each draft, ``fill_bitmasks_with_drafts``; its drafts were cut to what the
        grammar accepts at proposal, and their values are on the host). None when no request is structured."""
        by_request = {id(q.request): q for q in sched.seqs}
        rows, states, drafts, row = [], [], [], 0
        for request in sampling:
            q = by_request.get(id(request))
            k = q.num_draft if q is not None else 0
            track = self._tracks.get(request.request_id)
            if track is not None and track.grammar is not None:
                rows += range(row, row + k + 1)
                states += [track.grammar] * (k + 1)
                drafts.append(q.draft_token_ids if k else [])
            row += k + 1
        if not rows:
            return None
        unique = list(dict.fromkeys(states))  # each state once, in order (its k + 1 rows are consecutive)
        return rows, states, fill_bitmasks_with_drafts(unique, drafts, self.grammars.num_words,
                                                       pin_memory=self.device.type == "cuda")

    def _record_verified(self, request: Request, drafts: list[int], emitted: list[int]) -> RequestOutput:
        """Append a verified decode's emitted tokens one at a time, each through the stop checks as a decode step
        would (a stop, EOS or max_tokens in the middle drops the rest), then commit the accepted drafts' KV slots
        and return the blocks only rejected drafts used. One delta for all of them."""
        track = self._tracks[request.request_id]
        num_accepted = len(emitted) - 1
        self.spec_num_verified += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += num_accepted
        self.spec_policy.update(track.draft, len(drafts), num_accepted, self.num_steps)
        finish: str | None = None
        for token in emitted:
            if track.grammar is not None and not track.grammar.advance(token):  # a structured request's, in turn
                return self._fail(request, _outside_grammar(token, track.grammar))
            request.token_ids.append(token)
            finish = self._stop_check(request, track, token)
            if finish is not None:
                break  # the request is finished below: its blocks, lookahead ones included, go back
        if finish is None:
            # the step computed the K/V of every emitted token but the last (that one is fed next step): the
            # accepted drafts' slots hold the right K/V and become committed; they may now fill blocks, which are
            # published to the prefix cache. The rejected drafts' slots are past the committed tokens: the blocks
            # they alone used are returned, and the one holding the next position is overwritten when it is fed.
            request.num_computed_tokens += num_accepted
            committed = self.kv.allocate_slots(request.request_id, request.token_ids, num_accepted)
            assert committed == [], "accepted drafts were computed in lookahead slots the request already holds"
            self.kv.free_lookahead(request.request_id)
        return self._delta(request, track, finish)

    def _launch_next(self, previous: _InFlight) -> _InFlight | None:
        """Launch the step after ``previous`` (still in flight), or return None where the synchronous path must
        run it (see ``step``). Its sequences, in the scheduler's order: a decode for every request that samples
        in ``previous`` and continues, its input the token ``previous`` sampled (its KV slot is reserved as a
        lookahead slot, committed once ``previous`` is read back); the next chunk of every other running request
        (prompts whose tokens are all known); then admissions, within the token budget and the free blocks
        (no preemption here: what does not fit waits)."""
        scheduler = self.scheduler
        admit = scheduler.admits_now()
        if not self._overlappable(scheduler.running) or (admit and not self._overlappable(scheduler.waiting)):
            return None
        if self._wants_drafts([r for r in previous.sampling if r.status is RequestStatus.RUNNING]):
            return None  # speculation verifies on the synchronous path (see step)
        max_seq_len = self.scheduler_config.max_seq_len
        long_rope_from = self.scheduler_config.long_rope_from
        budget = self.scheduler_config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        in_flight = {id(r) for r in previous.sampling}
        for row, request in enumerate(previous.sampling):
            if request.status is not RequestStatus.RUNNING:  # aborted or timed out since
                continue
            # the token in flight is the request's last when it reaches max_tokens or max_seq_len
            if request.num_output_tokens + 1 >= request.params.max_tokens or request.num_tokens + 1 >= max_seq_len:
                continue
            if long_rope_from is not None and not request.long_rope and request.num_tokens + 1 > long_rope_from:
                return None  # its token in flight passes LongRoPE's switch: recomputed by the synchronous path
            if budget == 0:
                break
            if self.kv.allocate_slots(request.request_id, request.token_ids, 0, num_lookahead_tokens=1) is None:
                return None  # out of blocks: the synchronous path preempts
            seqs.append(ScheduledSeq(request, request.num_tokens, 1, in_flight_row=row))
            budget -= 1
        for request in scheduler.running:  # prompt chunks still to compute
            if id(request) in in_flight or request.status is not RequestStatus.RUNNING or budget == 0:
                continue
            context = self.kv.num_tokens(request.request_id)  # chunks in flight included
            num_new = min(request.num_tokens - context, budget)
            if num_new <= 0 or self.kv.allocate_slots(request.request_id, request.token_ids, num_new) is None:
                continue
            seqs.append(ScheduledSeq(request, context, num_new))
            budget -= num_new
        if admit and budget > 0:
            budget = scheduler.admit(seqs, budget)
        if not seqs:
            return None
        sched = SchedulerOutput(seqs, [], self.scheduler_config.max_num_batched_tokens - budget)
        logits, sampling = self._run(sched, previous.tokens)
        self.num_steps += 1
        if not sampling:  # only prompt chunks that end before the prompt does: nothing to read back
            self.scheduler.update(sched, {})
            return None
        step = _InFlight(sched, sampling, logits)
        if any(self._tracks[r.request_id].grammar is not None for r in sampling):
            return step  # sampled by ``step`` once previous's tokens have advanced the grammars
        return step.launch_sampled(self._sample(logits, sampling))

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """Read back an in-flight step's tokens (waiting for that step only), record and emit them, and
        commit the KV slots reserved for the step launched after it."""
        tokens = step.read(self._device_failure)
        live = [(r, t, None) for r, t in zip(step.sampling, tokens) if r.status is RequestStatus.RUNNING]
        outputs = self._record(step.sched, live, step.errors,
                               before_emit=self._start_masks if self.config.mask_overlap else None)
        if self._inflight is not None:
            for q in self._inflight.sched.seqs:
                request = q.request
                if q.in_flight_row is not None and request.status is RequestStatus.RUNNING:
                    committed = self.kv.allocate_slots(request.request_id, request.token_ids, 1)
                    assert committed is not None, "a reserved lookahead slot needs no new block"
            if not any(r.status is RequestStatus.RUNNING for r in self._inflight.sampling):
                self._drop_inflight()  # every request that samples in it has finished: nothing left to read
        return outputs

    def _drop_inflight(self) -> None:
        """Forget the in-flight step, after waiting for it: DecodeGraphs refills a staging buffer two launches
        later on the promise that the step before was read back (see DecodeGraphs.run); and for its masks, whose
        grammar states may be advanced next."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            if step.masks is not None:
                wait_futures([step.masks])
            try:
                step.read(self._device_failure)
            except Exception as e:  # a failed device or rank (finish_all after an error) must not fail the cleanup
                log.warning("dropping the in-flight decode step: %s", e)
    def _pack(self, sched: SchedulerOutput) -> tuple[PackedStep, list[Request]]:
        """The scheduled sequences packed back to back on the host, and the requests that sample, in order."""
        bs = self.block_size
        long_rope = self.scheduler_config.long_rope_from is not None  # (the offset is read only where there is one)
        step = PackedStep([], [], [], [0], [], [], [])
        sampling: list[Request] = []
        for seq in sched.seqs:
            request, start, n = seq.request, seq.num_context, seq.num_new
            table = self.kv.block_table(request.request_id)
            # a token in flight is not on the host yet: a placeholder, replaced on the device (``_run``); drafts
            # follow a decode's last token, in its lookahead slots
            step.input_ids.extend([0] if seq.in_flight_row is not None
                                  else request.token_ids[start:start + n - seq.num_draft] + seq.draft_token_ids)
            offset = request.rope_offset if long_rope else 0
            step.positions.extend(range(start + offset, start + n + offset))
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            step.cu_seqlens_q.append(len(step.input_ids))
            step.context_lens.append(start)
            step.block_tables.append(table)
            if seq.samples:  # the last row; with drafts, the last k + 1 (each draft is checked, see _verify)
                step.logits_rows.extend(range(len(step.input_ids) - 1 - seq.num_draft, len(step.input_ids)))
                sampling.append(request)
        return step, sampling

    def _prepare(self, sched: SchedulerOutput, step: PackedStep) -> StepInput:
        """The packed step as tensors over the paged cache (the eager path). Copied through pinned memory
        without a host sync, so that the overlapped pipeline keeps running ahead."""
        device = self.device

        def tensor(values, dtype=torch.long):
            t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
            return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

        seqs = [SeqSlice(PagedSequenceKV(self.storage, table, q.num_context), q.num_context, q.num_new)
                for q, table in zip(sched.seqs, step.block_tables)]
        inp = StepInput(tensor(step.input_ids), tensor(step.positions), seqs, tensor(step.logits_rows))
        if self.executor.use_kernels:  # the fused attention kernels read the cache through these
            num_seqs = len(step.block_tables)
            tables = TableStaging(num_seqs, max([1, *map(len, step.block_tables)]), pin=False) \
                .fill(step.block_tables, num_seqs)  # row by row: see TableStaging
            if tables.shape[1] == 0:  # no sequence holds a block yet: one column of zeros
                tables = torch.zeros(num_seqs, 1, dtype=torch.int32)
            inp.paged = PagedAttentionMetadata(
                self.storage.k, self.storage.v, tensor(step.slots), tensor(tables),
                tensor(step.seq_lens, torch.int32), tensor(step.context_lens, torch.int32),
                tensor(step.cu_seqlens_q, torch.int32),
                all(q.num_new == 1 for q in sched.seqs), fresh=all(q.num_context == 0 for q in sched.seqs),
                mixed=mixed_step([q.num_new for q in sched.seqs]))
        return inp

    def _replay(self, sched: SchedulerOutput, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A decode-only step through its captured CUDA graph. ``input_ids``: the step's tokens on the device
        (sampled by the step in flight), else read from the requests."""
        bs = self.block_size
        long_rope = self.scheduler_config.long_rope_from is not None
        ids, positions, slots, tables = [], [], [], []
        for q in sched.seqs:
            p, table = q.num_context, self.kv.block_table(q.request.request_id)
            if input_ids is None:
                ids.append(q.request.token_ids[p])
            # (DecodeGraphs reads the lengths without LongRoPE's offset)
            positions.append(p + q.request.rope_offset if long_rope else p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
        return self.graphs.run(ids if input_ids is None else input_ids, positions, slots, tables)

    def _chains(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether a step is a verify step the verify-step decode graphs take: decodes only (one known token each,
        then its drafts, every row sampled, none in flight), some with drafts, within their largest bucket."""
        return (any(q.num_draft for q in seqs)
                and all(q.samples and q.in_flight_row is None and q.num_new == q.num_draft + 1 for q in seqs)
                and self.verify_graphs.bucket_for(sum(q.num_new for q in seqs)) is not None)

    def _replay_verify(self, sched: SchedulerOutput, drafts: _DeviceDrafts | None) -> tuple[torch.Tensor, list]:
        """A verify step (``_chains``) on the verify-step decode graphs: each request's last token and its drafts
        as rows at consecutive positions over its block table; returns the logits of every row (k + 1 a request, in
        order, as the step graphs' verify rows) and the requests."""
        bs = self.block_size
        long_rope = self.scheduler_config.long_rope_from is not None
        ids, positions, slots, tables, starts = [], [], [], [], [0]
        for q in sched.seqs:
            p, table = q.num_context, self.kv.block_table(q.request.request_id)
            offset = q.request.rope_offset if long_rope else 0
            ids += [q.request.token_ids[p], *q.draft_token_ids]  # (placeholders for drafts still on the device)
            positions.extend(range(p + offset, p + q.num_new + offset))
            slots.extend(table[j // bs] * bs + j % bs for j in range(p, p + q.num_new))
            tables += [table] * q.num_new
            starts.append(starts[-1] + q.num_new)
        input_ids = ids if drafts is None else _feed(to_device(ids, self.device), drafts.feed(sched.seqs, starts))
        logits = self.verify_graphs.run(input_ids, positions, slots, tables)
        if self._hidden_wanted():
            self._record_hidden(sched, self.verify_graphs.hidden, starts)
        return logits, [q.request for q in sched.seqs]

    def _emit(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Detokenize the new token (its grammar has taken it, see ``_record``), check stop conditions, and finish
        the request if it is done."""
        track = self._tracks[request.request_id]
        if logprob is not None:
            track.logprobs.append(logprob)
        return self._delta(request, track, self._stop_check(request, track, token))

    def _stop_check(self, request: Request, track: _Track, token: int) -> str | None:
        """Detokenize ``token`` (the request's newest, already appended) and check the stop conditions; returns
        the finish reason ("stop", "length"), or None while the request goes on."""
        finish: str | None = None
        if token in track.stop_ids:
            finish = "stop"
        else:
            track.text += track.detok.push(token)
            cut, _ = track.stops.check(track.text)
            if cut is not None:
                track.text, finish = track.text[:cut], "stop"
        if finish is None:
            if track.grammar is not None and track.grammar.finished:
                finish = "stop"  # the grammar is complete: nothing but EOS could follow
            elif (request.num_output_tokens >= request.params.max_tokens
                  or request.num_tokens >= self.scheduler_config.max_seq_len):
                finish = "length"
            if finish is not None:  # the end: the text the detokenizer held back, then the stop strings over it
                track.text += track.detok.flush()
                cut, _ = track.stops.check(track.text)
                if cut is not None:
                    track.text, finish = track.text[:cut], "stop"
        return finish

    def _delta(self, request: Request, track: _Track, finish: str | None, error: str | None = None) -> RequestOutput:
        """What the request produced since its last delta; finishing frees its blocks now."""
        safe = len(track.text) if finish else track.stops.check(track.text)[1]
        text = track.text[track.num_emitted:safe] if safe > track.num_emitted else ""
        track.num_emitted = max(track.num_emitted, safe)
        num_output = request.num_output_tokens
        new_ids = request.token_ids[request.num_prompt_tokens + track.num_tokens_emitted:]
        new_lps = track.logprobs[track.num_tokens_emitted:] if request.params.logprobs is not None else None
        track.num_tokens_emitted = num_output
        if finish:
            self.scheduler.finish_request(request.request_id)
            del self._tracks[request.request_id]
            self._compiling.pop(request.request_id, None)
            if self.proposer is not None:
                self.proposer.release(request.request_id)
        return RequestOutput(request.request_id, text, new_ids, new_lps, finish is not None, finish,
                             request.num_prompt_tokens, num_output,
                             max(request.num_cached_tokens, 0), error)

    def _reap(self) -> list[RequestOutput]:
        """Finish aborted and timed-out requests, freeing their blocks before the step is scheduled."""
        outputs = []
        while self._aborts:
            request_id, reason = self._aborts.popleft()
            request = self.scheduler.get(request_id)
            if request is not None:
                outputs.append(self._delta(request, self._tracks[request_id], reason))
        now = time.monotonic()
        for request in [r for r in self._unfinished() if r.deadline is not None and now > r.deadline]:
            outputs.append(self._delta(request, self._tracks[request.request_id], "timeout",
                                       f"the request did not finish within its timeout "
                                       f"({request.deadline - request.arrival_time:.1f}s)"))
        return outputs

    def finish_all(self, reason: str, error: str | None = None) -> list[RequestOutput]:
        """Finish every request now (engine failure, shutdown); returns their final deltas."""
        self._aborts.clear()
        self._drop_inflight()  # its tokens go with the requests
        return [self._delta(r, self._tracks[r.request_id], reason, error) for r in self._unfinished()]

    def _unfinished(self) -> list[Request]:
        scheduler = self.scheduler
        return list(scheduler.running) + list(scheduler.waiting) + list(scheduler.preparing.values())

    def _take_compiled(self) -> list[RequestOutput]:
        """Make the requests whose grammar has compiled schedulable (a grammar that does not compile fails its
        request alone). When nothing else could run, wait a little for a compile rather than spin."""
        idle = not self.scheduler.running and not self.scheduler.waiting and self._inflight is None
        if idle:
            wait_futures(list(self._compiling.values()), timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        outputs = []
        for request_id, future in [(i, f) for i, f in self._compiling.items() if f.done()]:
            del self._compiling[request_id]
            request = self.scheduler.get(request_id)
            if future.cancelled():  # the compiler was closed under it: the engine's shutdown, not the client's fault
                log.warning("request %s aborted: its grammar's compile was cancelled (the engine is closing)",
                            request_id)
                outputs.append(self._delta(request, self._tracks[request_id], "abort",
                                           "the engine is closing: the request's grammar compile was cancelled"))
                continue
            error = future.exception()
            if error is not None:  # the grammar's own fault (the client's), or the compiler's
                outputs.append(self._fail(request, f"{GRAMMAR_ERROR_PREFIX}{error}"
                                          if isinstance(error, StructuredOutputError)
                                          else f"compiling the grammar failed: {type(error).__name__}: {error}"))
                continue
            self._tracks[request_id].grammar = future.result().new_state()
            self.scheduler.mark_ready(request_id)
        return outputs

    # --- offline use -----------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
            ) -> list[RequestOutput]:
        """Run ``prompts`` together to completion; returns one RequestOutput per prompt holding all its
        text, token ids and logprobs (in prompt order). Admits as many as the waiting queue takes
        and the rest as room frees up."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [f"run-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
        results = {i: RequestOutput(i, "", [], None, False, None, len(p), 0) for i, p in zip(ids, prompts)}
        queued, num_done = 0, 0
        while num_done < len(prompts):
            while queued < len(prompts) and self.scheduler.has_capacity:
                self.add_request(prompts[queued], plist[queued], request_id=ids[queued])
                queued += 1
            for out in self.step():
                acc = results[out.request_id]
                acc.text += out.text
                acc.token_ids += out.token_ids
                if out.logprobs is not None:
                    acc.logprobs = (acc.logprobs or []) + out.logprobs
                acc.finished, acc.finish_reason, acc.error = out.finished, out.finish_reason, out.error
                acc.num_output_tokens, acc.num_cached_tokens = out.num_output_tokens, out.num_cached_tokens
                num_done += out.finished
        return [results[i] for i in ids]

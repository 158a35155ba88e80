"""The draft-model proposer: a second, smaller artifact with the target's vocabulary drafts k greedy tokens.

It keeps its own KV cache per request (``SequenceKV``, contiguous, sized for the target's max_seq_len: a draft
model's cache is small), for at most ``max_seqs`` requests (the speculation policy's ``max_running``: no step
speculates for more), the least recently used dropped first (a request that speculates again refeeds its tokens);
the serving memory plan reserves those caches (:meth:`DraftModelProposer.kv_bytes`). It records what a cache
holds: the request's tokens as of its last proposal, then the drafts it fed then. At the next proposal the request
has kept some of those drafts (the accepted ones) and not the others; the cache is cut back to the longest prefix
both agree on and the tokens after it are fed again:

    cache holds:   t_0 .. t_{n-1}  d_1 .. d_{k-1}                (d_k was drafted but never fed)
    request now:   t_0 .. t_{n-1}  d_1 .. d_a  x_a ...
    fed now:                                   x_a ...            then one greedy token per step, k times

One proposal is one varlen step over every request (each request's new tokens, the last row's logits), then k - 1
one-token steps; a long first catch-up (a prompt) is fed in chunks of the draft's max_num_tokens first. Drafts are
the argmax, so the draft distribution is one-hot and ``runtime.speculative.accept_drafts`` verifies them exactly.

Where the draft runs the Triton kernels (CUDA), its caches live in one paged storage instead
(:class:`PagedDraft`): request slot i owns blocks [i * B, (i + 1) * B) for good (B = blocks of max_seq_len), so its
block table never changes. A proposal is then a chain of one-token steps captured as one CUDA graph per batch bucket
and length, whose drafts stay on the device (``propose_pending``: the serving engine feeds them to the verify step
there and reads them back with its tokens; ``propose`` reads them at once). The chain feeds each request's new
tokens (after a verify step one or two: the target's own token, and the last draft where all were accepted), then
each step's argmax to the next, on the device (positions, slots and lengths computed there from the first). A
request with more new tokens (a prompt) takes a catch-up step first (``runtime.cuda_graphs.StepGraphs`` over the
draft's storage) and the chain drafts the rest. Without kernels (the CPU reference path) the draft runs its
per-sequence caches eagerly, as above.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.artifact import ArtifactError, open_artifact
from runtime.engine import Engine
from runtime.executor import PagedAttentionMetadata, SeqSlice, StepInput
from runtime.kv_cache import SequenceKV
from runtime.memory import tensor_bytes
from runtime.speculative import DraftRequest, PendingDrafts, Proposer, SpeculativeConfigError

log = logging.getLogger(__name__)

CHAIN_BUCKETS = (1, 2, 4, 8, 16, 32)  # batch buckets of the draft chain's CUDA graphs (and max_seqs)


@dataclass
class _DraftSeq:
    """One request's state in the draft model."""

    kv: SequenceKV | int  # its own cache, or its slot in the paged storage (PagedDraft)
    token_ids: list[int] = field(default_factory=list)  # what the cache holds, position by position
    num_known: int = 0  # of those, the leading tokens the request had at the last proposal (kept for good)


class DraftModelProposer(Proposer):
    """Greedy drafts from a second artifact (see the module docstring)."""

    method = "draft"

    def __init__(self, draft: Engine, target_vocab_size: int, target_tokenizer, max_seq_len: int,
                 max_seqs: int = 8, max_draft_tokens: int = 4, paged: bool | None = None,
                 cuda_graphs: bool = True) -> None:
        """``max_draft_tokens``: the most drafts a request gets per proposal (the chain's length + 1). ``paged``:
        the paged storage and its steps (default: where the draft runs the kernels and its head sizes have the
        paged attention kernel); ``cuda_graphs``: those steps replayed as CUDA graphs (on CUDA; eager otherwise)."""
        _check_same_vocabulary(draft, target_vocab_size, target_tokenizer)
        if max_seqs < 1:
            raise SpeculativeConfigError(f"a draft model needs room for at least one request's cache, got {max_seqs}")
        if max_draft_tokens < 1:
            raise SpeculativeConfigError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.draft = draft
        self.max_seq_len = min(max_seq_len, draft.limits.max_seq_len)  # the draft cannot look further
        self.max_seqs = max_seqs
        self.max_draft_tokens = max_draft_tokens
        self._seqs: OrderedDict[str, _DraftSeq] = OrderedDict()  # least recently proposed for first
        if paged is None:
            from kernels.paged_attention import SUPPORTED_HEAD_DIMS

            paged = draft.executor.use_kernels and all(d in SUPPORTED_HEAD_DIMS for d in draft.kv_layout.head_dim)
        self.paged = PagedDraft(draft, max_seqs, self.max_seq_len, max_draft_tokens,
                                capture=cuda_graphs and draft.device.type == "cuda") if paged else None

    @classmethod
    def load(cls, path: str | Path, device: torch.device, target_vocab_size: int, target_tokenizer,
             max_seq_len: int, max_seqs: int = 8, max_draft_tokens: int = 4,
             cuda_graphs: bool = True) -> DraftModelProposer:
        """Load the draft artifact on ``device`` (verified like any artifact, see ``Engine.load``). A draft for
        one GPU only (a sharded one is refused before any rank starts). Its quality gates do not stop it: the target
        verifies every draft token, so a poor draft costs acceptance, never output (a failed one is logged)."""
        opened = open_artifact(path, check_hashes=False)  # Engine.load checks the hashes
        if opened.tp_size > 1:
            raise ArtifactError(f"{path} is sharded for tp_size {opened.tp_size}; a draft model runs on one GPU "
                                f"beside the target: build it with parallel.tp_size 1")
        gates = opened.manifest.get("quantization", {}).get("gates") or {}
        if not gates.get("passed", True):
            log.warning("draft model %s failed its quality gates (%s) when it was built; serving with it anyway: "
                        "the target verifies every draft token", path, ", ".join(gates.get("failed", [])))
        return cls(Engine.load(path, device, allow_failed_gate=True), target_vocab_size, target_tokenizer,
                   max_seq_len, max_seqs, max_draft_tokens, cuda_graphs=cuda_graphs)

    def kv_bytes(self) -> int:
        """The most bytes the per-request draft caches hold at once: max_seqs caches of max_seq_len tokens (whole
        blocks of them in the paged storage)."""
        if self.paged is not None:
            return self.paged.storage.bytes()
        return self.max_seqs * self.max_seq_len * self.draft.kv_layout.bytes_per_token()

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and self.paged is not None:
            self.paged.free(seq.kv)

    def close(self) -> None:
        """Destroy the draft's CUDA graphs now (idempotent)."""
        if self.paged is not None:
            self.paged.close()

    def weights_bytes(self) -> int:
        return tensor_bytes(self.draft.executor.params.values())

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = self.propose_pending(requests)
        return drafts.resolve() if isinstance(drafts, PendingDrafts) else drafts

    def propose_pending(self, requests: Sequence[DraftRequest]) -> list[list[int]] | PendingDrafts:
        """As ``propose``; on the paged storage the drafts stay on the device (``PendingDrafts``): the chain is
        queued and this returns at once, so the host prepares the verify step while the device drafts."""
        drafts: list[list[int]] = [[] for _ in requests]
        requests = [DraftRequest(r.request_id, r.token_ids, min(r.max_tokens, self.max_draft_tokens))
                    for r in requests]
        # requests whose tokens plus drafts fit the draft's context; the others get none
        live = [i for i, r in enumerate(requests) if len(r.token_ids) + r.max_tokens <= self.max_seq_len]
        live = live[:self.max_seqs]  # the policy asks for no more at once; the caches are planned for that many
        if not live:
            return drafts
        for i in live:  # this step's requests are the most recent: a new one's cache evicts none of theirs
            if requests[i].request_id in self._seqs:
                self._seqs.move_to_end(requests[i].request_id)
        pending = [self._catch_up(requests[i]) for i in live]  # per live request: the tokens to feed now
        if self.paged is not None:
            return self._propose_paged(requests, live, pending)
        tokens = self._step([requests[i].request_id for i in live], pending)
        for i, t in zip(live, tokens):
            drafts[i].append(t)
        for j in range(1, max(requests[i].max_tokens for i in live)):
            live = [i for i in live if requests[i].max_tokens > j]
            tokens = self._step([requests[i].request_id for i in live], [[drafts[i][-1]] for i in live])
            for i, t in zip(live, tokens):
                drafts[i].append(t)
        for i in range(len(requests)):
            seq = self._seqs.get(requests[i].request_id)
            if seq is not None and drafts[i]:
                seq.num_known = len(requests[i].token_ids)
        return drafts

    def _propose_paged(self, requests: Sequence[DraftRequest], live: list[int],
                       pending: list[list[int]]) -> PendingDrafts:
        """The drafts of ``live`` through the paged storage: one catch-up step, one chain of k - 1 steps, left on
        the device; what the caches hold is recorded once they are read (``PendingDrafts.resolve``)."""
        seqs = [self._seqs[requests[i].request_id] for i in live]
        k = max(requests[i].max_tokens for i in live)
        tokens, where = self.paged.launch([s.kv for s in seqs], [len(s.token_ids) for s in seqs], pending, k)
        sources: list[list[int]] = [[] for _ in requests]
        for col, i in enumerate(live):
            sources[i] = where[col][:requests[i].max_tokens]
        known = [len(requests[i].token_ids) for i in live]

        def record(drafts: list[list[int]]) -> None:
            for i, seq, fed, num_known in zip(live, seqs, pending, known):
                # the cache holds the fed tokens and the drafts fed after them (the chain's later writes, for a
                # request that wanted fewer, lie past what token_ids records and are written over when it grows)
                seq.token_ids += fed + drafts[i][:-1]
                seq.num_known = num_known

        return PendingDrafts(tokens, sources, record)

    def _catch_up(self, request: DraftRequest) -> list[int]:
        """Cut the request's draft cache back to what still matches its tokens, feed all but the last few of the
        rest in chunks (a new request's prompt), and return the tokens left to feed in the batched step."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            while len(self._seqs) >= self.max_seqs:  # the least recently proposed for: none of this step's (moved
                _, old = self._seqs.popitem(last=False)  # to the end first; a step has at most max_seqs requests)
                if self.paged is not None:
                    self.paged.free(old.kv)
            kv = (self.paged.allocate() if self.paged is not None
                  else SequenceKV(self.draft.kv_layout, self.max_seq_len, self.draft.device))
            seq = self._seqs[request.request_id] = _DraftSeq(kv)
        self._seqs.move_to_end(request.request_id)
        token_ids = request.token_ids
        # what the request had at its last proposal is kept (its tokens only grow), but its last token is always fed
        # again: a request proposed for twice with the same tokens (left unscheduled in between) has one to feed
        keep = min(seq.num_known, len(token_ids) - 1)
        while keep < min(len(seq.token_ids), len(token_ids) - 1) and seq.token_ids[keep] == token_ids[keep]:
            keep += 1
        del seq.token_ids[keep:]
        chunk = self.draft.limits.max_num_tokens
        if self.paged is not None:  # the storage needs no truncation: positions past token_ids are written over
            chunk = self.paged.max_tokens
            while len(token_ids) - len(seq.token_ids) > chunk:
                start = len(seq.token_ids)
                self.paged.feed([seq.kv], [start], [list(token_ids[start:start + chunk])])
                seq.token_ids += token_ids[start:start + chunk]
            return list(token_ids[len(seq.token_ids):])
        seq.kv.truncate(keep)
        while len(token_ids) - len(seq.token_ids) > chunk:
            start = len(seq.token_ids)
            self._forward([seq], [list(token_ids[start:start + chunk])])
        return list(token_ids[len(seq.token_ids):])

    def _step(self, request_ids: list[str], new_tokens: list[list[int]]) -> list[int]:
        """Feed each request's new tokens in one varlen step; returns each one's greedy next token."""
        logits = self._forward([self._seqs[r] for r in request_ids], new_tokens)  # [len(request_ids), vocab]
        return torch.argmax(logits, dim=-1).tolist()

    @torch.inference_mode()
    def _forward(self, seqs: list[_DraftSeq], new_tokens: list[list[int]]) -> torch.Tensor:
        device = self.draft.device
        ids, positions, slices, rows = [], [], [], []
        for seq, tokens in zip(seqs, new_tokens):
            start = len(seq.token_ids)
            ids += tokens
            positions += range(start, start + len(tokens))
            slices.append(SeqSlice(seq.kv, start, len(tokens)))
            rows.append(len(ids) - 1)
        inp = StepInput(torch.tensor(ids, dtype=torch.long, device=device),
                        torch.tensor(positions, dtype=torch.long, device=device), slices,
                        torch.tensor(rows, dtype=torch.long, device=device))
        logits = self.draft.executor.forward(inp)
        for seq, tokens in zip(seqs, new_tokens):
            seq.token_ids += tokens
            seq.kv.num_tokens = len(seq.token_ids)
        return logits


class PagedDraft:
    """The draft's caches in one paged storage, a fixed run of blocks per request slot, and its two kinds of step:
    the catch-up (``StepGraphs``) and the chain of one-token steps (a CUDA graph per batch bucket), see the module
    docstring. ``capture=False`` runs the same steps eagerly (the CPU, under the Triton interpreter).

    A request with at most 1 + FORCED new tokens (after a verify step: the target's own token, and the last draft
    too where it accepted all) needs no catch-up step: the chain feeds them first, then drafts."""

    FORCED = 1

    def __init__(self, draft: Engine, max_seqs: int, max_seq_len: int, max_draft_tokens: int, capture: bool,
                 buckets: tuple[int, ...] = CHAIN_BUCKETS) -> None:
        from runtime.cuda_graphs import StagedInputs, StepGraphs
        from runtime.paged_kv import PagedKVStorage

        self.executor, self.device, self.capture = draft.executor, draft.device, capture
        bs = self.block_size = draft.limits.tokens_per_block
        self.blocks_per_seq = -(-max_seq_len // bs)
        self.capacity = self.blocks_per_seq * bs
        self.storage = PagedKVStorage(draft.kv_layout, max_seqs * self.blocks_per_seq, bs, draft.device)
        self._free = list(range(max_seqs - 1, -1, -1))  # request slots; pop() takes the lowest
        self.max_tokens = draft.limits.max_num_tokens
        if self.max_tokens < max_seqs:  # the last catch-up feeds each request at least one token in one step
            raise SpeculativeConfigError(f"the draft artifact takes {self.max_tokens} tokens a step, fewer than the "
                                         f"{max_seqs} requests that may speculate together (max_running)")
        self.steps = StepGraphs(self.executor, self.storage, self.max_tokens, max_seqs, max_seq_len, capture=capture)
        self.max_draft_tokens = max_draft_tokens
        # the longest chain: k one-token steps after up to FORCED more new tokens of each request (fed first)
        self.chain_len = max_draft_tokens + self.FORCED
        self.buckets = sorted({b for b in buckets if b < max_seqs} | {max_seqs})
        top, dev = self.buckets[-1], draft.device
        # slot i's block table, for good: blocks [i * B, (i + 1) * B)
        self.tables = torch.arange(max_seqs * self.blocks_per_seq, dtype=torch.int32,
                                   device=dev).view(max_seqs, self.blocks_per_seq)
        # the chain's static inputs, one buffer [first_pos | slot_rows | valid | first | num_forced | forced...]: each
        # row's first token and its position, its slot, whether it is a request (1 / 0), and its new tokens after
        # the first (fed before the chain drafts) and how many. Staged in pinned memory and copied at once, queued
        # behind the catch-up step instead of waiting for it; one set is enough: a proposal's drafts are read back
        # (``PendingDrafts.resolve``) before the next proposal
        self._inputs = StagedInputs({"rows": (torch.long, (5 + self.FORCED, top))}, dev, dev.type == "cuda", sets=1)
        rows = self._inputs.device["rows"]
        self.first_pos, self.slot_rows, self.valid, self.first, self.num_forced = rows[0], rows[1], rows[2], rows[3], \
            rows[4]
        self.forced = rows[5:]
        self.rows = torch.arange(top, dtype=torch.long, device=dev)
        self.cu_seqlens_q = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.out = torch.zeros(max(self.chain_len, 1), top, dtype=torch.long, device=dev)  # [step, row] the drafts
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch bucket, chain length)
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                for length in range(self.chain_len, 0, -1):
                    self._graphs[b, length] = self._capture(b, length, pool)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def _chain(self, b: int, length: int) -> None:
        """``length`` one-token steps over rows [0, b): each row's ``first``, then its forced tokens, then the
        argmax of each step feeds the next; each step's argmax into ``out``."""
        bs = self.block_size
        ids = self.first[:b]
        tables = self.tables.index_select(0, self.slot_rows[:b])
        for j in range(length):
            if 0 < j <= self.FORCED:  # a row's forced tokens come before its own drafts
                ids = torch.where(self.num_forced[:b] >= j, self.forced[j - 1, :b], ids)
            pos = self.first_pos[:b] + j
            ok = (self.valid[:b] != 0) & (pos < self.capacity)  # past the cache (a request that wants fewer): unwritten
            pos = pos.clamp(max=self.capacity - 1)
            slot = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long() * bs + pos % bs
            slot = torch.where(ok, slot, torch.full_like(slot, -1))
            md = PagedAttentionMetadata(self.storage.k, self.storage.v, slot, tables, (pos + 1).to(torch.int32),
                                        pos.to(torch.int32), self.cu_seqlens_q[:b + 1], decode_only=True)
            logits = self.executor.forward(StepInput(ids, pos, [], self.rows[:b], paged=md))
            ids = torch.argmax(logits, dim=-1)
            self.out[j, :b].copy_(ids)

    def _capture(self, b: int, length: int, pool) -> torch.cuda.CUDAGraph:
        self.valid.zero_()  # warm-up and capture write nothing
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # autotuning and lazy initialisation happen outside the capture
                self._chain(b, length)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._chain(b, length)
        return graph

    def _pack(self, slots: list[int], starts: list[int], new_tokens: list[list[int]]):
        """The step feeding ``new_tokens[i]`` to slot ``slots[i]`` from position ``starts[i]``; logits of each
        sequence's last new token."""
        from runtime.cuda_graphs import PackedStep

        bs, per = self.block_size, self.blocks_per_seq
        ids, positions, slot_ids, cu, rows = [], [], [], [0], []
        for slot, start, tokens in zip(slots, starts, new_tokens):
            ids += tokens
            for p in range(start, start + len(tokens)):
                positions.append(p)
                slot_ids.append((slot * per + p // bs) * bs + p % bs)
            cu.append(len(ids))
            rows.append(len(ids) - 1)
        tables = [list(range(slot * per, (slot + 1) * per)) for slot in slots]
        return PackedStep(ids, positions, slot_ids, cu, list(starts), tables, rows)

    def feed(self, slots: list[int], starts: list[int], new_tokens: list[list[int]]) -> torch.Tensor:
        """One step feeding each slot its new tokens; the greedy next token of each, on the device."""
        logits = self.steps.run(self._pack(slots, starts, new_tokens))
        return torch.argmax(logits, dim=-1)

    def propose(self, slots: list[int], starts: list[int], pending: list[list[int]], k: int) -> list[list[int]]:
        """Feed each slot its pending tokens (from ``starts``), then draft: returns [k][len(slots)] greedy tokens
        (k is at most max_draft_tokens), read back (:meth:`launch` leaves them on the device)."""
        tokens, sources = self.launch(slots, starts, pending, k)
        flat = tokens.tolist()
        return [[flat[sources[i][j]] for i in range(len(slots))] for j in range(min(k, self.max_draft_tokens))]

    def launch(self, slots: list[int], starts: list[int], pending: list[list[int]],
               k: int) -> tuple[torch.Tensor, list[list[int]]]:
        """Queue the proposal of :meth:`propose` without waiting for it: returns a flat tensor on the device and,
        per slot, the indices of its k drafts in it, in order. The tensor is the chain's output buffer (or a copy):
        it holds these drafts until the next proposal is launched.

        Where every request feeds one token (the usual case after a verify step: the chain fed the drafts the target
        accepted, so only the target's own token is new), the chain takes it as its first step, with no catch-up
        step; otherwise the catch-up step feeds the pending tokens and the chain drafts the rest."""
        k = min(k, self.max_draft_tokens)
        n = len(slots)
        if all(1 <= len(p) <= 1 + self.FORCED for p in pending):
            extra = max(map(len, pending)) - 1
            self._run_chain(slots, list(starts), k + extra, first_tokens=[p[0] for p in pending],
                            forced=[p[1:] for p in pending])
            top = self.out.shape[1]  # out is [step, row]: row i's draft j is step len(p) - 1 + j
            return self.out.view(-1), [[(len(p) - 1 + j) * top + i for j in range(k)] for i, p in enumerate(pending)]
        starts, pending = list(starts), [list(p) for p in pending]
        if sum(map(len, pending)) > self.max_tokens:  # too many for one step: all but each one's last, alone
            for i in range(len(slots)):
                while len(pending[i]) > 1:
                    take = pending[i][:min(self.max_tokens, len(pending[i]) - 1)]
                    self.feed([slots[i]], [starts[i]], [take])
                    starts[i] += len(take)
                    del pending[i][:len(take)]
        first = self.feed(slots, starts, pending)
        if k > 1:
            self._run_chain(slots, [s + len(p) for s, p in zip(starts, pending)], k - 1, first=first)
            first = torch.cat([first.unsqueeze(0), self.out[:k - 1, :n]])
        return first.reshape(-1), [[j * n + i for j in range(k)] for i in range(n)]

    def _run_chain(self, slots: list[int], positions: list[int], length: int, first: torch.Tensor | None = None,
                   first_tokens: list[int] | None = None, forced: list[list[int]] | None = None) -> None:
        """Replay the chain of ``length`` steps whose first feeds each slot, at ``positions``, the token of
        ``first`` (on the device) or ``first_tokens`` (from the host), then its ``forced`` tokens (at most FORCED);
        each step's argmax goes to ``out[:length]``."""
        n = len(slots)
        b = next(x for x in self.buckets if x >= n)
        pad = [0] * (b - n)
        forced = forced or [[] for _ in range(n)]
        self._inputs.host(0)["rows"][:, :b] = torch.tensor(
            [positions + pad, list(slots) + pad, [1] * n + pad,
             (first_tokens if first_tokens is not None else [0] * n) + pad, [len(f) for f in forced] + pad]
            + [[f[j] if j < len(f) else 0 for f in forced] + pad for j in range(self.FORCED)], dtype=torch.long)
        self._inputs.copy(0)
        if first is not None:
            self.first[:n].copy_(first)  # after the staged copy, which wrote the host's zeros there
        graph = self._graphs.get((b, length))
        if graph is None:
            self._chain(b, length)
        else:
            graph.replay()

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.steps.close()


def _check_same_vocabulary(draft: Engine, target_vocab_size: int, target_tokenizer) -> None:
    """Refuse a draft artifact whose vocabulary is not the target's (its token ids would mean other tokens)."""
    vocab = int(draft.executor.graph.get("meta", {}).get("vocab_size", 0))
    if vocab != target_vocab_size:
        raise SpeculativeConfigError(f"the draft model's vocabulary has {vocab} entries, the target's "
                                     f"{target_vocab_size}; a draft model must share the target's tokenizer")
    ours, theirs = draft.tokenizer, target_tokenizer
    if ours.vocab_size != theirs.vocab_size:
        raise SpeculativeConfigError(f"the draft model's tokenizer has {ours.vocab_size} tokens, the target's "
                                     f"{theirs.vocab_size}; a draft model must share the target's tokenizer")
    for token_id in range(ours.vocab_size):
        if ours.id_to_token(token_id) != theirs.id_to_token(token_id):
            raise SpeculativeConfigError(
                f"the draft model's token {token_id} is {ours.id_to_token(token_id)!r}, the target's "
                f"{theirs.id_to_token(token_id)!r}; a draft model must share the target's tokenizer")

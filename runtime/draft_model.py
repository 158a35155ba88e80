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

The draft runs through the executor's per-sequence attention (no paged cache, no CUDA graphs): on a GPU its steps
are eager launches, which costs what a small model's step costs in launch overhead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.engine import Engine
from runtime.executor import SeqSlice, StepInput
from runtime.kv_cache import SequenceKV
from runtime.memory import tensor_bytes
from runtime.speculative import DraftRequest, Proposer, SpeculativeConfigError


@dataclass
class _DraftSeq:
    """One request's state in the draft model."""

    kv: SequenceKV
    token_ids: list[int] = field(default_factory=list)  # what the cache holds, position by position
    num_known: int = 0  # of those, the leading tokens the request had at the last proposal (kept for good)


class DraftModelProposer(Proposer):
    """Greedy drafts from a second artifact (see the module docstring)."""

    method = "draft"

    def __init__(self, draft: Engine, target_vocab_size: int, target_tokenizer, max_seq_len: int,
                 max_seqs: int = 8) -> None:
        _check_same_vocabulary(draft, target_vocab_size, target_tokenizer)
        if max_seqs < 1:
            raise SpeculativeConfigError(f"a draft model needs room for at least one request's cache, got {max_seqs}")
        self.draft = draft
        self.max_seq_len = min(max_seq_len, draft.limits.max_seq_len)  # the draft cannot look further
        self.max_seqs = max_seqs
        self._seqs: OrderedDict[str, _DraftSeq] = OrderedDict()  # least recently proposed for first

    @classmethod
    def load(cls, path: str | Path, device: torch.device, target_vocab_size: int, target_tokenizer,
             max_seq_len: int, max_seqs: int = 8) -> DraftModelProposer:
        """Load the draft artifact on ``device`` (verified like any artifact, see ``Engine.load``)."""
        return cls(Engine.load(path, device), target_vocab_size, target_tokenizer, max_seq_len, max_seqs)

    def kv_bytes(self) -> int:
        """The most bytes the per-request draft caches hold at once: max_seqs caches of max_seq_len tokens."""
        return self.max_seqs * self.max_seq_len * self.draft.kv_layout.bytes_per_token()

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def weights_bytes(self) -> int:
        return tensor_bytes(self.draft.executor.params.values())

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        # requests whose tokens plus drafts fit the draft's context; the others get none
        live = [i for i, r in enumerate(requests) if len(r.token_ids) + r.max_tokens <= self.max_seq_len]
        live = live[:self.max_seqs]  # the policy asks for no more at once; the caches are planned for that many
        if not live:
            return drafts
        for i in live:  # this step's requests are the most recent: a new one's cache evicts none of theirs
            if requests[i].request_id in self._seqs:
                self._seqs.move_to_end(requests[i].request_id)
        pending = [self._catch_up(requests[i]) for i in live]  # per live request: the tokens to feed now
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

    def _catch_up(self, request: DraftRequest) -> list[int]:
        """Cut the request's draft cache back to what still matches its tokens, feed all but the last few of the
        rest in chunks (a new request's prompt), and return the tokens left to feed in the batched step."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            while len(self._seqs) >= self.max_seqs:  # the least recently proposed for: none of this step's (moved
                self._seqs.popitem(last=False)       # to the end first; a step has at most max_seqs requests)
            seq = self._seqs[request.request_id] = _DraftSeq(SequenceKV(self.draft.kv_layout, self.max_seq_len,
                                                                        self.draft.device))
        self._seqs.move_to_end(request.request_id)
        token_ids = request.token_ids
        keep = seq.num_known  # equal by construction: the request's tokens only grow
        while keep < min(len(seq.token_ids), len(token_ids) - 1) and seq.token_ids[keep] == token_ids[keep]:
            keep += 1
        del seq.token_ids[keep:]
        seq.kv.truncate(keep)
        chunk = self.draft.limits.max_num_tokens
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

"""The draft-model proposer on the paged storage (``runtime.draft_model.PagedDraft``: the catch-up step and the chain
of one-token steps that CUDA graphs replay on the GPU), run eagerly through the kernels here, drafts exactly what the
per-sequence reference path drafts. On CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import build_artifact, make_checkpoint  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.speculative import DraftRequest  # noqa: E402


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_paged")
    path = build_artifact(make_checkpoint(root / "ckpt", "llama", num_attention_heads=2, num_key_value_heads=1),
                          root / "art")
    return Engine.load(path, use_kernels=True), Engine.load(path, use_kernels=False)


def _proposers(engines, **kw):
    from runtime.draft_model import DraftModelProposer

    fused, ref = engines
    vocab = int(ref.executor.graph["meta"]["vocab_size"])
    paged = DraftModelProposer(fused, vocab, fused.tokenizer, 256, max_draft_tokens=4, cuda_graphs=False, **kw)
    assert paged.paged is not None and not paged.paged._graphs  # eager: the same steps the graphs replay

    def fresh():
        return DraftModelProposer(ref, vocab, ref.tokenizer, 256, max_draft_tokens=4, paged=False)

    return paged, fresh, vocab


def test_paged_drafts_equal_the_reference_after_any_acceptance(engines):
    """One request over proposals with every number of accepted drafts (and a pause without drafts): the paged
    proposer, which keeps its cache, drafts what a fresh reference proposer drafts for the same tokens."""
    paged, fresh, vocab = _proposers(engines)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, vocab, (21,), generator=g).tolist()
    for num_accepted in [4, 0, None, 2, 3]:
        drafts = paged.propose([DraftRequest("r", tokens, 4)])[0]
        assert len(drafts) == 4
        assert drafts == fresh().propose([DraftRequest("r", list(tokens), 4)])[0]
        assert paged._seqs["r"].token_ids == tokens + drafts[:3]
        if num_accepted is None:
            tokens += [(drafts[0] + 1) % vocab, drafts[1], drafts[2]]
            continue
        own = (drafts[num_accepted] + 1) % vocab if num_accepted < len(drafts) else 7
        tokens += drafts[:num_accepted] + [own]
    slot = paged._seqs["r"].kv
    paged.release("r")
    assert paged._seqs == {} and slot in paged.paged._free


def test_paged_batch_mixed_lengths_long_prompts_and_eviction(engines):
    """Three requests in one proposal (a padded chain bucket: 3 rows of 4), wanting 4, 2 and 1 drafts, one prompt
    longer than a step (fed in chunks first); then more than max_seqs requests (the least recent evicted, its slot
    reused); every proposal equals the reference's."""
    paged, fresh, vocab = _proposers(engines, max_seqs=3)
    g = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(3, vocab, (n,), generator=g).tolist() for i, n in enumerate((9, 70, 30, 12))}
    assert 70 > paged.paged.max_tokens
    reqs = [DraftRequest("r0", prompts["r0"], 4), DraftRequest("r1", prompts["r1"], 2),
            DraftRequest("r2", prompts["r2"], 1)]
    got = paged.propose(reqs)
    assert [len(d) for d in got] == [4, 2, 1]
    assert got == fresh().propose(reqs)
    # a step later: r0 accepted 2 drafts, r2 its one; a new request, r3, evicts r1 (not in this step)
    step2 = [DraftRequest("r0", prompts["r0"] + got[0][:2] + [5], 3),
             DraftRequest("r2", prompts["r2"] + got[2] + [6], 4),
             DraftRequest("r3", prompts["r3"], 4)]
    assert paged.propose(step2) == fresh().propose(step2)
    assert set(paged._seqs) == {"r0", "r2", "r3"}  # r1 went for r3
    again = [DraftRequest("r1", prompts["r1"] + [got[1][0]], 4)]  # refed from its tokens
    assert paged.propose(again) == fresh().propose(again)
    assert len(paged.paged._free) == 0 and len({s.kv for s in paged._seqs.values()}) == 3

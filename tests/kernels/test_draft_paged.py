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

# the engines here run on the CPU, where the kernels need the interpreter: with TRITON_INTERPRET=0 (a GPU machine's
# kernel tests) they cannot run; the paged drafts on the GPU are checked end to end there (builder.bench.speculative
# compares every prompt's tokens with and without speculation, builder.devtools.cuda_smoke the draft artifact's)
pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1",
                                reason="CPU engines through the interpreter only (TRITON_INTERPRET=1)")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    # one layer: the proposer's steps over the paged storage are what is under test (the executor's layers on the
    # same kernels and storage are tests/kernels/test_executor_kernels.py's, two of them); the second layer's kernels
    # cost the interpreter as much as the first (the three tests: 162 s with two layers, 80 s with one)
    root = tmp_path_factory.mktemp("draft_paged")
    path = build_artifact(make_checkpoint(root / "ckpt", "llama", num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=1), root / "art")
    return Engine.load(path, use_kernels=True), Engine.load(path, use_kernels=False)


def _proposers(engines, max_seq_len: int = 256, **kw):
    from runtime.draft_model import DraftModelProposer

    fused, ref = engines
    vocab = int(ref.executor.graph["meta"]["vocab_size"])
    paged = DraftModelProposer(fused, vocab, fused.tokenizer, max_seq_len, max_draft_tokens=4, cuda_graphs=False,
                               **kw)
    assert paged.paged is not None and not paged.paged._graphs  # eager: the same steps the graphs replay

    def fresh():
        return DraftModelProposer(ref, vocab, ref.tokenizer, max_seq_len, max_draft_tokens=4, paged=False)

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
    paged, fresh, vocab = _proposers(engines, max_seqs=4)
    assert paged.paged.buckets == [1, 2, 4]  # 3 rows run padded to 4: a row that writes nothing
    g = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(3, vocab, (n,), generator=g).tolist()
               for i, n in enumerate((9, 70, 30, 12, 15))}
    assert 70 > paged.paged.max_tokens
    reqs = [DraftRequest("r0", prompts["r0"], 4), DraftRequest("r1", prompts["r1"], 2),
            DraftRequest("r2", prompts["r2"], 1)]
    got = paged.propose(reqs)
    assert [len(d) for d in got] == [4, 2, 1]
    assert got == fresh().propose(reqs)
    # a step later: r0 accepted 2 drafts, r2 its one, r3 is new; then r4 evicts r1 (the least recent, not in its step)
    step2 = [DraftRequest("r0", prompts["r0"] + got[0][:2] + [5], 3),
             DraftRequest("r2", prompts["r2"] + got[2] + [6], 4),
             DraftRequest("r3", prompts["r3"], 4)]
    assert paged.propose(step2) == fresh().propose(step2)
    step3 = [DraftRequest("r4", prompts["r4"], 2)]
    assert paged.propose(step3) == fresh().propose(step3)
    assert set(paged._seqs) == {"r0", "r2", "r3", "r4"}
    again = [DraftRequest("r1", prompts["r1"] + [got[1][0]], 4)]  # refed from its tokens; r0's slot reused
    assert paged.propose(again) == fresh().propose(again)
    assert set(paged._seqs) == {"r1", "r2", "r3", "r4"}
    assert len(paged.paged._free) == 0 and len({s.kv for s in paged._seqs.values()}) == 4
    # proposed for again with the same tokens (left unscheduled in between): its last token is fed again
    assert paged.propose(again) == fresh().propose(again)


def test_paged_prompts_over_a_step_and_the_cache_end(engines):
    """New prompts whose tokens together exceed a step (each fed alone first), and a request at the end of its cache
    wanting 1 draft beside one wanting 4: the chain's later positions fall past its blocks and write nothing."""
    paged, fresh, vocab = _proposers(engines, max_seq_len=96)
    g = torch.Generator().manual_seed(5)
    new = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (50, 40, 7)]
    reqs = [DraftRequest(f"n{i}", ids, k) for i, (ids, k) in enumerate(zip(new, (4, 2, 3)))]
    assert sum(map(len, new)) > paged.paged.max_tokens
    first = paged.propose(reqs)
    assert first == fresh().propose(reqs)
    # no catch-up step: n0 accepted all 4 drafts (its last one and a token of its own are new), n1 one of 2
    feeds = []
    feed = paged.paged.feed
    paged.paged.feed = lambda *a: (feeds.append(a), feed(*a))[1]
    both = [DraftRequest("n0", new[0] + first[0] + [11], 4), DraftRequest("n1", new[1] + first[1][:1] + [12], 3)]
    assert paged.propose(both) == fresh().propose(both)
    assert feeds == []
    paged.paged.feed = feed
    long = torch.randint(3, vocab, (paged.max_seq_len - 2,), generator=g).tolist()
    assert paged.paged.capacity == paged.max_seq_len
    end = [DraftRequest("end", long, 1), DraftRequest("n2", new[2] + [9], 4)]
    assert paged.propose(end) == fresh().propose(end)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                    reason="CUDA graphs need a GPU (run with TRITON_INTERPRET=0)")
def test_captured_draft_on_cuda_with_work_queued(tmp_path):
    """On the GPU, from its CUDA graphs: the drafts equal the reference path's, also when the stream still holds
    work as a proposal starts (its long prompt fed in several steps back to back, whose staging buffers are reused
    only once their copies have run)."""
    from runtime.draft_model import DraftModelProposer

    path = build_artifact(make_checkpoint(tmp_path / "ckpt", "llama", num_attention_heads=2, num_key_value_heads=1),
                          tmp_path / "art")
    fused, ref = Engine.load(path, device="cuda", use_kernels=True), Engine.load(path, use_kernels=False)
    vocab = int(ref.executor.graph["meta"]["vocab_size"])
    paged = DraftModelProposer(fused, vocab, fused.tokenizer, 256, max_draft_tokens=4)
    assert paged.paged is not None and paged.paged._graphs
    g = torch.Generator().manual_seed(6)
    for n in (200, 150, 20):
        tokens = torch.randint(3, vocab, (n,), generator=g).tolist()
        torch.cuda._sleep(300_000_000)  # the GPU busy while the host packs and queues the steps
        got = paged.propose([DraftRequest(f"p{n}", tokens, 4)])
        want = DraftModelProposer(ref, vocab, ref.tokenizer, 256, max_draft_tokens=4, paged=False).propose(
            [DraftRequest(f"p{n}", tokens, 4)])
        assert got == want
    paged.close()


@pytest.mark.parametrize("draft", ["same", "other"])
def test_serving_takes_the_paged_drafts_from_the_device(engines, tmp_path_factory, draft):
    """The serving engine with the paged draft: the chain's drafts stay on the device, the verify step's draft rows
    are fed from its buffer and read back with the sampled tokens; greedy output is the non-speculative one. The
    target as its own draft accepts every draft; a draft of other weights (same vocabulary) gets them rejected.
    Prompts of several lengths: the first proposal of each takes a catch-up step (the drafts then come from a copy
    of the chain's buffer), the later ones the chain alone."""
    from runtime import SamplingParams
    from runtime.draft_model import DraftModelProposer
    from runtime.serving import ServingConfig, ServingEngine
    from runtime.speculative import PendingDrafts

    fused, ref = engines
    if draft == "other":
        root = tmp_path_factory.mktemp("other_draft")
        other = build_artifact(make_checkpoint(root / "ckpt", "llama", seed=5, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1), root / "art")
        fused = Engine.load(other, use_kernels=True)
    vocab = int(ref.executor.graph["meta"]["vocab_size"])
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 30, 2)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = ServingEngine(ref, ServingConfig(num_blocks=32)).run(prompts, params)
    s = ServingEngine(ref, ServingConfig(num_blocks=32, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                                      "min_acceptance": 0.0}))
    s.proposer = DraftModelProposer(fused, vocab, ref.tokenizer, 256, max_seqs=8, max_draft_tokens=3,
                                    cuda_graphs=False)
    pending = []
    propose = s.proposer.propose_pending
    s.proposer.propose_pending = lambda asks: (pending.append(propose(asks)), pending[-1])[1]
    got = s.run(prompts, params)
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    stats = s.stats()
    assert pending and all(isinstance(p, PendingDrafts) for p in pending)
    assert stats.spec_num_draft_tokens > 10
    if draft == "same":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    else:
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert s.proposer._seqs == {} and sorted(s.proposer.paged._free) == list(range(8))  # every slot released

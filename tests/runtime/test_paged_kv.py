"""PagedSequenceKV against the contiguous SequenceKV: same rows, same attention, same logits."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ops as ops
from runtime.block_pool import BlockPool
from runtime.executor import Executor, SeqSlice, StepInput
from runtime.kv_cache import CacheFullError, KVLayout, SequenceKV
from runtime.kv_manager import KVCacheManager
from runtime.paged_kv import PagedKVStorage, PagedSequenceKV

LAYOUT = KVLayout(num_kv_heads=[2, 1], head_dim=[8, 16], dtype=torch.float32)


def _shuffled_table(num_blocks: int, n: int, seed: int) -> list[int]:
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()
    assert any(b - a != 1 for a, b in zip(table, table[1:])), "want a non-contiguous table"
    return table


def _write_both(paged, ref, layout, chunks, gen):
    start = 0
    for n in chunks:
        for layer, (h, d) in enumerate(zip(layout.num_kv_heads, layout.head_dim)):
            k = torch.randn(n, h, d, generator=gen).to(layout.dtype_of(layer))
            v = torch.randn(n, h, d, generator=gen).to(layout.dtype_of(layer))
            paged.append(layer, start, k, v)
            ref.append(layer, start, k, v)
        start += n
        for layer in range(len(layout.num_kv_heads)):
            pk, pv = paged.view(layer, start)
            rk, rv = ref.view(layer, start)
            assert pk.shape == rk.shape and pk.dtype == rk.dtype
            assert torch.equal(pk, rk) and torch.equal(pv, rv)
    return start


def test_shuffled_block_table_roundtrips_like_a_contiguous_cache():
    storage = PagedKVStorage(LAYOUT, num_blocks=16, block_size=4)
    for t in storage.k + storage.v:
        t.fill_(7.0)  # sentinel: blocks outside the table must stay untouched
    table = _shuffled_table(16, 6, seed=0)
    paged, ref = PagedSequenceKV(storage, table), SequenceKV(LAYOUT, 24)
    assert paged.capacity == 24
    n = _write_both(paged, ref, LAYOUT, [13, 5, 1, 1, 1, 3], torch.Generator().manual_seed(1))
    assert n == 24
    others = [i for i in range(16) if i not in table]
    for t in storage.k + storage.v:
        assert (t[others] == 7.0).all()
    # the rows landed where the block table says
    pk, _ = paged.view(1, 24)
    assert torch.equal(storage.k[1][table[2], 3], pk[2 * 4 + 3])
    assert torch.equal(paged.slot_mapping(9, 12), torch.tensor([table[2] * 4 + 1, table[2] * 4 + 2,
                                                                 table[2] * 4 + 3]))
    with pytest.raises(CacheFullError):
        paged.append(0, 24, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(CacheFullError):
        paged.view(0, 25)


def test_block_table_grows_between_steps_and_contiguous_tables_take_the_slice_path():
    storage = PagedKVStorage(LAYOUT, num_blocks=8, block_size=4)
    table = [5, 6]  # physically consecutive: views are slices of the storage, no copy
    paged, ref = PagedSequenceKV(storage, table), SequenceKV(LAYOUT, 16)
    gen = torch.Generator().manual_seed(2)
    _write_both(paged, ref, LAYOUT, [7], gen)
    assert paged.view(0, 7)[0].data_ptr() == storage.k[0][5].data_ptr()
    with pytest.raises(CacheFullError):  # 7 + 2 > 8 slots
        paged.append(0, 7, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    table += [1, 3]  # the manager extends the same list
    assert paged.capacity == 16
    start = 7
    for n in (2, 6, 1):
        for layer, (h, d) in enumerate(zip(LAYOUT.num_kv_heads, LAYOUT.head_dim)):
            k, v = torch.randn(n, h, d, generator=gen), torch.randn(n, h, d, generator=gen)
            paged.append(layer, start, k, v)
            ref.append(layer, start, k, v)
        start += n
    for layer in (0, 1):
        assert torch.equal(paged.view(layer, 16)[0], ref.view(layer, 16)[0])
        assert torch.equal(paged.view(layer, 16)[1], ref.view(layer, 16)[1])
    assert paged.view(0, 0)[0].shape == (0, 2, 8)


def test_per_layer_dtypes_and_sizes():
    layout = KVLayout([2, 2], [8, 8], torch.bfloat16, (torch.int8, torch.bfloat16))
    storage = PagedKVStorage(layout, num_blocks=5, block_size=4)
    assert storage.k[0].shape == (5, 4, 2, 8) and storage.k[0].dtype == torch.int8
    assert storage.v[1].dtype == torch.bfloat16
    assert storage.bytes() == 5 * 4 * layout.bytes_per_token() == 5 * 4 * (2 * 16 * 1 + 2 * 16 * 2)
    per_block = 4 * layout.bytes_per_token()
    assert PagedKVStorage.blocks_for_budget(layout, 4, 10 * per_block + per_block - 1) == 10
    assert PagedKVStorage.blocks_for_budget(layout, 4, per_block - 1) == 0
    paged, ref = PagedSequenceKV(storage, [4, 0, 2]), SequenceKV(layout, 12)
    k = torch.randint(-127, 128, (9, 2, 8), dtype=torch.int8)
    paged.append(0, 0, k, k)
    ref.append(0, 0, k, k)
    assert torch.equal(paged.view(0, 9)[0], ref.view(0, 9)[0])


@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_paged_view_equals_contiguous(window):
    gen = torch.Generator().manual_seed(3)
    layout = KVLayout([2], [16], torch.float32)
    storage = PagedKVStorage(layout, num_blocks=12, block_size=4)
    paged = PagedSequenceKV(storage, _shuffled_table(12, 7, seed=4))
    ref = SequenceKV(layout, 28)
    num_heads, scale = 6, 16 ** -0.5
    start = 0
    for n in (11, 6, 1, 1, 4):  # chunked prefill, then decode steps
        k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
        q = torch.randn(n, num_heads, 16, generator=gen)
        outs = []
        for kv in (paged, ref):
            kv.append(0, start, k, v)
            outs.append(ops.attention_one(q, *kv.view(0, start + n), start, scale, window))
        assert torch.allclose(outs[0], outs[1], atol=1e-6, rtol=0)
        start += n


# --- end to end: the executor over a hand-written two-layer graph ------------------------------
V, HID, H, KV, D = 40, 32, 4, 2, 8


def _tiny_executor() -> Executor:
    g = torch.Generator().manual_seed(5)
    params = {"embed": torch.randn(V, HID, generator=g), "norm": 1 + 0.1 * torch.randn(HID, generator=g),
              "lm_head": 0.2 * torch.randn(V, HID, generator=g),
              "inv_freq": 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))}
    nodes = [{"op": "embedding", "inputs": ["input_ids"], "outputs": ["h0"], "weights": {"weight": "embed"}}]
    for i in range(2):
        params[f"qkv{i}"] = 0.2 * torch.randn((H + 2 * KV) * D, HID, generator=g)
        params[f"o{i}"] = 0.2 * torch.randn(HID, H * D, generator=g)
        nodes += [
            {"op": "linear", "inputs": [f"h{i}"], "outputs": [f"q{i}", f"k{i}", f"v{i}"],
             "weights": {"weight": f"qkv{i}"}, "attrs": {"split_sizes": [H * D, KV * D, KV * D]}},
            {"op": "rope", "inputs": [f"q{i}", "positions"], "outputs": [f"qr{i}"],
             "weights": {"inv_freq": "inv_freq"}, "attrs": {"num_heads": H, "head_dim": D}},
            {"op": "rope", "inputs": [f"k{i}", "positions"], "outputs": [f"kr{i}"],
             "weights": {"inv_freq": "inv_freq"}, "attrs": {"num_heads": KV, "head_dim": D}},
            {"op": "attention", "inputs": [f"qr{i}", f"kr{i}", f"v{i}"], "outputs": [f"a{i}"],
             "attrs": {"layer": i, "num_heads": H, "num_kv_heads": KV, "head_dim": D, "scale": D ** -0.5}},
            {"op": "linear", "inputs": [f"a{i}"], "outputs": [f"o{i}"], "weights": {"weight": f"o{i}"}},
            {"op": "elementwise", "inputs": [f"h{i}", f"o{i}"], "outputs": [f"h{i + 1}"], "attrs": {"fn": "add"}},
        ]
    nodes += [{"op": "rms_norm", "inputs": ["h2"], "outputs": ["hn"], "weights": {"weight": "norm"},
               "attrs": {"eps": 1e-5}},
              {"op": "lm_head", "inputs": ["hn"], "outputs": ["logits"], "weights": {"weight": "lm_head"}}]
    graph = {"ir_version": 1, "nodes": nodes, "outputs": ["logits"], "meta": {"dtype": "float32"}}
    return Executor(graph, params)


def _reference_last_logits(ex: Executor, token_ids: list[int]) -> torch.Tensor:
    """The whole sequence recomputed in a fresh contiguous cache; logits of its last token."""
    n = len(token_ids)
    kv = SequenceKV(ex.kv_layout(), n)
    return ex.forward(StepInput(torch.tensor(token_ids), torch.arange(n), [SeqSlice(kv, 0, n)],
                                torch.tensor([n - 1])))[0]


def test_executor_with_paged_cache_and_prefix_hits_matches_recompute():
    ex = _tiny_executor()
    bs, num_blocks = 4, 12
    pool = BlockPool(num_blocks)
    pool.free(reversed(pool.allocate(num_blocks)))  # scramble the free queue: tables are non-contiguous
    manager = KVCacheManager(pool, bs)
    storage = PagedKVStorage(ex.kv_layout(), num_blocks, bs)
    tokens = {"a": [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9], "b": [3, 14, 15, 9, 26, 5, 35, 8, 2, 7]}
    kvs: dict[str, PagedSequenceKV] = {}

    def step(sched: dict[str, int]) -> None:
        """One forward over the scheduled requests (rid -> num_new), packed in order; appends the
        greedy token of each request that reached the end of its tokens and checks its logits."""
        ids, pos, seqs, last = [], [], [], []
        for rid, n in sched.items():
            if rid not in kvs:
                blocks, computed = manager.get_computed_blocks(rid, tokens[rid])
                assert manager.allocate_slots(rid, tokens[rid], n, blocks) is not None
                kvs[rid] = PagedSequenceKV(storage, manager.block_table(rid), computed)
            else:
                assert manager.allocate_slots(rid, tokens[rid], n) is not None
            kv = kvs[rid]
            ids += tokens[rid][kv.num_tokens:kv.num_tokens + n]
            pos += range(kv.num_tokens, kv.num_tokens + n)
            seqs.append(SeqSlice(kv, kv.num_tokens, n))
            last.append(len(ids) - 1)
        logits = ex.forward(StepInput(torch.tensor(ids), torch.tensor(pos), seqs, torch.tensor(last)))
        for (rid, n), row, s in zip(sched.items(), logits, seqs):
            kvs[rid].num_tokens += n
            if kvs[rid].num_tokens == len(tokens[rid]):
                ref = _reference_last_logits(ex, tokens[rid])
                assert torch.allclose(row, ref, atol=1e-5), (rid, (row - ref).abs().max())
                tokens[rid].append(int(row.argmax()))

    step({"a": 6})  # chunked prefill of a
    step({"a": 5})
    assert manager.block_table("a") == [11, 10, 9]
    blocks, computed = manager.get_computed_blocks("b", tokens["b"])
    assert computed == 8 and [b.block_id for b in blocks] == [11, 10]
    step({"a": 1, "b": 2})  # a decodes, packed with b's prefill after its 8 cached tokens
    assert manager.block_table("b") == [11, 10, 8] and kvs["b"].num_tokens == 10
    for _ in range(3):
        step({"b": 1, "a": 1})
    assert manager.block_table("a") == [11, 10, 9, 7] and manager.num_tokens("a") == 15
    assert manager.stats.hits == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA cache")
def test_a_cuda_cache_starts_zeroed():
    """On CUDA every slot starts at zero (the padding rows of a captured decode step read block 0's first slot,
    which no sequence may have written: an FP8 byte left by the allocator can be NaN)."""
    layout = KVLayout(num_kv_heads=[2], head_dim=[64], dtype=torch.float8_e4m3fn)
    junk = torch.full((8, 16, 2, 64), 0x7F, dtype=torch.uint8, device="cuda")  # NaN as e4m3
    junk_ptr = junk.data_ptr()
    del junk  # its memory goes back to the caching allocator, which hands it to the cache below
    storage = PagedKVStorage(layout, num_blocks=8, block_size=16, device="cuda")
    if junk_ptr not in {t.data_ptr() for t in storage.k + storage.v}:
        pytest.skip("the caching allocator did not hand the poisoned memory back to the cache")
    for t in storage.k + storage.v:
        assert not t.view(torch.uint8).any()

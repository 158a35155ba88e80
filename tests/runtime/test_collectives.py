"""The tensor-parallel all-reduce: when the one-shot path over peer memory is taken, and, on a host with two GPUs,
that it sums exactly what NCCL sums (eager and inside a CUDA graph, each rank's result bit-equal to the others'),
and that a second group in the same process sums over NCCL instead."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from runtime import collectives
from runtime.collectives import DEFAULT_ONE_SHOT_BYTES, ONE_SHOT_BYTES_ENV, one_shot_bytes, one_shot_refusal

CUDA = torch.device("cuda", 0)


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(ONE_SHOT_BYTES_ENV, raising=False)
    assert one_shot_bytes() == DEFAULT_ONE_SHOT_BYTES
    monkeypatch.setenv(ONE_SHOT_BYTES_ENV, "65536")
    assert one_shot_bytes() == 65536
    for bad in ("1MiB", "-1"):
        monkeypatch.setenv(ONE_SHOT_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=ONE_SHOT_BYTES_ENV):
            one_shot_bytes()


@pytest.mark.parametrize("device, dtype, backend, world, local_world, limit, reason", [
    (CUDA, torch.bfloat16, "nccl", 2, 2, 1 << 20, None),
    (CUDA, torch.float32, "nccl", 8, 8, 1, None),
    (CUDA, torch.bfloat16, "nccl", 2, 2, 0, f"{ONE_SHOT_BYTES_ENV}=0"),
    (torch.device("cpu"), torch.float32, "gloo", 2, 2, 1 << 20, "cpu / gloo group"),
    (CUDA, torch.bfloat16, "gloo", 2, 2, 1 << 20, "cuda / gloo group"),
    (CUDA, torch.bfloat16, "nccl", 4, 2, 1 << 20, "ranks on more than one host (2 of 4 here)"),
    (CUDA, torch.float16, "nccl", 2, 2, 1 << 20, "dtype float16 (it sums float32 and bfloat16)"),
])
def test_the_one_shot_path_is_refused_where_it_cannot_run(device, dtype, backend, world, local_world, limit, reason):
    assert one_shot_refusal(device, dtype, backend, world, local_world, limit) == reason


def test_gloo_ranks_sum_in_place_without_symmetric_memory(tmp_path):
    """One gloo rank (a group of one): the all-reduce is gloo's, in place, and nothing is set up."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.randn(3, 8)
        reduce = collectives.all_reduce_for(torch.device("cpu"), torch.float32)
        assert reduce(x) is x
        assert collectives._peers[("cpu", torch.float32)] is None
    finally:
        collectives.reset()
        dist.destroy_process_group()


def test_a_process_sets_symmetric_memory_up_for_its_first_group_only(tmp_path, monkeypatch, caplog):
    """A later group in the same process (a second engine) is refused before any rendezvous, and sums in place.
    One gloo rank stands in for the ranks; the refusal checks and the buffer are replaced (no GPU here)."""
    made = []

    class FakePeer:
        def __init__(self, device, dtype, capacity):
            made.append(capacity)
            self.capacity = capacity

        def fits(self, x):
            return x.numel() <= self.capacity

        def __call__(self, x):
            return x * 1.0  # a new tensor, as the one-shot op returns

    monkeypatch.setattr(collectives, "one_shot_refusal", lambda *args: None)
    monkeypatch.setattr(collectives, "PeerAllReduce", FakePeer)
    monkeypatch.setattr(collectives, "_set_up_in", None)
    caplog.set_level("INFO", logger="runtime.collectives")
    x = torch.randn(2, 8)
    for attempt in ("first", "second"):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / attempt}", rank=0, world_size=1)
        try:
            reduce = collectives.all_reduce_for(torch.device("cpu"), torch.float32)
            y = reduce(x)
            torch.testing.assert_close(y, x)
            assert (y is x) == (attempt == "second")  # the fake's copy, then gloo in place
        finally:
            collectives.reset()
            dist.destroy_process_group()
    assert len(made) == 1
    assert "set up for an earlier process group in this process" in caplog.text


def _two_gpu_worker(rank: int, store_path: str, results: str) -> None:
    torch.cuda.set_device(rank)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    device = torch.device("cuda", rank)
    lines = []
    try:
        for dtype in (torch.bfloat16, torch.float32):
            reduce = collectives.all_reduce_for(device, dtype)
            peer = collectives._peers[(str(device), dtype)]
            assert peer is not None, "the one-shot path was not set up on two GPUs of one host"
            gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
            sizes = [(1, 4096), (7, 4096), (64, 4096), (3, 1000), (peer.capacity // 4096 + 1, 4096)]
            for shape in sizes:
                x = torch.randn(shape, generator=gen).to(device, dtype)
                want = x.clone()
                dist.all_reduce(want)
                got = reduce(x.clone())
                both = [torch.empty_like(got) for _ in range(2)]
                dist.all_gather(both, got)
                lines.append(f"{rank} {str(dtype)} {shape} fits={peer.fits(x)} "
                             f"maxdiff={(got.float() - want.float()).abs().max().item():.3g} "
                             f"ranks_equal={torch.equal(both[0], both[1])}")
                ulp = 0.0 if dtype == torch.float32 else 2.0 ** -7  # two addends: one rounding, NCCL's or ours
                torch.testing.assert_close(got, want, rtol=ulp, atol=0)
                assert torch.equal(both[0], both[1])
            # three sums in a row recorded into one CUDA graph, replayed over fresh inputs
            static_in = torch.zeros(4, 4096, device=device, dtype=dtype)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    reduce(reduce(reduce(static_in) * 0.5) + 1.0)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = reduce(reduce(reduce(static_in) * 0.5) + 1.0)
            for _ in range(3):
                fresh = torch.randn(4, 4096, generator=gen).to(device, dtype)
                static_in.copy_(fresh)
                graph.replay()
                want = fresh.clone()
                dist.all_reduce(want)
                want = want * 0.5
                dist.all_reduce(want)
                want = want + 1.0
                dist.all_reduce(want)
                torch.testing.assert_close(static_out, want, rtol=2e-2, atol=2e-2)
            lines.append(f"{rank} {str(dtype)} graph replays ok")
        # the next engine in this process: its group sums over NCCL (a rendezvous would not meet a fresh worker's)
        collectives.reset()
        dist.destroy_process_group()
        dist.init_process_group("nccl", init_method=f"file://{store_path}-again", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        reduce = collectives.all_reduce_for(device, torch.bfloat16)
        assert collectives._peers[(str(device), torch.bfloat16)] is None
        x = torch.full((2, 4096), float(rank + 1), device=device, dtype=torch.bfloat16)
        assert torch.equal(reduce(x), torch.full_like(x, 3.0))
        lines.append(f"{rank} second group ok")
    finally:
        collectives.reset()
        dist.destroy_process_group()
    with open(f"{results}.{rank}", "w") as f:
        f.write("\n".join(lines) + "\n")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_sums_what_nccl_sums_on_two_gpus():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, results = os.path.join(tmp, "store"), os.path.join(tmp, "results")
        mp.spawn(_two_gpu_worker, args=(store, results), nprocs=2, join=True)
        for rank in range(2):
            with open(f"{results}.{rank}") as f:
                text = f.read()
            print(text, end="")
            assert text.count("graph replays ok") == 2 and "second group ok" in text

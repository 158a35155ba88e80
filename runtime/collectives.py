"""The tensor-parallel graph's all-reduce: one-shot over peer memory for decode-sized sums, NCCL above.

A decode step's partial sums are small ([num_seqs, hidden], 8 KB at batch 1 on a 4096-wide model) and there are
two per layer. NCCL's ring spends several microseconds of protocol on each; at batch 1 that latency, not NVLink's
bandwidth, is what the ranks wait for. Between the GPUs of one host a sum this small is cheaper done directly:

    every rank                          symmetric buffer (one per rank, mapped into every rank's address space)
      copy its partial sum into    ──►  its own buffer
      barrier (signal pads)             every rank's copy is in place
      read every rank's buffer,    ◄──  the same bytes in the same order on every rank, so every rank gets the
        add, write the result           same sum, bit for bit
      barrier                           no rank overwrites its buffer while a peer still reads it

That is PyTorch's ``symm_mem::one_shot_all_reduce`` (``torch.distributed._symmetric_memory``): a buffer allocated
with ``symm_mem.empty`` and exchanged once by ``rendezvous``; the copy rides in the same kernel where the build
has ``one_shot_all_reduce_copy``. It is one kernel, so it records into the decode CUDA graphs like NCCL's. No
NVLink multicast is used (``multimem`` ops are never called).

It is used when every rank is on this host (torchrun's LOCAL_WORLD_SIZE equals the world size), the group is
NCCL, the dtype is float32 or bfloat16 and the sum is at most ``LLM_BUILDER_TP_ONE_SHOT_BYTES`` (default 2 MiB: a
256-sequence decode step of a 4096-wide bf16 model); NCCL otherwise (prefill chunks, other hosts, CPU's gloo).
``LLM_BUILDER_TP_ONE_SHOT_BYTES=0`` turns it off. Setting it up is collective: every rank allocates and exchanges
its buffer when it compiles its first all_reduce node (the ranks compile the same graph in the same order), then
the ranks agree by an all_reduce of a flag, so a rank that could not set it up makes all of them use NCCL. One
process group per process sets it up (:func:`all_reduce_for`): a second engine in the same process sums over NCCL.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ONE_SHOT_BYTES_ENV = "LLM_BUILDER_TP_ONE_SHOT_BYTES"
DEFAULT_ONE_SHOT_BYTES = 2 << 20
ONE_SHOT_DTYPES = (torch.float32, torch.bfloat16)  # what PyTorch's one-shot kernel sums

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # a partial sum in, the ranks' sum out (same shape and dtype)


def one_shot_bytes() -> int:
    """The largest sum (bytes) taken by the one-shot path; 0: never."""
    raw = os.environ.get(ONE_SHOT_BYTES_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_ONE_SHOT_BYTES
    except ValueError:
        raise ValueError(f"{ONE_SHOT_BYTES_ENV}={raw!r} is not a whole number of bytes (0 turns the one-shot "
                         f"all-reduce off; default {DEFAULT_ONE_SHOT_BYTES})") from None
    if value < 0:
        raise ValueError(f"{ONE_SHOT_BYTES_ENV}={raw!r} must be >= 0 (0 turns the one-shot all-reduce off)")
    return value


def one_shot_refusal(device: torch.device, dtype: torch.dtype, backend: str, world: int, local_world: int,
                     limit: int) -> str | None:
    """Why the one-shot path cannot serve this group (None: it can)."""
    if limit == 0:
        return f"{ONE_SHOT_BYTES_ENV}=0"
    if device.type != "cuda" or backend != "nccl":
        return f"{device.type} / {backend} group"
    if local_world != world:
        return f"ranks on more than one host ({local_world} of {world} here)"
    if dtype not in ONE_SHOT_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (it sums float32 and bfloat16)"
    return None


class PeerAllReduce:
    """A symmetric buffer of ``capacity`` elements on every rank of the default group (module docstring)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, capacity: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        # rendezvous resolves the group by name, as it is now: no enable_symm_mem_for_group, whose store it caches
        # by name would outlive this group and hang the rendezvous of the next engine's group of the same name
        self.group_name = dist.group.WORLD.group_name
        self.capacity = capacity
        self.buffer = symm_mem.empty(capacity, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, dist.group.WORLD)
        ops = torch.ops.symm_mem
        self._copy_op = getattr(ops, "one_shot_all_reduce_copy", None)
        self._op = ops.one_shot_all_reduce

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.numel() <= self.capacity

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        window = self.buffer[: flat.numel()]
        if self._copy_op is not None:
            y = self._copy_op(window, flat.contiguous(), "sum", self.group_name)
        else:
            window.copy_(flat)
            y = self._op(window, "sum", self.group_name)
        return y.view(x.shape)


def _nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def _agree(ok: bool, device: torch.device) -> bool:
    """True when every rank says ``ok`` (one all_reduce of a flag, MIN)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


_peers: dict[tuple[str, torch.dtype], PeerAllReduce | None] = {}
_generation = 0  # process groups left (reset) in this process
_set_up_in: int | None = None  # the generation whose group set symmetric memory up in this process


def reset() -> None:
    """Forget the buffers (the process group they belong to is being destroyed)."""
    global _generation
    _peers.clear()
    _generation += 1


def all_reduce_for(device: torch.device, dtype: torch.dtype) -> AllReduce:
    """The sum over the default group's ranks for partial sums of ``dtype`` on ``device``: one-shot where it fits
    (module docstring), NCCL / gloo (in place) otherwise. Collective on first use per (device, dtype).

    A process sets symmetric memory up for one process group only: PyTorch numbers its rendezvous exchanges per
    process, so a later group's rendezvous between this process (rank 0 of a second engine) and freshly started
    workers would wait on keys the others never write. The ranks agree on that first; a later group sums over
    NCCL."""
    global _set_up_in
    key = (str(device), dtype)
    if key not in _peers:
        world = dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        limit = one_shot_bytes()
        why = one_shot_refusal(device, dtype, dist.get_backend(), world, local_world, limit)
        peer = None
        if why is None:
            earlier = _set_up_in not in (None, _generation)
            if not _agree(not earlier, device):
                why = "symmetric memory was set up for an earlier process group in this process" if earlier else \
                    "another rank's process set symmetric memory up for an earlier process group"
        if why is None:
            _set_up_in = _generation
            try:
                peer = PeerAllReduce(device, dtype, limit // dtype.itemsize)
            except Exception as e:  # no peer access or no symmetric memory in this build: NCCL, on every rank
                why = f"symmetric memory unavailable ({type(e).__name__}: {e})"
            if not _agree(peer is not None, device):
                why, peer = why or "another rank could not set it up", None
        if peer is None:
            log.info("tensor parallel: all-reduce over %s (%s)", dist.get_backend(), why)
        else:
            log.info("tensor parallel: one-shot all-reduce over peer memory up to %d bytes, %s above", limit,
                     dist.get_backend())
        _peers[key] = peer
    peer = _peers[key]
    if peer is None:
        return _nccl_all_reduce
    return lambda x: peer(x) if peer.fits(x) else _nccl_all_reduce(x)

"""The start-up memory plan: weights + workspace + KV pool, and how many KV blocks that makes.

    device budget (CUDA: total memory x gpu_memory_utilization; CPU: the weights, the workspace and
                   the KV byte budget given)
    |<- weights ->|<- workspace: peak activations of one full step ->|<- KV pool: num_blocks blocks ->|
                                                                        each block: tokens_per_block
                                                                        tokens x all layers x (K + V)

On CUDA the workspace is measured by a profiling step of ``max_num_batched_tokens`` tokens, and memory
held outside this process's allocator (the CUDA context, other processes) is subtracted too; on CPU
it is estimated from the graph's widest activation. A plan whose pool cannot hold one request of
``max_seq_len`` tokens is refused at start-up with the figures, not discovered under load.

Tensor parallelism: every rank works out its own block count (``plan_budget`` and ``fit_kv_blocks`` over
its own device, weights, workspace and KV layout) and every rank's pool gets the least of them
(``least_kv_blocks``), so that a rank with less free memory than rank 0 cannot run out.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace

import torch

from runtime.kv_cache import KVLayout

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count: ``1073741824``, ``512MiB``, ``1.5GiB``, ``2GB`` (KB/MB/GB are powers of 1000;
    K/M/G and KiB/MiB/GiB powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m[2].lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count; write e.g. 536870912, 512MiB or 2GiB")
    value = int(float(m[1]) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return value


MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: the CPU path has no device total to take a fraction of


class MemoryPlanError(RuntimeError):
    """The budget cannot hold the weights, the workspace and one max_seq_len request's KV cache."""


@dataclass(frozen=True)
class MemoryPlan:
    """Where the device memory goes; ``num_blocks`` is what the block pool is built with."""

    device: str
    budget_bytes: int  # what the plan may use in all
    weights_bytes: int  # the artifact's tensors as loaded
    workspace_bytes: int  # activations of the largest step (measured on CUDA, estimated on CPU)
    other_bytes: int  # held outside this allocator (CUDA context, other processes; a draft model's caches)
    block_size: int  # tokens per block
    bytes_per_block: int  # all layers, K and V
    num_blocks: int
    max_seq_len: int
    rank_num_blocks: tuple[int, ...] = ()  # tensor parallelism: each rank's own figure (num_blocks: the least)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one request of max_seq_len tokens needs."""
        return -(-self.max_seq_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many max_seq_len requests the pool holds at once."""
        return self.num_blocks / self.blocks_per_seq

    def describe(self) -> str:
        return (f"memory plan on {self.device}: budget {self.budget_bytes / MiB:.1f} MiB = weights "
                f"{self.weights_bytes / MiB:.1f} MiB + workspace {self.workspace_bytes / MiB:.1f} MiB + other "
                f"{self.other_bytes / MiB:.1f} MiB + KV cache {self.kv_cache_bytes / MiB:.1f} MiB "
                f"({self.num_blocks} blocks x {self.block_size} tokens = {self.num_blocks * self.block_size} "
                f"tokens; max concurrency at max_seq_len {self.max_seq_len}: {self.max_concurrency:.2f})"
                + (f"; the least of the ranks' {list(self.rank_num_blocks)} blocks" if self.rank_num_blocks else ""))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def fit_kv_blocks(kv_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks of ``bytes_per_block`` in ``kv_bytes`` (0 when it is negative, or a block takes nothing)."""
    return int(max(0, kv_bytes // bytes_per_block)) if bytes_per_block else 0


def plan_budget(device: torch.device, *, weights_bytes: int, workspace_bytes: int, other_bytes: int,
                bytes_per_block: int, gpu_memory_utilization: float, kv_cache_bytes: int | None,
                num_blocks: int | None) -> tuple[int, int]:
    """(budget bytes, other bytes) of a plan (ServingConfig's figures as given): ``num_blocks`` blocks, or on CPU
    the ``kv_cache_bytes`` (default 1 GiB) beside weights, workspace and other; on CUDA the utilization's share of
    the device, capped at ``kv_cache_bytes`` of KV cache, with the memory held outside this allocator added to
    ``other_bytes``."""
    if num_blocks is not None or device.type != "cuda":
        kv_bytes = (num_blocks * bytes_per_block if num_blocks is not None
                    else kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
        return weights_bytes + workspace_bytes + other_bytes + kv_bytes, other_bytes
    budget, held = cuda_budget(device, gpu_memory_utilization)
    other = other_bytes + held
    if kv_cache_bytes is not None:
        budget = min(budget, weights_bytes + workspace_bytes + other + kv_cache_bytes)
    return budget, other


def plan_kv_blocks(*, device: str, budget_bytes: int, weights_bytes: int, workspace_bytes: int,
                   other_bytes: int, layout: KVLayout, block_size: int, max_seq_len: int) -> MemoryPlan:
    """Give what is left of ``budget_bytes`` after weights, workspace and other to KV blocks; raises
    MemoryPlanError if that is less than one max_seq_len request needs."""
    bytes_per_block = layout.bytes_per_token() * block_size
    ram = host_memory_bytes()
    if device == "cpu" and ram and budget_bytes > ram:  # a CPU plan is what it asks for: it must fit the machine
        raise MemoryPlanError(
            f"the CPU memory plan needs {budget_bytes / GiB:.1f} GiB (weights {weights_bytes / GiB:.2f} GiB, workspace "
            f"{workspace_bytes / GiB:.2f} GiB for max_num_seqs and max_num_batched_tokens, KV cache "
            f"{(budget_bytes - weights_bytes - workspace_bytes - other_bytes) / GiB:.2f} GiB): more than this "
            f"machine's {ram / GiB:.1f} GiB of memory. Lower max_num_seqs, max_num_batched_tokens or the KV budget "
            f"(--kv-cache-memory)")
    kv_bytes = budget_bytes - weights_bytes - workspace_bytes - other_bytes
    num_blocks = fit_kv_blocks(kv_bytes, bytes_per_block)
    plan = MemoryPlan(device, int(budget_bytes), int(weights_bytes), int(workspace_bytes), int(other_bytes),
                      block_size, int(bytes_per_block), int(num_blocks), max_seq_len)
    if num_blocks < plan.blocks_per_seq:
        need = plan.blocks_per_seq * bytes_per_block
        raise MemoryPlanError(
            f"the KV cache gets {max(kv_bytes, 0) / MiB:.1f} MiB ({num_blocks} blocks of {block_size} tokens) but "
            f"one request of max_seq_len {max_seq_len} needs {plan.blocks_per_seq} blocks ({need / MiB:.1f} MiB); "
            f"{plan.describe()}. Raise gpu_memory_utilization (or the CPU KV budget, --kv-cache-memory), "
            f"or lower max_seq_len")
    return plan


def least_kv_blocks(plan: MemoryPlan, rank_num_blocks: list[int]) -> MemoryPlan:
    """Rank 0's ``plan`` with the least of every rank's block count (``rank_num_blocks``, by rank; rank 0's own
    is ``plan.num_blocks``): the pool every rank can hold. Raises MemoryPlanError, naming the rank, when that
    is less than one max_seq_len request needs."""
    least = min(range(len(rank_num_blocks)), key=lambda r: (rank_num_blocks[r], r))
    num_blocks = min(rank_num_blocks[least], plan.num_blocks)
    out = replace(plan, num_blocks=num_blocks, rank_num_blocks=tuple(rank_num_blocks))
    if num_blocks < plan.blocks_per_seq:
        raise MemoryPlanError(
            f"tensor-parallel rank {least} has room for {rank_num_blocks[least]} KV blocks of {plan.block_size} "
            f"tokens (rank 0: {plan.num_blocks}) but one request of max_seq_len {plan.max_seq_len} needs "
            f"{plan.blocks_per_seq}; every rank's pool is the least of them. {out.describe()}. Free memory on that "
            f"rank's device, raise gpu_memory_utilization (or --kv-cache-memory), or lower max_seq_len")
    if num_blocks < plan.num_blocks:
        log.info("tensor-parallel rank %d has room for %d KV blocks (rank 0: %d): every rank's pool gets %d",
                 least, rank_num_blocks[least], plan.num_blocks, num_blocks)
    return out


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 0


def estimate_workspace_bytes(graph: dict, max_num_batched_tokens: int, max_num_seqs: int,
                             dtype: torch.dtype) -> int:
    """A CPU-side estimate of one step's activation peak: a few tensors of the widest activation over
    the batch's tokens, the attention gather of one sequence, and fp32 logits for every sequence."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    widest = max((n["attrs"].get("out_features", 0) for n in graph["nodes"] if n["op"] == "linear"), default=0)
    vocab = int(graph.get("meta", {}).get("vocab_size", 0))
    return int(4 * max_num_batched_tokens * widest * itemsize + 4 * max_num_seqs * vocab)


def cuda_budget(device: torch.device, gpu_memory_utilization: float) -> tuple[int, int]:
    """(budget bytes, bytes held outside this process's torch allocator) on a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    other = max(0, total - free - reserved)
    return int(total * gpu_memory_utilization), int(other)

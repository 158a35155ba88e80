"""Graph IR and passes. Importing this package registers every pass."""

from passes import dce, fuse_add_rms_norm, fuse_silu_mul, merge_gate_up, merge_qkv, verify  # noqa: F401
from passes.base import PASSES, Pass, PassContext, PassError, PassRecord, PassResult, run_passes
from passes.ir import IR_VERSION, Graph, GraphError, Node

__all__ = ["IR_VERSION", "PASSES", "Graph", "GraphError", "Node", "Pass", "PassContext", "PassError",
           "PassRecord", "PassResult", "run_passes"]
from passes import fp8, smoothquant  # noqa: E402,F401  quantization methods register themselves
from passes import kv_cache_quant  # noqa: E402,F401
from passes import int8_wo  # noqa: E402,F401
from passes import awq, gptq  # noqa: E402,F401
from passes import shard  # noqa: E402,F401  tensor parallelism, run last (builder/pipeline.py)

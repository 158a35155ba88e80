"""``python -m runtime.serve ARTIFACT``: serve an artifact over HTTP (OpenAI-compatible API, /metrics).

    python -m runtime.serve artifacts/quickstart --port 8000 --max-num-seqs 8 --kv-cache-memory 512MiB

Binds to 127.0.0.1 unless told otherwise; on any other address without an API key it warns loudly,
since anyone who can reach the port can then use the model. The API key comes from ``--api-key`` or
the environment variable LLM_BUILDER_API_KEY; an empty (or blank) key is an error, not "no key". SIGINT
(Ctrl-C) and SIGTERM shut down gracefully: requests in flight get GRACEFUL_SHUTDOWN_S seconds to
finish. Exit codes: 0 after Ctrl-C (after SIGTERM the process ends by that signal, as uvicorn re-raises
it for process managers), 1 when the API key is empty or the artifact cannot be loaded or its memory
plan does not fit, 2 for bad options.
Needs only the runtime's dependencies (``pip install "llm-builder[runtime]"``).

``--api-servers N`` runs N HTTP server processes sharing the port over the one engine process
(``runtime.api_servers``), for loads where one process's event loop is the limit.

A tensor-parallel artifact (built with ``parallel.tp_size: N``) starts its N - 1 worker ranks itself, one
per GPU after ``--device``'s; or launch it as ``torchrun --nproc-per-node N -m runtime.serve ARTIFACT``:
rank 0 serves HTTP, the other ranks only run steps. Across nodes, on each of M nodes (M x G = N ranks, the
artifact at the same path on every node):

    torchrun --nnodes M --nproc-per-node G --node-rank I --master-addr NODE0_ADDRESS --master-port PORT \
        -m runtime.serve ARTIFACT

Rank 0 (node 0's first process) serves HTTP; a worker rank loads its weight file in its own process, runs
the steps until rank 0 stops them and exits 0 (it ignores Ctrl-C, as the engine process does: rank 0 stops it
after its graceful shutdown). A rank that dies turns /health to 503.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from runtime.net import bind_sockets, close_sockets

API_KEY_ENV = "LLM_BUILDER_API_KEY"
GRACEFUL_SHUTDOWN_S = 30  # on SIGTERM, how long requests in flight may finish before they are aborted

log = logging.getLogger("runtime.serve")

def _byte_count(text: str) -> int:
    """An argparse type: ``runtime.memory.parse_bytes`` with its message kept."""
    from runtime.memory import parse_bytes  # imports torch: not for --help

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` > 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n int' if kind is int else ' number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; it must be in 0..65535 (0: any free one)")
    return value


def _name(text: str) -> str:
    """An argparse type: a non-blank model name."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the name is empty; give one, or leave the option out for the artifact's")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.serve", description=__doc__.split("\n\n")[0].strip("`"),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("artifact", help="artifact directory (built by `builder build`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the server to the network")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--device", default="auto", help="auto (CUDA when this machine has it, else the CPU), cpu, cuda "
                                                   "or cuda:N")
    p.add_argument("--served-model-name", type=_name, default=None,
                   help="the model id clients send (default: the artifact's name)")
    g = p.add_argument_group("serving limits (default: the artifact's runtime section)")
    g.add_argument("--max-num-seqs", type=_positive(int), default=None, help="requests in the running batch")
    g.add_argument("--max-num-batched-tokens", type=_positive(int), default=None, help="tokens per engine step")
    g.add_argument("--max-seq-len", type=_positive(int), default=None, help="prompt plus output; may only lower it")
    g.add_argument("--max-waiting", type=_positive(int), default=256,
                   help="queued requests; past it requests get 429 with Retry-After")
    g.add_argument("--request-timeout", type=_positive(float), default=None, metavar="SECONDS",
                   help="per-request deadline from admission (504 / an error event past it); default none")
    m = p.add_argument_group("KV cache memory")
    m.add_argument("--kv-cache-memory", type=_byte_count, default=None, metavar="BYTES",
                   help="KV pool size, e.g. 512MiB (CPU default 1GiB; on CUDA a cap under the utilization budget)")
    m.add_argument("--num-blocks", type=_positive(int), default=None, help="exact number of KV blocks (overrides bytes)")
    m.add_argument("--tokens-per-block", type=_positive(int), default=None,
                   help="tokens per KV block, a power of two (default: $RUNTIME_TOKENS_PER_BLOCK, else the "
                        "artifact's); a multiple of the decode attention's key tile (64 for FP8 caches) reads faster")
    m.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.9,
                   help="CUDA: fraction of device memory for weights, workspace and KV cache")
    m.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument("--prefill-hold-ms", type=float, default=None, metavar="MS",
                   help="with CUDA-graph decode: how long a new prompt may wait while requests decode, so that arrivals "
                        "are prefilled together and the steps between stay graph replays (default: "
                        "$RUNTIME_PREFILL_HOLD_MS, else 0: at once; 50 helped under Poisson load, cost 12%% in a closed loop)")
    d = p.add_argument_group("speculative decoding (default: the artifact's, from its recipe's runtime.speculative "
                             "section; else off)")
    d.add_argument("--speculative-ngram", type=_positive(int), default=None, metavar="K",
                   help="n-gram (prompt lookup) speculation: up to K draft tokens per request and step, verified in "
                        "one step; output is unchanged (greedy: token for token; sampling: the same distribution)")
    d.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='the speculative section as a JSON object, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 12, "min_ngram": 3, "max_ngram": 6, "max_running": 8, '
                        '"min_acceptance": 0.2}\' (num_speculative_tokens: 12 for ngram, 4 for draft if left out; '
                        'max_running: no drafts in a step with more decoding requests; '
                        'min_acceptance: a request whose acceptance rate falls below it pauses), or {"method": '
                        '"draft", "draft_model": DIR} to draft with a second artifact of the same tokenizer, or '
                        '{"method": "eagle", "draft_model": DIR} with an EAGLE-1 head (config.json and '
                        'model.safetensors) over the target\'s hidden states, or {"method": null} '
                        'for none whatever the artifact says; --speculative-ngram K sets method and '
                        'num_speculative_tokens')
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs (debugging)")
    p.add_argument("--engine-thread", action="store_true",
                   help="step the engine in a thread of the server process instead of its own process (the HTTP "
                        "work and the step loop then share one interpreter lock: slower under load)")
    p.add_argument("--stream-interval", type=_positive(int), default=1, metavar="N",
                   help="tokens a streamed response gathers per server-sent event after its first (default 1: one "
                        "event per engine step); more cuts the server's CPU per token when its event loop is the "
                        "limit, at the cost of burstier deltas")
    p.add_argument("--api-servers", type=_positive(int), default=1, metavar="N",
                   help="HTTP server processes sharing the port over one engine process (runtime.api_servers): more "
                        "than 1 when one process's event loop is the limit (many concurrent streams)")
    p.add_argument("--allow-failed-gate", action="store_true", help="serve an artifact that failed its quality gates")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: assume it can be reached from elsewhere
        return False


def _warn_if_exposed(host: str, port: int, api_key: str | None) -> None:
    if api_key is None and not is_loopback(host):
        banner = "!" * 100
        log.warning("%s\nserving on %s:%d WITHOUT AN API KEY: anyone who can reach this address can use the model "
                    "and its compute.\nPass --api-key KEY or set %s, or bind to 127.0.0.1.\n%s",
                    banner, host, port, API_KEY_ENV, banner)


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The speculative section from ``--speculative-config`` and ``--speculative-ngram``, checked (raises
    ``runtime.speculative.SpeculativeConfigError``); None when neither is given (the artifact's section)."""
    from runtime.speculative import SpeculativeConfig, SpeculativeConfigError

    if args.speculative_config is None and args.speculative_ngram is None:
        return None  # the artifact's (its recipe's runtime.speculative section), else off
    config = SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else SpeculativeConfig()
    given = sorted(set(json.loads(args.speculative_config)) - {"method"}) if args.speculative_config else []
    if config.method is None and args.speculative_ngram is None and given:
        raise SpeculativeConfigError(f"--speculative-config sets {', '.join(given)} but no method: it replaces the "
                                     f"artifact's whole speculative section, so without a method speculation is off; "
                                     f"name the method (\"ngram\" or \"draft\") beside the settings, or pass '{{}}' "
                                     f"to turn speculation off")
    if args.speculative_ngram is not None:
        config = SpeculativeConfig.from_dict({**config.to_dict(), "method": "ngram",
                                              "num_speculative_tokens": args.speculative_ngram})
    return config.to_dict()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():  # an empty key must not quietly turn authentication off
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        print(f"error: {source} is empty; give a non-empty key to require one, or leave out --api-key and unset "
              f"{API_KEY_ENV} to serve without a key", file=sys.stderr)
        return 1  # before torch is imported: a second, not the seconds of a start-up
    from runtime.speculative import SpeculativeConfigError

    try:
        speculative = speculative_config(args)
    except SpeculativeConfigError as e:
        parser.error(str(e))  # exits 2
    from runtime.engine_process import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT,
                        force=True)
    from runtime.tensor_parallel import torchrun_rank

    if torchrun_rank():  # a worker rank of a torchrun launch, on any node: no server
        return _torchrun_worker(args)
    _warn_if_exposed(args.host, args.port, api_key)

    import uvicorn

    from runtime.artifact import ArtifactError
    from runtime.async_engine import AsyncEngine
    from runtime.engine_process import EngineProcess, EngineStartError
    from runtime.engine import DeviceError, resolve_device
    from runtime.memory import MemoryPlanError
    from runtime.server import create_app
    from runtime.serving import ServingConfig, ServingEngine
    from runtime.tokenizer import TokenizerError

    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    socks: list = []
    if args.api_servers == 1:  # bound before the engine loads: a taken port or a bad host fails at once
        try:
            socks = bind_sockets(args.host, args.port)
        except (OSError, UnicodeError, OverflowError) as e:
            print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
            return 1
    try:
        config = ServingConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_seq_len=args.max_seq_len, max_waiting=args.max_waiting,
            enable_prefix_caching=not args.no_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_bytes=args.kv_cache_memory, num_blocks=args.num_blocks, request_timeout_s=args.request_timeout,
            cuda_graphs=not args.no_cuda_graphs, speculative=speculative,
            **({} if args.prefill_hold_ms is None else {"prefill_hold_ms": args.prefill_hold_ms}),
            **({} if args.tokens_per_block is None else {"tokens_per_block": args.tokens_per_block}))
        if args.api_servers > 1:
            if args.engine_thread:
                print("error: --api-servers N > 1 runs the engine in its own process; leave out --engine-thread",
                      file=sys.stderr)
                return 2
            from runtime import api_servers

            return api_servers.serve(args.artifact, device, config, num_servers=args.api_servers, host=args.host,
                                     port=args.port, model_name=args.served_model_name, api_key=api_key,
                                     stream_interval=args.stream_interval, log_level=args.log_level,
                                     allow_failed_gate=args.allow_failed_gate,
                                     graceful_shutdown_s=GRACEFUL_SHUTDOWN_S)
        if args.engine_thread:
            serving = ServingEngine.load(args.artifact, device=device, config=config,
                                         allow_failed_gate=args.allow_failed_gate)
            engine = AsyncEngine(serving)
        else:
            engine = EngineProcess(args.artifact, device, config, allow_failed_gate=args.allow_failed_gate)
    except (ArtifactError, TokenizerError, MemoryPlanError, EngineStartError, ValueError) as e:
        print(f"error: cannot serve {args.artifact}: {e}", file=sys.stderr)
        close_sockets(socks)
        return 1
    except (OSError, UnicodeError, OverflowError) as e:  # --api-servers: the address could not be bound
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        close_sockets(socks)
        return 1
    model_name = args.served_model_name or engine.artifact.manifest["name"]
    log.info("serving %r as %r on %s (engine %s): max_num_seqs %s, max_num_batched_tokens %s, max_seq_len %d, "
             "max_waiting %d, prefix caching %s, request timeout %s, speculative decoding %s",
             args.artifact, model_name, device,
             "in a thread" if args.engine_thread else "in its own process", args.max_num_seqs or "the artifact's",
             args.max_num_batched_tokens or "the artifact's", engine.max_seq_len, args.max_waiting,
             "on" if config.enable_prefix_caching else "off",
             f"{args.request_timeout:g}s" if args.request_timeout else "none",
             "the artifact's (its recipe's runtime.speculative, if any)" if speculative is None else
             f"{speculative['method']} (up to {speculative['num_speculative_tokens']} drafts, at most "
             f"{speculative['max_running']} decoding requests)" if speculative["method"] else "off")
    try:
        app = create_app(engine, model_name, api_key, stream_interval=args.stream_interval)
    except ValueError as e:  # the checkpoint's generation_config.json sets a sampling default not allowed
        print(f"error: cannot serve {args.artifact}: {e}", file=sys.stderr)
        _close(engine)
        close_sockets(socks)
        return 1
    log.info("listening on %s", ", ".join(_address(sock) for sock in socks))
    try:
        uvicorn.Server(uvicorn.Config(app, log_config=None, log_level=args.log_level,
                                      timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)).run(sockets=socks)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised Ctrl-C
        pass
    finally:
        _close(engine)
        close_sockets(socks)
    return 0


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


def _torchrun_worker(args: argparse.Namespace) -> int:
    """A torchrun worker rank: load its shard in this process and run the steps rank 0 sends until it stops
    them (``runtime.tensor_parallel``); returns the exit code (0 once rank 0 stopped it)."""
    from pathlib import Path

    from runtime.artifact import ArtifactError, read_manifest
    from runtime.engine import DeviceError, Engine, resolve_device

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: rank 0 stops it
    unsharded = (f"error: torchrun started {os.environ['WORLD_SIZE']} processes but {args.artifact} is not sharded "
                 f"(parallel.tp_size 1): serve it without torchrun")
    try:
        if read_manifest(Path(args.artifact)).get("tensor_parallel", {}).get("tp_size", 1) == 1:
            print(unsharded, file=sys.stderr)  # before its weights are loaded
            return 1
        Engine.load(args.artifact, resolve_device(args.device), allow_failed_gate=args.allow_failed_gate)
    except SystemExit as e:  # the steps are over
        return e.code if isinstance(e.code, int) else 1
    except (ArtifactError, DeviceError) as e:
        print(f"error: cannot serve {args.artifact} as rank {os.environ['RANK']}: {e}", file=sys.stderr)
        return 1
    print(unsharded, file=sys.stderr)
    return 1


def _close(engine) -> None:
    """Stop the engine process, or close the in-thread engine (a tensor-parallel artifact's worker ranks)."""
    from runtime.engine_process import EngineProcess

    if isinstance(engine, EngineProcess):
        engine.shutdown()
    else:
        engine.engine.close()


if __name__ == "__main__":
    sys.exit(main())

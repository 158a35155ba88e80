"""Several HTTP server processes over one engine process: ``builder serve ARTIFACT --api-servers N``.

One server process's event loop does the HTTP work of every stream: parsing, JSON, server-sent-event framing, the
socket writes. Past ~15k streamed tokens a second that loop is the limit (docs/BENCHMARKS.md, session 30:
``serve_overhead_pct_fp8`` 15.6% on an H200). Here the parent binds the sockets (``runtime.net.bind_sockets``: every
address the host resolves to), starts the engine process with N channels
(``runtime.engine_process.start_engine_process``), then N server processes that each listen and accept on the shared
sockets (the kernel spreads the connections) and talk to the engine over their own channel:

    parent: bind, start the engine, start the servers, wait; SIGINT / SIGTERM -> SIGTERM to each server
    server i (uvicorn over the socket): runtime.server's app over an EngineClient on channel i
    engine: one step loop for every channel's requests; results go back on the channel a request came from

/metrics from any of them sums all of them: each server records its requests in prometheus_client's multiprocess
files (a directory the parent makes and removes), and the engine's gauges come from the engine's own stats, which
every channel receives each step. A server that exits has its requests aborted by the engine; the parent then
stops the others and the engine and exits 1, so that a process manager restarts the whole server. SIGINT and
SIGTERM shut the servers down gracefully (requests in flight get ``graceful_shutdown_s``), then the engine, which
stops once its last channel has closed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("runtime.serve")

ENGINE_STOP_TIMEOUT_S = 30.0  # after the servers have exited, how long the engine may take to finish


def _server_main(index: int, socks: list[socket.socket], to_engine, from_engine, limits: dict, artifact: str,
                 model_name: str, api_key: str | None, stream_interval: int, log_level: str, metrics_dir: str,
                 graceful_shutdown_s: float) -> None:
    """Server process ``index``: the app over its channel's EngineClient, served by uvicorn on the shared sockets."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before prometheus_client is imported (runtime.metrics)
    from runtime.engine_process import LOG_FORMAT

    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, force=True)
    import uvicorn

    from runtime.engine_process import EngineClient
    from runtime.server import create_app

    client = EngineClient(artifact, to_engine, from_engine, limits)
    app = create_app(client, model_name, api_key, stream_interval=stream_interval, multiprocess_metrics=True)
    config = uvicorn.Config(app, log_config=None, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s)
    log.info("server process %d accepting", index)
    uvicorn.Server(config).run(sockets=socks)


def serve(artifact: str, device: Any, config: Any, *, num_servers: int, host: str, port: int, model_name: str | None,
          api_key: str | None, stream_interval: int, log_level: str, allow_failed_gate: bool,
          graceful_shutdown_s: float, loader: Callable | None = None, check_hashes: bool = True) -> int:
    """Serve ``artifact`` with ``num_servers`` server processes (module docstring) until SIGINT or SIGTERM; the exit
    code (0 after SIGINT, 1 when a server or the engine exited by itself; after SIGTERM the process ends by that
    signal). Raises what ``start_engine_process`` raises (EngineStartError) and OSError when the address cannot be
    bound. ``loader``: the engine process's (``start_engine_process``'s; benchmarks simulate the device)."""
    from runtime.artifact import open_artifact
    from runtime.engine_process import start_engine_process, stop_process
    from runtime.net import bind_sockets, close_sockets

    opened = open_artifact(artifact, check_hashes=False)  # the engine process checks the hashes
    model_name = model_name or opened.manifest["name"]
    # bound before the engine loads (a taken port fails at once) as the one-server path binds them: every address
    # the host resolves to; each server process listens on them once it starts
    socks = bind_sockets(host, port)
    try:
        engine, channels, limits = start_engine_process(
            artifact, device, config, num_channels=num_servers, check_hashes=check_hashes,
            allow_failed_gate=allow_failed_gate, tp_size=opened.tp_size, **({} if loader is None else {"loader": loader}))
    except BaseException:
        close_sockets(socks)
        raise
    metrics_dir = tempfile.mkdtemp(prefix="llm-builder-metrics-")
    ctx = mp.get_context("spawn")
    servers = [ctx.Process(target=_server_main, name=f"api-server-{i}", args=(
        i, socks, to_engine, from_engine, limits, str(artifact), model_name, api_key, stream_interval, log_level,
        metrics_dir, graceful_shutdown_s)) for i, (to_engine, from_engine) in enumerate(channels)]
    for p in servers:
        p.start()
    # the servers hold their own copies now: an engine channel ends when its server's copy closes
    close_sockets(socks)
    for to_engine, from_engine in channels:
        to_engine.close()
        from_engine.close()
    log.info("serving %r as %r on %s:%d with %d server processes over one engine process", artifact, model_name, host,
             port, num_servers)

    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop and engine.is_alive() and all(p.is_alive() for p in servers):
            time.sleep(0.2)
        failed = not stop
        if failed:
            gone = [p.name for p in servers if not p.is_alive()] + ([] if engine.is_alive() else ["the engine"])
            log.error("%s exited; stopping the server", ", ".join(gone))
        for p in servers:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)  # uvicorn's graceful shutdown
        deadline = time.monotonic() + graceful_shutdown_s + 10
        for p in servers:
            p.join(max(0.0, deadline - time.monotonic()))
            stop_process(p)
        engine.join(ENGINE_STOP_TIMEOUT_S)  # it stops once its last channel has closed
        stop_process(engine)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if stop and stop[0] == signal.SIGTERM:  # as uvicorn does in one process: end by the signal, for process managers
        signal.raise_signal(signal.SIGTERM)
    return 1 if failed else 0

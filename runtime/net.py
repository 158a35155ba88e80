"""Listening sockets for the HTTP server: one server process (``runtime.serve``) or several (``runtime.api_servers``)
bind them the same way, before the engine loads."""

from __future__ import annotations

import socket


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address ``host`` resolves to (as asyncio's create_server binds them: IPv6 ones IPv6
    only, Nagle off through IPPROTO_TCP), not yet listening: the server listens once the engine has loaded, so until
    then a connection is refused rather than left unanswered. Raises OSError (a taken port, a host that does not
    resolve), UnicodeError (a malformed host name)."""
    infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                               flags=socket.AI_PASSIVE)
    socks, seen = [], set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except BaseException:
        close_sockets(socks)
        raise
    return socks


def close_sockets(socks: list) -> None:
    for sock in socks:
        sock.close()

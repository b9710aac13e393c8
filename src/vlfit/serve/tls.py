"""HTTPS whose handshakes are bounded: a handshake timeout, and handshakes counted against ``--max_connections``.

Given ``ssl_certfile``, uvicorn hands the TLS context to asyncio's server, which holds each connection in its
handshake for up to 60 seconds before the HTTP protocol exists: those connections are not counted anywhere, so 520
plain TCP connections that never start a handshake stay open past 50 s and, at the descriptor limit, every new HTTPS
client is refused. Here vlfit does the TLS itself, one level under its bounded HTTP protocol
(``vlfit.serve.connections``): ``tls_protocol`` is uvicorn's ``http=`` factory, each connection an asyncio
``SSLProtocol`` around a ``BoundedHttpToolsProtocol``, with

- ``--header_timeout`` as the handshake timeout (a handshake is part of what comes before a request head), and
- every connection in its handshake counted with the open connections against ``--max_connections``, and with its
  address's connections against ``--max_connections_per_client``: one beyond is closed at once (nothing can be
  answered before the handshake), logged and counted in ``vlfit_refused_total{limit="connections"}`` (or
  ``"client_connections"``) as the plain ones are.

``use_tls`` sets the context and the timeout in each server process (the one process, or each worker of
``--workers N``) before uvicorn serves; the app's limits and metrics come to each connection from the app's
lifespan state, as for plain HTTP. Where vlfit serves on uvicorn's h11 protocol instead (``http_protocol`` found
uvicorn's httptools protocol lacking), uvicorn does the TLS, and handshakes are bounded by asyncio's 60 s only.
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio.sslproto import SSLProtocol
from typing import Any

from vlfit.errors import ConfigError
from vlfit.serve.connections import BoundedHttpToolsProtocol, ConnectionRefusals, tls_handshakes
from vlfit.serve.limits import CLIENTS_KEY, LIMITS_KEY, METRICS_KEY

TLS_PROTOCOL = f"{__name__}:tls_protocol"  # uvicorn's http=, as an import string
_settings: dict[str, Any] = {}


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The server's TLS context of ``certfile`` and ``keyfile`` (PEM), as uvicorn would make it (TLS 1.2 or later).

    Raises:
        ConfigError: naming ``--ssl_certfile``/``--ssl_keyfile`` and the file when they do not load.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(
            f"--ssl_certfile {certfile} / --ssl_keyfile {keyfile}: they do not load as a PEM certificate and its "
            f"private key ({error.strerror or error}); give the certificate's PEM file and the key it was made with"
        ) from None
    return context


def use_tls(context: ssl.SSLContext, handshake_timeout: float) -> None:
    """What ``tls_protocol`` wraps this process's connections with."""
    _settings.update(context=context, handshake_timeout=handshake_timeout)


class _CountedTLS(SSLProtocol):
    """asyncio's TLS protocol that keeps its HTTP protocol among ``tls_handshakes`` until the handshake ends."""

    def __init__(self, app_protocol: BoundedHttpToolsProtocol, **kwargs: Any) -> None:
        super().__init__(app_protocol=app_protocol, **kwargs)
        self.http = app_protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        http = self.http
        limits, metrics = http.app_state.get(LIMITS_KEY), http.app_state.get(METRICS_KEY)
        if limits is not None and len(http.connections) + len(tls_handshakes) >= limits.max_connections:
            ConnectionRefusals.note(limits.max_connections)
            if metrics is not None:
                metrics.observe_refused("connections")
            transport.abort()  # nothing can be answered before a handshake
            return
        shares = http.app_state.get(CLIENTS_KEY)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer and shares is not None else ""
        if address and not shares.open_connection(address):
            if metrics is not None:
                metrics.observe_refused("client_connections")
            transport.abort()
            return
        tls_handshakes[http] = address  # left in BoundedHttpToolsProtocol.connection_made, or below
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        address = tls_handshakes.pop(self.http, "")
        if address:
            self.http.app_state[CLIENTS_KEY].close_connection(address)
        super().connection_lost(exc)


def tls_protocol(config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> asyncio.Protocol:
    """uvicorn's protocol factory for HTTPS: vlfit's bounded HTTP protocol inside a TLS layer (``use_tls``)."""
    if "context" not in _settings:
        raise RuntimeError("vlfit.serve.tls.use_tls was not called in this process")
    http = BoundedHttpToolsProtocol(config=config, server_state=server_state, app_state=app_state)
    loop = asyncio.get_running_loop() if _loop is None else _loop
    return _CountedTLS(http, loop=loop, sslcontext=_settings["context"], waiter=None, server_side=True,
                       ssl_handshake_timeout=_settings["handshake_timeout"])  # fmt: skip


__all__ = ["TLS_PROTOCOL", "server_context", "tls_protocol", "use_tls"]

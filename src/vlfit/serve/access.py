"""Who may ask ``vlfit serve`` what: API keys, the hosts it answers for, and the bodies it takes.

``AccessControl`` is the app's outermost check, before any work is done for a request:

- **Host allow-list.** A request whose ``Host`` header names none of ``allowed_hosts`` is answered 400: a page on
  another site that rebinds its DNS name to 127.0.0.1 reaches a loopback server under its own name and would read
  results and thumbnails otherwise. By default the loopback names (``localhost``, ``127.0.0.1``, ``::1``) and the
  address the server binds; ``*`` allows any.
- **API key.** With a key, every route but the web page itself, ``/api/health`` and the two probes Weaviate waits
  on (``/.well-known/live``, ``/.well-known/ready``) needs it, as ``Authorization: Bearer <key>``, ``X-API-Key:
  <key>`` or HTTP Basic with the key as the password (401 otherwise): Weaviate's module client sends no header of
  its own, but Go's HTTP client sends Basic credentials written into the URL it is given
  (``CLIP_INFERENCE_API=http://weaviate:KEY@host:port``). ``POST /api/reload`` changes what is
  served: it needs the admin key when one is set; without one, the API key, and with no key at all it is answered
  only to a loopback client. Keys are compared in constant time and never logged.
- **Bodies.** A ``POST`` body must be ``application/json`` (or, on ``/api/search``, a ``multipart/form-data``
  upload): anything else is 415, so a cross-site ``text/plain`` form post, which a browser sends without asking
  the server first, never reaches the JSON parser. ``/vectorize`` also takes a body without ``Content-Type``, as
  Weaviate's module client sends it (a page on another site can send one too, but cannot read the answer).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vlfit.errors import ConfigError
from vlfit.serve.limits import VECTORIZE_PATH, WEAVIATE_PROBES
from vlfit.serve.responses import error_response

API_KEY_ENV = "VLFIT_API_KEY"
ADMIN_KEY_ENV = "VLFIT_ADMIN_KEY"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# What anyone who can reach the port may fetch without a key: the page (it asks for the key) and the health check.
OPEN_PATHS = ("/", "/api/health", *WEAVIATE_PROBES)
ADMIN_PATHS = ("/api/reload",)
UPLOAD_PATHS = ("/api/search",)
UNTYPED_BODY_PATHS = (VECTORIZE_PATH,)  # Weaviate's Go client posts its JSON without a Content-Type
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class AccessPolicy:
    """What ``AccessControl`` enforces (see the module).

    Attributes:
        api_key: Needed on every route but ``OPEN_PATHS``; ``None``: none.
        admin_key: Needed on ``ADMIN_PATHS`` (and taken wherever the API key is); ``None``: the API key there.
        allowed_hosts: The names ``Host`` may carry (without port); ``("*",)``: any.
    """

    api_key: str | None = None
    admin_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def __repr__(self) -> str:  # never print a key
        keys = ", ".join(name for name, key in (("api_key", self.api_key), ("admin_key", self.admin_key)) if key)
        return f"AccessPolicy(keys: {keys or 'none'}, allowed_hosts={self.allowed_hosts})"

    @property
    def has_key(self) -> bool:
        return bool(self.api_key or self.admin_key)


def read_key(value: str | None, file: str | None, env: str, flag: str) -> str | None:
    """A key from its flag, its file (the first line, stripped) or the environment variable ``env``, in that order.

    Raises:
        ConfigError: naming the flag, when the file is missing or empty, or the key is blank.
    """
    if value is None and file:
        if not os.path.isfile(file):
            raise ConfigError(f"{flag}_file {file}: no such file")
        with open(file, encoding="utf-8") as handle:
            value = handle.readline().strip()
        if not value:
            raise ConfigError(f"{flag}_file {file}: the file's first line is empty; write the key there")
    if value is None:
        value = os.environ.get(env) or None
    if value is not None and not value.strip():
        raise ConfigError(f"{flag} is blank: give a key, or leave the flag out to serve without one")
    return value


def allowed_hosts(hosts: Sequence[str] | None, bound_host: str) -> tuple[str, ...]:
    """``hosts`` as given (``--allowed_hosts``), or the loopback names plus the address the server binds."""
    if hosts:
        return tuple(host.strip().lower().strip("[]") for host in hosts if host.strip())
    bound = bound_host.strip("[]").lower()
    extra = () if bound in ("", "0.0.0.0", "::") or bound in LOOPBACK_HOSTS else (bound,)
    return (*LOOPBACK_HOSTS, *extra)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine only."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, policy: AccessPolicy) -> str | None:
    """The warning a server bound beyond this machine without a key deserves (``None``: none)."""
    if is_loopback(host) or policy.has_key:
        return None
    return (
        f"--host {host}: anyone who reaches this port can search the index and read its images; set --api_key "
        "(and --ssl_certfile/--ssl_keyfile) to serve beyond this machine"
    )


class AccessControl:
    """The ASGI middleware of ``AccessPolicy`` (see the module)."""

    def __init__(self, app: Any, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy
        self.any_host = "*" in policy.allowed_hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope.get("headers") or ())
        refusal = self._refusal(scope, headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, extra = refusal
        await error_response(status, message, extra)(scope, receive, send)

    def _refusal(self, scope: dict, headers: dict[str, str]) -> tuple[int, str, dict[str, str] | None] | None:
        host = _host_name(headers.get("host", ""))
        if not self.any_host and host not in self.policy.allowed_hosts:
            return 400, f"this server does not answer for host {host!r} (--allowed_hosts)", None
        path, method = scope.get("path", ""), scope.get("method", "GET")
        client = (scope.get("client") or ("",))[0]
        if path in ADMIN_PATHS:
            if not self._admitted(headers, admin=True, client=client):
                if not self.policy.has_key:
                    return 403, f"{path} is answered to loopback clients only; set --admin_key to allow others", None
                return 401, f"{path} needs the admin key (--admin_key)", _CHALLENGE
        elif not _is_open(path) and not self._admitted(headers, admin=False, client=client):
            return 401, "this server needs an API key: send 'Authorization: Bearer <key>'", _CHALLENGE
        if method == "POST" and _has_body(headers):
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            accepted = ("application/json", "multipart/form-data") if path in UPLOAD_PATHS else ("application/json",)
            if kind not in accepted and not (kind == "" and path in UNTYPED_BODY_PATHS):
                return 415, f"{path} takes {' or '.join(accepted)}, not {kind or 'a body without Content-Type'}", None
        return None

    def _admitted(self, headers: dict[str, str], *, admin: bool, client: str) -> bool:
        policy = self.policy
        if admin:
            keys = [policy.admin_key] if policy.admin_key else [policy.api_key]
        else:
            keys = [policy.api_key, policy.admin_key]
        wanted = [key for key in keys if key]
        if not wanted:
            return not admin or is_loopback(client)
        given = _given_key(headers)
        return given is not None and any(hmac.compare_digest(given.encode(), key.encode()) for key in wanted)

    def __repr__(self) -> str:
        return f"AccessControl({self.policy!r})"


def _has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/static/")


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw}


def _host_name(host: str) -> str:
    """``Host`` without its port, lower case (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _given_key(headers: dict[str, str]) -> str | None:
    """The key a request carries: a bearer token, ``X-API-Key``, or the password of HTTP Basic credentials (what Go's
    HTTP client sends for a URL with ``user:password@``; the user name is not checked)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if auth[:6].lower() == "basic ":
        try:
            credentials = base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return None
        _, colon, password = credentials.partition(":")
        return password if colon and password else None
    return headers.get("x-api-key") or None

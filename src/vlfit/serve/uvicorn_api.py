"""What vlfit's connection protocol (``vlfit.serve.connections``) uses of uvicorn's private httptools protocol, and
the check at server start that it is there.

``BoundedHttpToolsProtocol`` subclasses ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` (tested on
uvicorn 0.54). ``protocol_api_problems`` names what a uvicorn lacks of it: a method or the arguments passed to it,
an attribute its ``__init__`` sets, a status line; ``vlfit.serve.connections.http_protocol`` then falls back to
uvicorn's h11 protocol with one warning instead of failing at the first connection.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
from collections.abc import Mapping

from vlfit.errors import first_line

try:  # uvicorn's private protocol module: where it moved or went, http_protocol() falls back to h11
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError as error:
    IMPORT_PROBLEM: str | None = f"uvicorn.protocols.http.httptools_impl: {first_line(error)}"
    STATUS_LINE, HttpToolsProtocol, httptools = {}, object, None  # type: ignore[assignment,misc]
else:
    IMPORT_PROBLEM = None

# What BoundedHttpToolsProtocol uses of uvicorn's protocol: the methods it overrides or calls, each with the number of
# arguments it passes; the attributes uvicorn's __init__ sets that it reads; the status lines it writes.
PROTOCOL_METHODS = {
    "connection_made": 1, "connection_lost": 1, "data_received": 1, "on_message_begin": 0, "on_url": 1,
    "on_header": 2, "on_headers_complete": 0, "_unset_keepalive_if_required": 0, "_should_upgrade": 0,
    "handle_websocket_upgrade": 0, "_unsupported_upgrade_warning": 0, "send_400_response": 1, "on_body": 1,
    "on_message_complete": 0, "on_response_complete": 0, "_start_asgi_task": 2,
}  # fmt: skip
PROTOCOL_KEYWORDS = ("config", "server_state", "app_state")  # how uvicorn creates a protocol per connection
PROTOCOL_ATTRIBUTES = ("app_state", "connections", "parser", "loop", "logger", "transport", "cycle", "headers",
                       "expect_100_continue")  # fmt: skip
STATUS_CODES = (408, 429, 431, 503)


def protocol_api_problems(protocol: type, status_line: Mapping[int, bytes]) -> list[str]:
    """What ``BoundedHttpToolsProtocol`` needs and ``protocol`` (uvicorn's ``HttpToolsProtocol``) lacks: a missing
    method, one that does not take the arguments passed, an attribute its ``__init__`` does not set, a status
    line ``status_line`` (uvicorn's ``STATUS_LINE``) does not hold; empty when everything is there."""
    problems = []
    for name, count in {"__init__": 0, **PROTOCOL_METHODS}.items():
        method = getattr(protocol, name, None)
        if not callable(method):
            problems.append(f"no {name}()")
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: nothing to check
        keywords = dict.fromkeys(PROTOCOL_KEYWORDS) if name == "__init__" else {}
        try:
            signature.bind(None, *[None] * count, **keywords)
        except TypeError:
            passed = ", ".join(f"{key}=" for key in keywords) if keywords else f"{count} argument(s)"
            problems.append(f"{name}{signature} does not take {passed}")
    assigned = _assigned_attributes(protocol)
    problems += [f"no self.{name}" for name in PROTOCOL_ATTRIBUTES if name not in assigned]
    problems += [f"no STATUS_LINE[{code}]" for code in STATUS_CODES if code not in status_line]
    return problems


def _assigned_attributes(protocol: type) -> set[str]:
    """The attributes of ``protocol``'s class and those its ``__init__`` methods (along the MRO) assign."""
    names = {name for cls in protocol.__mro__ for name in vars(cls)}
    for cls in protocol.__mro__:
        init = vars(cls).get("__init__")
        if init is not None and cls is not object:
            with contextlib.suppress(OSError, TypeError, SyntaxError):  # no source: its attributes count as missing
                tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
                names.update(
                    node.attr
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                )
    return names


__all__ = ["IMPORT_PROBLEM", "STATUS_LINE", "HttpToolsProtocol", "httptools", "protocol_api_problems"]

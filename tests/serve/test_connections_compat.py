"""vlfit's connection protocol subclasses uvicorn's private httptools protocol: the check at server start passes on
the uvicorn installed, and names what a protocol lacks (a method, its arguments, an attribute, a status line), in
which case ``vlfit serve`` warns once, naming the limits still enforced, and runs on uvicorn's h11 protocol."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("uvicorn")

from uvicorn.importer import import_from_string  # noqa: E402
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol  # noqa: E402

from vlfit.serve.connections import (  # noqa: E402
    BOUNDED_PROTOCOL,
    FALLBACK_PROTOCOL,
    BoundedHttpToolsProtocol,
    http_protocol,
    protocol_api_problems,
)


def _uvicorns_but(leave_out: str = "", **replace: object) -> type:
    """A fake of uvicorn's protocol: its class attributes (methods) without ``leave_out``, some replaced."""
    members = {name: value for name, value in vars(HttpToolsProtocol).items() if name != leave_out}
    return type("FakeProtocol", (), {**members, **replace})


def test_the_installed_uvicorn_has_what_the_bounded_protocol_uses(caplog):
    assert protocol_api_problems(HttpToolsProtocol, STATUS_LINE) == []
    with caplog.at_level(logging.WARNING, logger="vlfit.serve.connections"):
        chosen = http_protocol()
    assert import_from_string(chosen) is BoundedHttpToolsProtocol and not caplog.records


def test_a_missing_method_a_changed_signature_an_unset_attribute_and_a_status_line_are_named():
    assert protocol_api_problems(_uvicorns_but("on_url"), STATUS_LINE) == ["no on_url()"]

    def on_header(self, header):  # one argument where the subclass passes two
        pass

    (problem,) = protocol_api_problems(_uvicorns_but(on_header=on_header), STATUS_LINE)
    assert problem == "on_header(self, header) does not take 2 argument(s)"

    def __init__(self, config, server_state, state):  # noqa: N807  the lifespan state under another keyword
        self.app_state, self.connections, self.parser, self.loop, self.logger, self.transport = (None,) * 6
        self.tasks, self.cycle, self.headers, self.expect_100_continue = None, None, [], False

    (problem,) = protocol_api_problems(_uvicorns_but(__init__=__init__), STATUS_LINE)
    assert problem.startswith("__init__(self, config, server_state, state) does not take ")

    def __init__(self, config, server_state, app_state, _loop=None):  # noqa: N807, F811  sets no parser
        self.app_state, self.connections, self.loop, self.logger = app_state, server_state.connections, _loop, None
        self.transport, self.tasks = None, server_state.tasks
        self.cycle, self.headers, self.expect_100_continue = None, [], False

    assert protocol_api_problems(_uvicorns_but(__init__=__init__), STATUS_LINE) == ["no self.parser"]
    without_431 = {code: line for code, line in STATUS_LINE.items() if code != 431}
    assert protocol_api_problems(HttpToolsProtocol, without_431) == ["no STATUS_LINE[431]"]


def test_a_protocol_lacking_an_attribute_falls_back_to_h11_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vlfit.serve.connections"):
        chosen = http_protocol(_uvicorns_but("_should_upgrade"))
    assert chosen == FALLBACK_PROTOCOL == "h11" and chosen != BOUNDED_PROTOCOL
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "no _should_upgrade()" in message
    enforced, not_enforced = message.split("; --max_connections")
    for flag in (
        "--max_header_bytes",
        "--max_concurrency",
        "--max_upload_mb",
        "--body_timeout",
        "--keep_alive_timeout",
    ):
        assert flag in enforced
    assert not_enforced == " and --header_timeout are not enforced"

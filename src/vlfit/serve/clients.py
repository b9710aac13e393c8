"""Who a request comes from, and what each client holds: open connections, request bodies arriving and requests in
flight per client.

A client is its connection's address, or, for a connection from a trusted proxy (``--forwarded_allow_ips``), the
address the proxy names in ``X-Forwarded-For``: the last one there that is not itself a trusted proxy (the
addresses before it are whatever the client wrote). ``vlfit.serve.connections`` counts each client's connections
as they open and close, and refuses one beyond ``--max_connections_per_client`` (``ServerLimits``); the app's
middlewares (``vlfit.serve.middleware``) count a request's body while it arrives (``--max_uploads_per_client``,
``UploadLimit``) and the request from the moment its body is whole until it is answered (``--max_concurrency``
for the whole process, ``--max_concurrency_per_client`` per client, ``InFlightLimit``): a slot is taken when a
request is ready to run, so bodies that trickle in hold none. The connection refuses at a request's head what is
over a share already (``over_share``), before any application work. Each worker process of ``--workers N`` counts
its own.

As a slot is given back, the connections waiting for one (a refusal held until its ``Retry-After``,
``vlfit.serve.connections``) are tried first (``wait_for_room``), so a balancer's kept-open connection is served as
soon as the server has room instead of a second later.

A connection beyond its client's share is answered 429 only after ``Retry-After`` (reading nothing meanwhile), so
a client that opens another as soon as one closes is held to one accept a second per connection; so is one refused
at ``--max_connections`` from an address that holds connections beside other addresses (``ConnectionPool``). At most
``HELD_REFUSALS`` wait so at once, as many as the process's descriptors allow beside ``--max_connections``
(``held_refusals_that_fit`` raises the soft limit towards what they need, as far as the hard limit allows, as Go's
runtime and nginx's ``worker_rlimit_nofile`` do); beyond those one is closed at once.

Where the idea comes from: nginx's ``limit_conn`` per ``$binary_remote_addr`` and its ``realip`` module
(``set_real_ip_from``, ``real_ip_recursive``), which takes the last untrusted address of the header.
"""

from __future__ import annotations

import ipaddress
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from vlfit.errors import ConfigError
from vlfit.serve.pool import ConnectionPool

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Connections refused beyond their client's share that may wait for their answer at once (fewer where the
# descriptors do not allow them: ``held_refusals_that_fit``). A hog that reopens at once holds this many, not more.
HELD_REFUSALS = 1024
DESCRIPTOR_MARGIN = 256  # the process's own files beside its connections: the index, the model, logs, sockets
WAKE_TRIES = 4  # waiting connections tried per slot given back (each still refused goes to the back of the line)
READY_KEY = "vlfit.ready"  # a request's scope entry: the release of its count as ready (ClientShares.hold_ready)


class Waiter(Protocol):
    def try_admit(self) -> bool | None:
        """Admit the request this waits with if it fits now: True when it was; None when it waits no more without
        (waited past its budget, or gone); False when it still waits."""


def trusted_networks(forwarded_allow_ips: str | None) -> tuple[Network, ...] | None:
    """The networks of ``--forwarded_allow_ips`` (addresses, networks such as ``10.0.0.0/8``, or ``*`` for any:
    ``None`` is returned for ``*``); an empty tuple when none is given.

    Raises:
        ConfigError: naming the flag and the entry that is not an address or a network.
    """
    entries = [part.strip() for part in (forwarded_allow_ips or "").split(",") if part.strip()]
    if "*" in entries:
        return None
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigError(
                f"--forwarded_allow_ips: {entry!r} is not an address or a network (give the proxies' addresses, "
                "comma-separated, such as 127.0.0.1,10.0.0.0/8, or * for any)"
            ) from None
    return tuple(networks)


class ClientShares:
    """Connections and requests in flight per client, and the decision to refuse one more.

    Args:
        max_connections: Open connections one client address may hold.
        max_requests: Requests in flight one client may have.
        forwarded_allow_ips: The trusted proxies (``trusted_networks``).
        max_held: Connections refused beyond their share that may wait for their answer at once.
        max_uploads: Request bodies of one client that may be arriving at once (None: ``max_requests``).
    """

    def __init__(
        self,
        max_connections: int,
        max_requests: int,
        forwarded_allow_ips: str | None = None,
        max_held: int = HELD_REFUSALS,
        max_uploads: int | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.max_requests = max_requests
        self.max_held = max_held
        self.max_uploads = max_requests if max_uploads is None else max_uploads
        self._trusted = trusted_networks(forwarded_allow_ips)
        self.connections: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()
        self.in_flight = 0  # requests in flight, every client's (a trusted proxy's own included)
        self.ready: Counter[str] = Counter()  # per client: passed to the app, body whole, not yet counted in flight
        self.ready_total = 0
        self.held_refusals = 0
        self.pool = ConnectionPool()  # every open connection by its peer's address, for the fair share of the slots
        self._waiting: OrderedDict[Waiter, None] = OrderedDict()  # the newest last

    def is_trusted_proxy(self, address: str) -> bool:
        if self._trusted is None:
            return True
        if not self._trusted:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted)

    def client_of(self, address: str, forwarded_for: bytes | None) -> str:
        """The client of a request from ``address`` with ``X-Forwarded-For`` ``forwarded_for`` (None: no header):
        behind a trusted proxy the last address of the header that is not a trusted proxy, else ``address``."""
        if forwarded_for is None or not self.is_trusted_proxy(address):
            return address
        hops = [hop.strip() for hop in forwarded_for.decode("latin-1").split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self.is_trusted_proxy(hop):
                return hop
        return hops[0] if hops else address

    def client_of_scope(self, scope: dict) -> str:
        """The client of an ASGI request ``scope`` (``client_of`` its peer and its ``X-Forwarded-For``)."""
        peer = scope.get("client")
        forwarded_for = next((value for name, value in scope.get("headers") or () if name == b"x-forwarded-for"), None)
        return self.client_of(str(peer[0]) if peer else "", forwarded_for)

    def may_open(self, address: str) -> bool:
        """Whether a connection from ``address`` is within its share (a trusted proxy's always are)."""
        return self.is_trusted_proxy(address) or self.connections[address] < self.max_connections

    def open_connection(self, address: str) -> bool:
        """Count a connection from ``address``; False (not counted) when it would hold more than its share. A
        trusted proxy's connections are not limited per client."""
        if self.is_trusted_proxy(address):
            return True
        if not self.may_open(address):
            return False
        self.connections[address] += 1
        return True

    def close_connection(self, address: str) -> None:
        _uncount(self.connections, address)

    def hold_refusal(self) -> bool:
        """Count a refused connection that waits for its answer; False (not counted) at ``max_held``."""
        if self.held_refusals >= self.max_held:
            return False
        self.held_refusals += 1
        return True

    def release_refusal(self) -> None:
        self.held_refusals = max(0, self.held_refusals - 1)

    def over_share(self, client: str, *, uploading: bool = False) -> tuple[str, str] | None:
        """``(limit, reason)`` where ``client`` holds its share already (a refusal's words, without its
        ``Retry-After``): of requests in flight (``"client_requests"``), or, ``uploading`` (a request whose body is
        to come), of bodies arriving (``"client_uploads"``); None: neither."""
        if self.requests[client] + self.ready[client] >= self.max_requests:
            return "client_requests", self.requests_refusal
        if uploading and self.uploads[client] >= self.max_uploads:
            return "client_uploads", self.uploads_refusal
        return None

    @property
    def requests_refusal(self) -> str:
        return f"this client has {self.max_requests} requests in flight here (--max_concurrency_per_client)"

    @property
    def uploads_refusal(self) -> str:
        return f"this client has {self.max_uploads} request bodies arriving here (--max_uploads_per_client)"

    @property
    def slots_taken(self) -> int:
        """Slots of ``--max_concurrency`` taken: requests in flight, and those ready to be (``hold_ready``)."""
        return self.in_flight + self.ready_total

    def hold_ready(self, client: str) -> Callable[[], None]:
        """Count a request of ``client`` that its connection passed to the app, its body whole, until the app counts
        it in flight (``start_request``) or it ends: meanwhile its slot is taken for the heads its connection's
        neighbours send. (Between a request's parse and its first step in the app, the event loop parses the others
        that arrived with it: counted by the app alone, a burst passed the heads' check beyond ``--max_concurrency``
        and was refused by the app, at several times a head's cost: 10,000 of 11,700 refusals of 128 clients that
        resent at once.) Returns its release, which counts once, however often it is called."""
        self.ready[client] += 1
        self.ready_total += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.ready_total -= 1
                _uncount(self.ready, client)

        return release

    def start_request(self, client: str) -> bool:
        """Count a request of ``client`` in flight; False (not counted) when it has its share already."""
        if self.requests[client] >= self.max_requests:
            return False
        self.requests[client] += 1
        self.in_flight += 1
        return True

    def end_request(self, client: str) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        _uncount(self.requests, client)
        self._room()

    def start_upload(self, client: str) -> bool:
        """Count a request body of ``client`` arriving; False (not counted) when it has its share already."""
        if self.uploads[client] >= self.max_uploads:
            return False
        self.uploads[client] += 1
        return True

    def end_upload(self, client: str) -> None:
        _uncount(self.uploads, client)
        self._room()

    def wait_for_room(self, waiter: Waiter) -> None:
        """``waiter`` is tried (``Waiter.try_admit``) as requests end, the newest first, until it leaves."""
        self._waiting[waiter] = None

    def stop_waiting(self, waiter: Any) -> None:
        self._waiting.pop(waiter, None)

    def _room(self) -> None:
        """A request ended or a body is whole: the newest waiting connection that fits now is admitted (one: one
        slot was given back), of at most ``WAKE_TRIES`` tried. The newest: under overload the room goes to a request
        that has waited least, and those that waited past their budget leave the line (answered at their
        ``Retry-After``), so what is admitted so waits no longer than what is admitted at once."""
        for _ in range(min(WAKE_TRIES, len(self._waiting))):
            waiter, _ = self._waiting.popitem()
            admitted = waiter.try_admit()
            if admitted:
                return
            if admitted is False:  # still waits, behind the others: the next may be another client's, with room
                self._waiting[waiter] = None
                self._waiting.move_to_end(waiter, last=False)


def _uncount(counts: Counter[str], client: str) -> None:
    if client in counts:
        counts[client] -= 1
        if counts[client] <= 0:
            del counts[client]


def held_refusals_that_fit(max_connections: int) -> int:
    """How many refused connections may wait for their answer beside ``max_connections`` open ones, at most
    ``HELD_REFUSALS``: the soft file-descriptor limit is raised first towards what they need (as far as the hard
    limit allows; a worker process inherits it), and what still does not fit is left out."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise or to read
        return HELD_REFUSALS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + HELD_REFUSALS + DESCRIPTOR_MARGIN
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return HELD_REFUSALS
    return max(0, min(HELD_REFUSALS, soft - max_connections - DESCRIPTOR_MARGIN))


__all__ = [
    "HELD_REFUSALS",
    "ClientShares",
    "Waiter",
    "held_refusals_that_fit",
    "trusted_networks",
]

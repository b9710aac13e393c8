"""Who a request comes from, and what each client holds: open connections and requests in flight per client.

A client is its connection's address, or, for a connection from a trusted proxy (``--forwarded_allow_ips``), the
address the proxy names in ``X-Forwarded-For``: the last one there that is not itself a trusted proxy (the
addresses before it are whatever the client wrote). ``vlfit.serve.connections`` counts each client's connections
as they open and close and its requests from the moment the connection hands them to the app until their answer
is sent, and refuses what goes beyond ``--max_connections_per_client`` and ``--max_concurrency_per_client``
(``ServerLimits``), before any application work. Each worker process of ``--workers N`` counts its own.

A connection beyond its client's share is answered 429 only after ``Retry-After`` (reading nothing meanwhile), so
a client that opens another as soon as one closes is held to one accept a second per connection. At most
``HELD_REFUSALS`` wait so at once, as many as the process's descriptors allow beside ``--max_connections``
(``held_refusals_that_fit`` raises the soft limit towards what they need, as far as the hard limit allows, as Go's
runtime and nginx's ``worker_rlimit_nofile`` do); beyond those one is closed at once.

Where the idea comes from: nginx's ``limit_conn`` per ``$binary_remote_addr`` and its ``realip`` module
(``set_real_ip_from``, ``real_ip_recursive``), which takes the last untrusted address of the header.
"""

from __future__ import annotations

import ipaddress
from collections import Counter

from vlfit.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Connections refused beyond their client's share that may wait for their answer at once (fewer where the
# descriptors do not allow them: ``held_refusals_that_fit``). A hog that reopens at once holds this many, not more.
HELD_REFUSALS = 1024
DESCRIPTOR_MARGIN = 256  # the process's own files beside its connections: the index, the model, logs, sockets


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
    """

    def __init__(
        self,
        max_connections: int,
        max_requests: int,
        forwarded_allow_ips: str | None = None,
        max_held: int = HELD_REFUSALS,
    ) -> None:
        self.max_connections = max_connections
        self.max_requests = max_requests
        self.max_held = max_held
        self._trusted = trusted_networks(forwarded_allow_ips)
        self.connections: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.held_refusals = 0

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

    def open_connection(self, address: str) -> bool:
        """Count a connection from ``address``; False (not counted) when it would hold more than its share. A
        trusted proxy's connections are not limited per client."""
        if self.is_trusted_proxy(address):
            return True
        if self.connections[address] >= self.max_connections:
            return False
        self.connections[address] += 1
        return True

    def close_connection(self, address: str) -> None:
        if address in self.connections:
            self.connections[address] -= 1
            if self.connections[address] <= 0:
                del self.connections[address]

    def hold_refusal(self) -> bool:
        """Count a refused connection that waits for its answer; False (not counted) at ``max_held``."""
        if self.held_refusals >= self.max_held:
            return False
        self.held_refusals += 1
        return True

    def release_refusal(self) -> None:
        self.held_refusals = max(0, self.held_refusals - 1)

    def start_request(self, client: str) -> bool:
        """Count a request of ``client`` in flight; False (not counted) when it has its share already."""
        if self.requests[client] >= self.max_requests:
            return False
        self.requests[client] += 1
        return True

    def end_request(self, client: str) -> None:
        if client in self.requests:
            self.requests[client] -= 1
            if self.requests[client] <= 0:
                del self.requests[client]


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


__all__ = ["HELD_REFUSALS", "ClientShares", "held_refusals_that_fit", "trusted_networks"]

"""The connection slots of one server process as a pool: how many each address holds, which are idle, and whose
idle connection a newcomer takes when every slot is taken.

``--max_connections`` alone is shared first come, first served: 9 addresses that each held 60 idle connections (and
reopened each one as soon as it was closed) left every other client 0% answered, and raising the cap only raised
the count it takes. As nginx reuses idle keep-alive connections when its ``worker_connections`` run out, a new
connection from an address that holds fewer than its fair share (the slots over the addresses holding connections,
its own counted) takes the slot of an idle connection of the address that holds the most, provided that address
holds at least two more than the newcomer's (so two addresses at their share never trade slots back and forth).
Idle is a connection between requests, one that never sent a byte, or one still in an unfinished request head; a
connection with a request in the app (its body arriving, queued, computing, its answer being sent) or a refusal
waiting for its answer is never taken. ``vlfit.serve.connections`` closes the one taken (silently where nothing of a
request was sent, as for an idle keep-alive connection) and admits the newcomer. A newcomer that cannot take a slot
is refused: at once where its address holds none (or is alone on the server), after its ``Retry-After`` where its
address holds connections beside other addresses (``holds_some``: those holding the slots, whose reconnecting at
once, 3,000 refusals a second in the tests, is then one a second per connection).

Refused connections and the idle ones closed so are logged once per interval (``ConnectionRefusals``). Per accept
this costs O(1): each address's idle connections are an ordered set (the longest idle first), and the
addresses with an idle connection are filed by how many connections they hold, with the highest count kept.
Each worker process of ``--workers N`` keeps its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most this often, with the count since


class ConnectionPool:
    """The open connections of one process by address, and which of them are idle."""

    def __init__(self) -> None:
        self.size = 0  # connections in the pool
        self.held: dict[str, int] = {}  # connections per address
        self._idle: dict[str, dict[Hashable, None]] = {}  # per address, its idle connections, the longest idle first
        self._holding: dict[int, dict[str, None]] = {}  # the addresses with an idle connection, by how many they hold
        self._most = 0  # the largest key of _holding (0: no address has an idle connection)

    def add(self, address: str, connection: Hashable) -> None:
        """Count ``connection`` of ``address``, idle (it has sent nothing yet)."""
        self._unfile(address)
        self.held[address] = self.held.get(address, 0) + 1
        self.size += 1
        self._idle.setdefault(address, {})[connection] = None
        self._file(address)

    def remove(self, address: str, connection: Hashable) -> None:
        """Stop counting ``connection`` of ``address`` (added once, removed once)."""
        self._unfile(address)
        idle = self._idle.get(address)
        if idle is not None:
            idle.pop(connection, None)
            if not idle:
                del self._idle[address]
        self.held[address] -= 1
        if not self.held[address]:
            del self.held[address]
        self.size -= 1
        self._file(address)

    def idle(self, address: str, connection: Hashable) -> None:
        """``connection`` may be taken for another address's (it has no request in the app)."""
        idle = self._idle.get(address)
        if idle is None or connection not in idle:
            self._unfile(address)
            self._idle.setdefault(address, {})[connection] = None
            self._file(address)

    def busy(self, address: str, connection: Hashable) -> None:
        """``connection`` has a request in the app, or a refusal waiting for its answer: it is not taken."""
        idle = self._idle.get(address)
        if idle is not None and connection in idle:
            self._unfile(address)
            del idle[connection]
            if not idle:
                del self._idle[address]
            self._file(address)

    def holds_some(self, address: str) -> bool:
        """Whether ``address`` holds connections, beside other addresses holding some."""
        return address in self.held and len(self.held) > 1

    def reclaim_for(self, address: str, slots: int) -> Hashable | None:
        """The idle connection a newcomer from ``address`` takes when ``slots`` are all taken, removed from the pool;
        None where ``address`` holds its fair share already or no address with an idle connection holds two more."""
        mine = self.held.get(address, 0)
        holders = len(self.held) + (mine == 0)
        if mine * holders >= slots or self._most < mine + 2:
            return None
        other = next(iter(self._holding[self._most]))
        victim = next(iter(self._idle[other]))
        self.remove(other, victim)
        return victim

    def _unfile(self, address: str) -> None:
        if address not in self._idle:
            return
        count = self.held[address]
        addresses = self._holding[count]
        del addresses[address]
        if not addresses:
            del self._holding[count]
            while self._most and self._most not in self._holding:
                self._most -= 1

    def _file(self, address: str) -> None:
        if address in self._idle:
            count = self.held[address]
            self._holding.setdefault(count, {})[address] = None
            self._most = max(self._most, count)


class ConnectionRefusals:
    """Connections refused at ``--max_connections``, and idle ones closed for a newcomer holding fewer, logged once
    per interval rather than once per connection."""

    count = 0
    reclaimed = 0
    logged_at = 0.0

    @classmethod
    def note(cls, limit: int, *, reclaimed: bool = False) -> None:
        if reclaimed:
            cls.reclaimed += 1
        else:
            cls.count += 1
        now = time.monotonic()
        if now - cls.logged_at >= REFUSAL_LOG_INTERVAL_S:
            logger.warning("refused %d connection(s) over the limit of %d open (--max_connections), and closed %d idle "
                           "one(s) of the addresses holding the most for addresses holding fewer than their share",
                           cls.count, limit, cls.reclaimed)  # fmt: skip
            cls.count, cls.reclaimed, cls.logged_at = 0, 0, now


__all__ = ["ConnectionPool", "ConnectionRefusals"]

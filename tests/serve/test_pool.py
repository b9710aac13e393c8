"""The connection pool's bookkeeping (``vlfit.serve.pool``): whose idle connection a newcomer takes when every slot
is taken, checked against a plain recount of the connections after every step of random opens, closes, requests
and answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vlfit.serve.pool import ConnectionPool


def test_a_newcomer_below_its_share_takes_the_longest_idle_connection_of_the_address_holding_most() -> None:
    pool = ConnectionPool()
    for n in range(3):
        pool.add("a", f"a{n}")
    pool.add("b", "b0")
    pool.busy("a", "a0")  # a request in the app: never taken
    assert pool.size == 4 and pool.held == {"a": 3, "b": 1}
    assert pool.reclaim_for("c", slots=4) == "a1"  # a holds most; a1 idle longest of its idle ones
    assert pool.held == {"a": 2, "b": 1} and pool.size == 3
    pool.add("c", "c0")
    assert pool.reclaim_for("b", slots=4) is None  # b holds 1 of a share of 4/3: a holds 2, not 2 more than b
    assert pool.reclaim_for("d", slots=4) == "a2"  # d holds none: a's idle a2 goes (a0 is busy)
    assert pool.reclaim_for("e", slots=4) is None  # a holds 1 now, idle none; nobody holds 2 more than e
    assert pool.holds_some("a") and not pool.holds_some("e")  # a refused at the cap: answered after Retry-After
    alone = ConnectionPool()
    alone.add("a", "a0")
    assert not alone.holds_some("a")  # the only address holding any: answered at once


def test_an_address_at_its_share_takes_nothing_and_busy_connections_are_never_taken() -> None:
    pool = ConnectionPool()
    for n in range(4):
        pool.add("a", f"a{n}")
        pool.busy("a", f"a{n}")
    pool.add("b", "b0")
    assert pool.reclaim_for("c", slots=6) is None  # a's are all busy; b holds 1, not 2 more than c's none
    pool.add("b", "b1")
    pool.add("b", "b2")
    assert pool.reclaim_for("b", slots=6) is None  # b holds 3 of 6 / 2 already
    assert pool.reclaim_for("c", slots=6) == "b0"
    pool.idle("a", "a3")  # answered: idle again, a holds most
    assert pool.reclaim_for("c", slots=6) == "a3"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "close", "busy", "idle", "reclaim"]), st.integers(0, 4),
                          st.integers(0, 9)), max_size=120))  # fmt: skip
def test_the_pool_agrees_with_a_recount_after_any_steps(steps: list[tuple[str, int, int]]) -> None:
    pool, slots = ConnectionPool(), 12
    open_: dict[str, str] = {}  # connection -> address
    idle: set[str] = set()
    made = 0
    for action, who, which in steps:
        address = f"10.0.0.{who}"
        mine = sorted(c for c, a in open_.items() if a == address)
        if action == "open":
            pool.add(address, f"c{made}")
            open_[f"c{made}"] = address
            idle.add(f"c{made}")
            made += 1
        elif mine and action in ("close", "busy", "idle"):
            connection = mine[which % len(mine)]
            if action == "close":
                pool.remove(address, connection)
                del open_[connection]
                idle.discard(connection)
            elif action == "busy":
                pool.busy(address, connection)
                idle.discard(connection)
            else:
                pool.idle(address, connection)
                idle.add(connection)
        elif action == "reclaim":
            held = {a: sum(1 for x in open_.values() if x == a) for a in set(open_.values())}
            most = max((held[open_[c]] for c in idle), default=0)
            victim = pool.reclaim_for(address, slots)
            fair = held.get(address, 0) * (len(held) + (address not in held)) < slots
            if victim is None:
                assert not fair or most < held.get(address, 0) + 2
            else:
                assert fair and victim in idle and held[open_[victim]] == most >= held.get(address, 0) + 2
                del open_[victim]
                idle.discard(victim)
        recount = {a: sum(1 for x in open_.values() if x == a) for a in set(open_.values())}
        assert pool.held == recount and pool.size == len(open_)

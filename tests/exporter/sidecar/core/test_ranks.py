"""RankRegistry: hellos, restarts, reconnects, refusals, seq order, static labels, staleness,
expiry and the max_ranks bound."""

from __future__ import annotations

import pytest

from exporter.config import RanksConfig
from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.messages import Hello, RankId
from exporter.sidecar.core.ranks import Join, RankState, RankStatus, exposition_order
from tests.exporter.sidecar.harness import (
    BYTES,
    STATIC,
    STATIC_KEY,
    TOKENS,
    Harness,
    bytes_,
    tokens,
)

# --- hello, restart, reconnect ---


def test_first_hello_makes_a_rank_with_its_identity(h: Harness) -> None:
    conn, result = h.hello_result(tp=1, pp=2, dp=3)
    rank = result.rank
    assert not result.restart and not result.reconnect
    assert (rank.tp_rank, rank.pp_rank, rank.dp_rank, rank.static) == (1, 2, 3, STATIC_KEY)
    assert rank.replica_group == (3, STATIC_KEY)
    assert rank.connection is conn and rank.connected and rank.live
    assert not rank.current  # it has not pushed since it connected
    assert h.state.ranks == {rank.identity: rank}
    assert rank.label_dict() == {"tp_rank": "1", "pp_rank": "2", "dp_rank": "3", **STATIC}
    h.push(rank, bytes_(1.0))
    assert rank.current and rank.snapshots == 1 and rank.last_push_wall == h.wall.now


def test_restart_clears_the_epochs_values_and_counts_the_restart(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(1000.0), tokens(500.0))
    h.state.disconnect(conn, rank)
    assert h.counter(BYTES) == 1000.0
    conn, again = h.hello(epoch="two")
    assert again is rank
    assert rank.restarts == 1 and rank.epoch == "two"
    assert rank.values == {}
    h.push(rank, bytes_(300.0), tokens(200.0))
    assert rank.values[(BYTES, ())] == 300.0  # values are as pushed; the rollup continues (test_ledger)
    assert h.counter(BYTES) == 1300.0


def test_restart_hello_result_flags(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.state.disconnect(conn, rank)
    msg = Hello(protocol=1, epoch="two", pid=1, rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0), labels=STATIC)
    result = h.state.hello(object(), msg)
    assert result.restart and not result.reconnect


def test_reconnect_same_epoch_continues_deltas(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(1000.0), tokens(100.0), seq=5)
    h.state.disconnect(conn, rank)
    msg = Hello(protocol=1, epoch="one", pid=1, rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0), labels=STATIC)
    result = h.state.hello(object(), msg)
    assert result.reconnect and not result.restart
    assert rank.reconnects == 1 and rank.restarts == 0
    assert not rank.current  # reconnected, not pushed yet
    h.push(rank, bytes_(1200.0), tokens(150.0), seq=6)
    assert h.counter(BYTES) == 1200.0
    assert h.counter(TOKENS, "kv") == 150.0
    # seq is compared within the connection: a seq it already sent is old.
    assert h.push(rank, bytes_(5000.0), seq=6).ignored
    assert rank.reconnects == 1 and rank.restarts == 0 and rank.epoch_conflicts == 0


def test_a_new_epoch_starts_its_seq_afresh(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(10.0), seq=50)
    h.state.disconnect(conn, rank)
    h.hello(epoch="two")
    result = h.push(rank, bytes_(1.0), seq=1)
    assert not result.ignored and rank.seq == 1
    assert h.counter(BYTES) == 11.0


def test_duplicate_rank_refused_while_connected(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    for epoch in ("one", "two"):
        with pytest.raises(ProtocolError) as err:
            h.hello(epoch=epoch)
        assert err.value.code is ErrorCode.DUPLICATE_RANK
    # The refused hellos changed nothing: the holder keeps its connection and epoch.
    assert rank.connection is conn and rank.epoch == "one"
    # Another static label is another identity, not a duplicate.
    h.hello(epoch="one", labels={**STATIC, "replica": "b"})
    h.state.disconnect(conn, rank)
    h.hello(epoch="one")


def test_disconnect_of_an_old_connection_is_ignored(h: Harness) -> None:
    old, rank = h.hello(epoch="one")
    h.state.disconnect(old, rank)
    new, _ = h.hello(epoch="one")
    h.push(rank, bytes_(1.0))
    h.state.disconnect(old, rank)
    assert rank.connection is new and rank.current


def test_stale_epoch_refused(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.state.disconnect(conn, rank)
    conn, _ = h.hello(epoch="two")
    h.state.disconnect(conn, rank)
    with pytest.raises(ProtocolError) as err:
        h.hello(epoch="one")
    assert err.value.code is ErrorCode.STALE_EPOCH
    assert rank.epoch == "two" and not rank.connected


def test_old_seq_ignored(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(100.0), seq=10)
    for seq in (10, 3):
        result = h.push(rank, bytes_(900.0), seq=seq)
        assert result.ignored and result.applied == 0
    assert h.counter(BYTES) == 100.0
    assert rank.values[(BYTES, ())] == 100.0
    assert not h.push(rank, bytes_(150.0), seq=11).ignored
    assert h.counter(BYTES) == 150.0


# --- static labels ---


def test_replica_groups_are_told_apart_by_static_labels(h: Harness) -> None:
    """Two replica groups at dp_rank 0 with a distinguishing static label are two groups."""
    labels_a = {**STATIC, "replica": "a"}
    labels_b = {**STATIC, "replica": "b"}
    _, a = h.hello(labels=labels_a)
    _, b = h.hello(labels=labels_b)
    assert a is not b and a.replica_group != b.replica_group
    h.push(a, tokens(10.0))
    h.push(b, tokens(20.0))
    assert h.counter(TOKENS, "kv", static=tuple(sorted(labels_a.items()))) == 10.0
    assert h.counter(TOKENS, "kv", static=tuple(sorted(labels_b.items()))) == 20.0


def test_static_labels_are_order_independent(h: Harness) -> None:
    conn, rank = h.hello(labels={"b": "2", "a": "1"})
    h.state.disconnect(conn, rank)
    _, again = h.hello(labels={"a": "1", "b": "2"})
    assert again is rank and rank.static == (("a", "1"), ("b", "2"))


@pytest.mark.parametrize(
    "labels",
    [
        {"le": "x"},
        {"quantile": "x"},
        {"tp_rank": "0"},
        {"dp_rank": "0"},
        {"__meta": "x"},
        {"1abc": "x"},
        {"bad-name": "x"},
        {"pool": "kv"},
        {"reason": "x"},
        {f"l{i}": "v" for i in range(9)},
        {"cache_type": "x" * 1025},
        {"cache_type": "UnifiedRadixCache", "a": ""},
        {"attn_cp_rank": "1"},
    ],
    ids=[
        "le", "quantile", "tp_rank", "dp_rank", "dunder", "digit_first", "dash",
        "family_label_pool", "family_label_reason", "too_many", "too_long_value", "empty_value", "attn_cp_rank",
    ],
)
def test_invalid_static_labels_refused(h: Harness, labels: dict[str, str]) -> None:
    with pytest.raises(ProtocolError) as err:
        h.hello(labels=labels)
    assert err.value.code is ErrorCode.INVALID_HELLO
    assert h.state.ranks == {}


def test_static_label_limits_are_inclusive(h: Harness) -> None:
    h.hello(labels={f"l{i}": "v" for i in range(8)})
    h.hello(labels={"cache_type": "x" * 1024})
    assert len(h.state.ranks) == 2


def test_static_label_limits_follow_config() -> None:
    h = Harness(ranks_config=RanksConfig(max_static_labels=1, max_label_value_length=4))
    h.hello(labels={"a": "1234"})
    for labels in ({"a": "1", "b": "2"}, {"a": "12345"}):
        with pytest.raises(ProtocolError) as err:
            h.hello(labels=labels)
        assert err.value.code is ErrorCode.INVALID_HELLO


# --- staleness and expiry ---


def test_stale_then_expired_transitions() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    _, rank = h.hello()
    h.push(rank, bytes_(100.0), tokens(40.0))
    h.clock.advance(9.5)
    assert rank.status is RankStatus.LIVE and rank.live and rank.current
    h.clock.advance(0.5)
    assert rank.status is RankStatus.STALE
    assert not rank.live and not rank.current
    assert rank in h.state.exposed_ranks()
    h.clock.advance(20.0)
    assert rank.status is RankStatus.EXPIRED
    assert rank not in h.state.exposed_ranks()
    assert h.counter(BYTES) == 100.0 and h.counter(TOKENS, "kv") == 40.0
    # A push brings it back, continuing its deltas.
    h.push(rank, bytes_(110.0))
    assert rank.status is RankStatus.LIVE and rank in h.state.exposed_ranks()
    assert h.counter(BYTES) == 110.0


def test_an_ignored_snapshot_does_not_keep_a_rank_fresh() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    _, rank = h.hello()
    h.push(rank, bytes_(1.0), seq=5)
    h.clock.advance(10.0)
    assert h.push(rank, bytes_(2.0), seq=5).ignored
    assert rank.status is RankStatus.STALE


def test_departed_rank_expires_but_keeps_its_rollup_contribution() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, gone = h.hello(tp=0)
    _, kept = h.hello(tp=1)
    h.push(gone, bytes_(100.0), tokens(70.0))
    h.push(kept, bytes_(1.0), tokens(70.0))
    h.state.disconnect(conn, gone)
    assert gone.status is RankStatus.DEPARTED and gone in h.state.exposed_ranks()
    for _ in range(4):
        h.clock.advance(9.0)
        h.push(kept, bytes_(1.0 + h.clock.now % 7))
    assert gone.status is RankStatus.EXPIRED
    assert h.state.exposed_ranks() == [kept]
    assert h.counter(BYTES) >= 101.0
    assert h.counter(TOKENS, "kv") == 70.0


def test_hello_of_an_expired_rank_brings_it_back() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(5.0))
    h.state.disconnect(conn, rank)
    h.clock.advance(30.0)
    assert rank.status is RankStatus.EXPIRED
    _, result = h.hello_result(epoch="one")
    assert result.rank is rank and result.reconnect
    assert rank.status is RankStatus.LIVE and rank in h.state.exposed_ranks()


# --- max_ranks ---


def test_max_ranks_refuses_a_new_identity_when_none_is_expired() -> None:
    h = Harness(ranks_config=RanksConfig(max_ranks=2))
    conn, first = h.hello(tp=0)
    h.hello(tp=1)
    h.state.disconnect(conn, first)  # departed, not expired: still remembered
    with pytest.raises(ProtocolError) as err:
        h.hello(tp=2)
    assert err.value.code is ErrorCode.TOO_MANY_RANKS
    assert len(h.state.ranks) == 2
    h.hello(tp=0)  # a known identity is not a new one


def test_max_ranks_forgets_expired_ranks_but_not_their_rollup_contribution() -> None:
    h = Harness(ranks_config=RanksConfig(max_ranks=2, stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, gone = h.hello(tp=0)
    _, kept = h.hello(tp=1)
    h.push(gone, bytes_(100.0), tokens(70.0))
    h.push(kept, bytes_(1.0), tokens(60.0))
    h.state.disconnect(conn, gone)
    h.clock.advance(31.0)
    h.push(kept, bytes_(2.0))
    assert gone.expired and not kept.expired
    series_before = h.state.series_budget().per_rank
    _, new = h.hello(tp=2)
    assert set(h.state.ranks.values()) == {kept, new}
    assert h.state.series_budget().per_rank == series_before - 2  # the forgotten rank's series are freed
    assert h.counter(BYTES) == 102.0 and h.counter(TOKENS, "kv") == 70.0


def test_max_ranks_keeps_an_expired_rank_that_is_still_connected() -> None:
    h = Harness(ranks_config=RanksConfig(max_ranks=1, stale_after_seconds=10.0, expire_after_seconds=30.0))
    _, silent = h.hello(tp=0)
    h.clock.advance(31.0)
    assert silent.expired and silent.connected
    with pytest.raises(ProtocolError) as err:
        h.hello(tp=1)
    assert err.value.code is ErrorCode.TOO_MANY_RANKS
    assert list(h.state.ranks.values()) == [silent]


def test_a_forgotten_rank_reconnecting_in_the_same_epoch_is_not_counted_twice() -> None:
    h = Harness(ranks_config=RanksConfig(max_ranks=2, stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, gone = h.hello(tp=0, epoch="e")
    _, kept = h.hello(tp=1)
    h.push(gone, bytes_(100.0), tokens(100.0))
    h.push(kept, bytes_(5.0), tokens(100.0))
    h.state.disconnect(conn, gone)
    h.clock.advance(31.0)
    h.push(kept, bytes_(5.0))
    conn_other, other = h.hello(tp=2)  # gone is forgotten to make room
    h.state.disconnect(conn_other, other)
    h.clock.advance(31.0)
    h.push(kept, bytes_(5.0))
    _, back = h.hello(tp=0, epoch="e")  # the same process and epoch; other is forgotten in turn
    assert back is not gone
    h.push(back, bytes_(110.0), tokens(110.0))
    assert h.counter(TOKENS, "kv") == 110.0
    # Its first value is a baseline: the 100 it pushed before stay counted once (not 215), and the
    # 10 it moved while forgotten are not known to the sidecar (115 would need the forgotten position).
    assert h.counter(BYTES) == 105.0
    h.push(back, bytes_(130.0))
    assert h.counter(BYTES) == 125.0  # and from there on every increase counts
    assert back.resumed
    h.state.disconnect(h.state.ranks[back.identity].connection, back)
    _, restarted = h.hello(tp=0, epoch="e2")  # a new epoch of a resumed identity counts from zero as usual
    h.push(restarted, bytes_(7.0))
    assert h.counter(BYTES) == 132.0 and not restarted.resumed

# --- listing ---


def test_exposed_ranks_and_groups_are_in_order(h: Harness) -> None:
    made = [h.hello(tp=tp, pp=pp, dp=dp, labels=labels)[1]
            for labels in ({"z": "1"}, {"a": "1"}) for dp in (1, 0) for pp in (1, 0) for tp in (1, 0)]
    exposed = h.state.exposed_ranks()
    assert exposed == sorted(made, key=exposition_order)
    assert [(r.tp_rank, r.pp_rank, r.dp_rank, r.static) for r in exposed[:4]] == [
        (0, 0, 0, (("a", "1"),)), (1, 0, 0, (("a", "1"),)), (0, 1, 0, (("a", "1"),)), (1, 1, 0, (("a", "1"),)),
    ]
    groups = h.state.registry.groups()
    assert set(groups) == {(dp, static) for dp in (0, 1) for static in ((("a", "1"),), (("z", "1"),))}
    for (dp, static), members in groups.items():
        assert [(r.pp_rank, r.tp_rank) for r in members] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(r.dp_rank == dp and r.static == static for r in members)


# --- context parallelism ---


def test_attn_cp_rank_is_part_of_the_identity_and_absent_means_zero(h: Harness) -> None:
    _, cp0 = h.hello(tp=0, cp=0)
    _, cp1 = h.hello(tp=0, cp=1)
    assert cp0 is not cp1 and cp0.replica_group == cp1.replica_group  # peers: one replica group
    with pytest.raises(ProtocolError) as err:
        h.hello(tp=0)  # no attn_cp_rank is cp 0: the same identity, already connected
    assert err.value.code is ErrorCode.DUPLICATE_RANK
    assert cp1.label_dict() == {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0", "attn_cp_rank": "1",
                                "cache_type": "UnifiedRadixCache"}
    _, plain = h.hello(tp=1)
    assert "attn_cp_rank" not in plain.label_dict()  # exposed only by ranks that have the axis
    assert [r.identity[:4] for r in h.state.exposed_ranks()] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 1)]


def test_an_empty_static_label_cannot_make_an_impostor_of_a_connected_rank(h: Harness) -> None:
    """Prometheus drops empty labels: `a=""` would expose as the real rank's series and win."""
    h.hello(tp=0)
    with pytest.raises(ProtocolError) as err:
        h.hello(tp=0, labels={**STATIC, "a": ""})
    assert err.value.code is ErrorCode.INVALID_HELLO and "empty value" in err.value.message
    assert len(h.state.ranks) == 1


# --- sources own their identities (issue 19, finding 9) ---

UPSTREAM = "upstream:engine"


def _hello_from(h: Harness, source: str, epoch: str, tp: int = 0) -> tuple[object, RankState]:
    """A hello for rank tp/0/0 with the harness' static labels, reported by `source`."""
    conn = object()
    msg = Join(rank=RankId(tp_rank=tp, pp_rank=0, dp_rank=0), labels=STATIC, epoch=epoch, pid=7)
    return conn, h.state.join(conn, msg, source).rank


def test_an_upstream_cannot_take_a_pushed_rank_over_while_it_restarts(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(100.0))
    h.state.disconnect(conn, rank)  # the rank's process restarts
    with pytest.raises(ProtocolError) as err:
        _hello_from(h, UPSTREAM, "upstream-e1")
    assert err.value.code is ErrorCode.IDENTITY_OWNED
    assert "pushed ranks" in err.value.message and "upstream engine" in err.value.message
    assert rank.source == "push" and rank.epoch == "one" and rank.restarts == 0  # nothing changed
    # The real rank comes back as a restart, not a duplicate of an upstream's rank.
    _, again = h.hello(epoch="two")
    assert again is rank and rank.restarts == 1
    h.push(rank, bytes_(5.0))
    assert h.counter(BYTES) == 105.0


def test_a_pushed_rank_cannot_take_an_upstreams_identity(h: Harness) -> None:
    conn, rank = _hello_from(h, UPSTREAM, "upstream-e1")
    for connected in (True, False):
        with pytest.raises(ProtocolError) as err:
            h.hello(epoch="pushed")
        assert err.value.code is ErrorCode.IDENTITY_OWNED, connected
        h.state.disconnect(conn, rank)
    assert rank.source == UPSTREAM and rank.epoch == "upstream-e1"
    # Another upstream is another source too.
    with pytest.raises(ProtocolError) as err:
        _hello_from(h, "upstream:other", "other-e1")
    assert err.value.code is ErrorCode.IDENTITY_OWNED
    # Its own source may come back.
    _, again = _hello_from(h, UPSTREAM, "upstream-e1")
    assert again is rank and rank.reconnects == 1


def test_an_expired_identity_is_free_for_another_source() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, rank = _hello_from(h, UPSTREAM, "upstream-e1")
    h.push(rank, bytes_(100.0), tokens(10.0))
    h.state.disconnect(conn, rank)
    h.clock.advance(29.0)
    with pytest.raises(ProtocolError):  # departed, not yet expired: still the upstream's
        h.hello(epoch="pushed")
    h.clock.advance(1.0)
    assert rank.status is RankStatus.EXPIRED
    _, pushed = h.hello(epoch="pushed")
    assert pushed is not rank and pushed.source == "push" and h.state.ranks[pushed.identity] is pushed
    assert h.state.series_budget().per_rank == 0  # the upstream's series were freed with it
    h.push(pushed, bytes_(7.0))
    assert h.counter(BYTES) == 107.0  # the upstream's contribution stays in the rollup
    with pytest.raises(ProtocolError) as err:  # and now the upstream is the outsider
        _hello_from(h, UPSTREAM, "upstream-e1")
    assert err.value.code is ErrorCode.IDENTITY_OWNED


def test_expired_upstream_identities_make_room_for_pushed_ranks() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_ranks=2))
    for tp in range(2):
        conn, rank = _hello_from(h, UPSTREAM, f"u{tp}", tp=tp)
        h.state.disconnect(conn, rank)  # the upstream no longer lists it
    with pytest.raises(ProtocolError) as err:
        h.hello(tp=5)
    assert err.value.code is ErrorCode.TOO_MANY_RANKS
    h.clock.advance(30.0)
    _, pushed = h.hello(tp=5)
    assert list(h.state.ranks.values()) == [pushed] and pushed.source == "push"


# --- the memory of forgotten identities, per source (issue 19, review 19, findings 4 and 5) ---


def _expire(h: Harness, conn: object, rank: RankState) -> None:
    """`rank`'s source stops reporting it, and it stays silent past expire_after (30 s here)."""
    h.state.disconnect(conn, rank)
    h.clock.advance(30.0)


def test_one_sources_churn_cannot_flush_anothers_memory_of_a_forgotten_identity() -> None:
    """Upstream A's identity is forgotten to make room while upstream B's identities come and go;
    when A lists it again in the same epoch, its values are baselines, however many B forgot."""
    max_ranks = 2
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_ranks=max_ranks))
    conn, x = _hello_from(h, UPSTREAM, "a-gen0")
    h.push(x, bytes_(1000.0))
    _expire(h, conn, x)
    churned = 3 * max_ranks  # three times what one source remembers: a shared memory of max_ranks forgot X
    for tp in range(1, churned + 1):
        conn_b, rank_b = _hello_from(h, "upstream:b", f"b{tp}", tp=tp)
        h.push(rank_b, bytes_(1.0))
        _expire(h, conn_b, rank_b)
    assert x.identity not in h.state.ranks
    assert len(h.state.registry.forgotten["upstream:b"]) == max_ranks  # each source's memory stays bounded
    assert h.counter(BYTES) == 1000.0 + churned
    _, back = _hello_from(h, UPSTREAM, "a-gen0")
    assert back.resumed and UPSTREAM not in h.state.registry.forgotten
    h.push(back, bytes_(1010.0))  # a baseline: the 1,000 are counted already (the 10 moved while forgotten are not known)
    assert h.counter(BYTES) == 1000.0 + churned
    h.push(back, bytes_(1020.0))
    assert h.counter(BYTES) == 1010.0 + churned  # and from there on every increase counts, once


def test_a_source_remembers_at_most_max_ranks_forgotten_identities_of_its_own() -> None:
    """Same-source churn past max_ranks forgets the oldest (docs/reliability.md says so)."""
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_ranks=1))
    for tp in range(3):
        conn, rank = _hello_from(h, UPSTREAM, f"u{tp}", tp=tp)
        _expire(h, conn, rank)
    _hello_from(h, "upstream:b", "b0", tp=9)  # makes room: forgets tp 2, the last of the upstream's
    assert h.state.registry.forgotten == {UPSTREAM: {(2, 0, 0, 0, STATIC_KEY): "u2"}}


def test_a_takeover_by_another_source_leaves_the_old_owners_return_counted_once() -> None:
    """An upstream's identity expires; a pushed rank takes it, pushes 1 and expires; the upstream
    lists it again in its epoch: its values are baselines, so it adds only its increase."""
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, owner = _hello_from(h, UPSTREAM, "up-gen0")
    h.push(owner, bytes_(1000.0))
    _expire(h, conn, owner)
    conn, pushed = h.hello(epoch="imp")
    assert not pushed.resumed and h.state.registry.forgotten == {UPSTREAM: {owner.identity: "up-gen0"}}
    h.push(pushed, bytes_(1.0))
    assert h.counter(BYTES) == 1001.0
    _expire(h, conn, pushed)
    _, back = _hello_from(h, UPSTREAM, "up-gen0")
    assert back.resumed and back is not owner
    assert h.state.registry.forgotten == {"push": {owner.identity: "imp"}}  # the pushed rank's turn to be remembered
    h.push(back, bytes_(1010.0))
    assert h.counter(BYTES) == 1001.0  # not 2,011: the 1,000 the upstream pushed before count once
    h.push(back, bytes_(1020.0))
    assert h.counter(BYTES) == 1011.0


def test_a_ranks_static_label_values_together_are_held_to_max_static_label_chars(h: Harness) -> None:
    # LMCache under vLLM: model_name and served_model_name are both the model path given to vLLM.
    path = "/models/" + "p" * 1016
    h.hello(labels={"model_name": path, "served_model_name": path, "role": "worker", "worker_id": "0"})
    assert len(h.state.ranks) == 1
    with pytest.raises(ProtocolError) as refused:
        h.hello(labels={"model_name": path, "served_model_name": path, "other": "o" * 1024})
    assert refused.value.code is ErrorCode.INVALID_HELLO
    assert refused.value.message == (
        "static labels: their values have 3072 characters together; at most 2304 are allowed "
        "(ranks.max_static_label_chars): every per-rank line on /metrics carries them")

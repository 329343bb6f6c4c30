"""Silences: Alertmanager-style matchers, states, durability and sharing through the file."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alerting.silences import (
    Matcher,
    MatchOp,
    SilenceState,
    SilenceStore,
    parse_matcher,
    parse_matchers,
)
from core.clock import FakeClock

LABELS = {"alertname": "GpuXid79", "node": "gpu-017", "severity": "critical", "entity": "GPU-1"}


@pytest.mark.parametrize(
    ("text", "hit"),
    [
        ("node=gpu-017", True),
        ('node="gpu-017"', True),
        ("node!=gpu-017", False),
        ("node=~gpu-0.*", True),
        ("node=~gpu", False),  # anchored, as in Alertmanager
        ("node!~gpu-1.*", True),
        ('severity=~"major|critical"', True),
        ("cluster=", True),  # a missing label is the empty string
        ("cluster!=", False),
    ],
)
def test_matchers(text, hit):
    assert parse_matcher(text).matches(LABELS) is hit


def test_selector_and_alertmanager_json_round_trip():
    matchers = parse_matchers(['{node="a,b", severity!~"info|warning"}', "kind=xid"])
    assert [str(m) for m in matchers] == ['node="a,b"', 'severity!~"info|warning"', 'kind="xid"']
    for m in matchers:
        assert Matcher.from_alertmanager(m.to_alertmanager()) == m
    assert matchers[1].to_alertmanager() == {
        "name": "severity", "value": "info|warning", "isRegex": True, "isEqual": False}


@pytest.mark.parametrize("text", ["node", "1node=a", "node=~(", "=a"])
def test_bad_matchers(text):
    with pytest.raises(ValueError):  # noqa: PT011 (the message differs per case)
        parse_matcher(text)


def test_no_matcher_at_all():
    with pytest.raises(ValueError, match="at least one matcher"):
        parse_matchers([" "])


def test_lifecycle_states_and_expire(tmp_path):
    clock = FakeClock(now=1000)
    store = SilenceStore(path=tmp_path / "silences.json", clock=clock)
    now_ = store.add(parse_matchers(["node=gpu-017"]), duration_seconds=3600,
                     created_by="alice", comment="RMA in progress")
    later = store.add(parse_matchers(["node=gpu-018"]), starts_at=2000, ends_at=3000,
                      created_by="bob", comment="maintenance window")
    assert now_.state(clock()) is SilenceState.ACTIVE
    assert later.state(clock()) is SilenceState.PENDING
    assert store.muting(LABELS) == [now_.id]
    assert store.muting({**LABELS, "node": "gpu-018"}) == []
    clock.advance(1500)  # t=2500
    assert store.muting({**LABELS, "node": "gpu-018"}) == [later.id]
    expired = store.expire(now_.id)
    assert expired.state(clock()) is SilenceState.EXPIRED
    assert store.muting(LABELS) == []
    assert [s.id for s in store.list_silences(state=SilenceState.EXPIRED)] == [now_.id]
    with pytest.raises(KeyError):
        store.expire("nope")


def test_file_is_shared_between_processes(tmp_path):
    clock = FakeClock(now=1000)
    api = SilenceStore(path=tmp_path / "s.json", clock=clock)
    cli = SilenceStore(path=tmp_path / "s.json", clock=clock)
    made = cli.add(parse_matchers(["node=gpu-017"]), duration_seconds=60, created_by="cli",
                   comment="from the CLI")
    assert api.get(made.id) == made
    api.expire(made.id)
    assert cli.get(made.id).ends_at == 1000


def test_update_retention_and_validation(tmp_path):
    clock = FakeClock(now=1000)
    store = SilenceStore(path=tmp_path / "s.json", clock=clock, retention_seconds=100)
    s = store.add(parse_matchers(["node=a"]), duration_seconds=10, created_by="x", comment="y")
    updated = store.add(parse_matchers(["node=b"]), duration_seconds=20, created_by="x",
                        comment="y", silence_id=s.id)
    assert updated.id == s.id
    assert [m.value for m in store.get(s.id).matchers] == ["b"]
    clock.advance(500)
    store.add(parse_matchers(["node=c"]), duration_seconds=10, created_by="x", comment="z")
    assert store.get(s.id) is None  # expired longer than the retention ago
    with pytest.raises(ValueError, match="mute every alert"):
        store.add(parse_matchers(["node=~.*"]), duration_seconds=1, created_by="x", comment="y")
    with pytest.raises(ValueError, match="created_by and comment"):
        store.add(parse_matchers(["node=a"]), duration_seconds=1, created_by="", comment="y")
    with pytest.raises(ValueError, match="end after"):
        store.add(parse_matchers(["node=a"]), duration_seconds=0, created_by="x", comment="y")
    with pytest.raises(ValueError, match="no silence"):
        store.add(parse_matchers(["node=a"]), duration_seconds=1, created_by="x", comment="y",
                  silence_id="unknown")


def test_unreadable_file_keeps_last_good_copy(tmp_path, caplog):
    path = tmp_path / "s.json"
    store = SilenceStore(path=path, clock=FakeClock(now=1))
    s = store.add(parse_matchers(["node=a"]), duration_seconds=10, created_by="x", comment="y")
    path.write_text("{not json")
    assert store.get(s.id) == s
    assert "unreadable" in caplog.text


@given(st.text(alphabet="abc-01", min_size=1, max_size=8), st.text(alphabet="abc-01", max_size=8))
def test_equal_and_not_equal_are_complements(value, actual):
    eq = Matcher(name="node", op=MatchOp.EQUAL, value=value)
    ne = Matcher(name="node", op=MatchOp.NOT_EQUAL, value=value)
    assert eq.matches({"node": actual}) != ne.matches({"node": actual})

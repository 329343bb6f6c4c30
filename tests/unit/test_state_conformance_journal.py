"""The input journal on both engines (the conformance suite's backends): SQLite and PostgreSQL.

Two journal objects on one target stand for a restarted process (or a standby on the
same store): what one accepted, the other gives back.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity
from storage.journal import InputJournal, JournalIngest
from tests.unit.test_state_conformance import pg, target  # noqa: F401 - fixtures


def _finding(code: str = "79", node: str = "gpu-01") -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code=code,
                   severity=Severity.CRITICAL, action=Action.REBOOT_NODE, summary="fell off",
                   evidence=(Evidence(file="kern.log", line=3, text="Xid 79"),), source="t",
                   first_seen_at=10.0, last_seen_at=20.0, occurrences=2)


@pytest.fixture
def two(target: str) -> Iterator[tuple[InputJournal, InputJournal]]:  # noqa: F811
    a, b = InputJournal(target), InputJournal(target)
    yield a, b
    a.close()
    b.close()


def test_an_accepted_artifact_comes_back_in_order(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    body = b"\x00\x01 not text\xff"  # bytes as they came, whatever they are
    a.add_ingest(JournalIngest(accepted_at=100.0, node="n1", file="kern.log",
                               facts={"nvlink": "absent"}, body=body))
    a.add_ingest(JournalIngest(accepted_at=200.0, node="n2", file="smi.txt", facts={},
                               body=b"second"))
    back = b.ingests(since=0.0)
    assert [(i.node, i.file, i.body) for i in back] == [("n1", "kern.log", body),
                                                        ("n2", "smi.txt", b"second")]
    assert back[0].facts == {"nvlink": "absent"}
    assert back[0].accepted_at == 100.0
    assert [i.node for i in b.ingests(since=150.0)] == ["n2"]


def test_held_findings_replace_clear_and_expire(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    f = _finding()
    a.hold([(f, 500.0)], at=100.0, source="alertmanager:abc")
    a.hold([(f, 900.0)], at=200.0, source="alertmanager:abc")  # newer replaces older
    a.hold([(_finding("48"), 150.0)], at=100.0)
    ((got, until, source),) = b.held(now=300.0)  # the Xid 48 one expired at 150
    assert (got, until, source) == (f, 900.0, "alertmanager:abc")
    b.clear([f.key])
    assert a.held(now=300.0) == []


def test_prune_drops_old_and_oversized_artifacts(two) -> None:  # type: ignore[no-untyped-def]
    a, b = two
    for i in range(5):
        a.add_ingest(JournalIngest(accepted_at=float(i), node="n", file=f"f{i}", facts={},
                                   body=b"x" * 100))
    assert a.prune(before=1.0) == 1
    assert a.prune(before=0.0, max_bytes=250) == 2  # keeps the newest 200 bytes
    assert [i.file for i in b.ingests(since=0.0)] == ["f3", "f4"]


def test_an_ingest_that_cannot_be_journaled_is_refused_with_503_and_not_applied(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    import errno
    from pathlib import Path

    from alerting.silences import SilenceStore
    from gpuhealth.api import AlertingApi, recover_ingests
    from gpuhealth.pipeline import Pipeline

    case = (Path(__file__).resolve().parents[1] / "fixtures" / "cases"
            / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log").read_bytes()

    class Full(InputJournal):
        def add_ingest(self, ingest: JournalIngest) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    pipeline = Pipeline(facts={}, notifiers=[], audit_log_path=None)
    pipeline.journal = Full(tmp_path / "journal.sqlite")
    api = AlertingApi(pipeline=pipeline, silences=SilenceStore(), token="t")
    auth = {"authorization": "Bearer t"}
    status, answer = api.handle("POST", "/api/v1/ingest?node=n1&file=k.log", auth, case)
    assert status == 503
    assert "retry" in answer["error"]
    assert pipeline.evaluate().findings == []  # nothing applied that is not recorded
    pipeline.journal.close()
    pipeline.journal = InputJournal(tmp_path / "journal.sqlite")
    assert api.handle("POST", "/api/v1/ingest?node=n1&file=k.log", auth, case)[0] == 200
    fresh = Pipeline(facts={}, notifiers=[], audit_log_path=None)  # a restart
    fresh.journal = InputJournal(tmp_path / "journal.sqlite")
    assert recover_ingests(fresh, window_seconds=86400.0) == 1
    assert {f.code for f in fresh.evaluate().findings} >= {"79"}
    for p in (pipeline, fresh):
        p.close()

"""A controller pair's alerting state on one PostgreSQL: the outbox and the history.

Two pipelines built as the controller builds them (``notify_as_standby=False``) share one
outbox in a real PostgreSQL (``tests/pg_server.py``): only the leader queues and
delivers; after a fail-over the new leader delivers what the old one left pending, once.
The leader's history recorder writes the incidents of the shared action store and the
agent registry's GPUs into the shared history, idempotently, and ``gpuhealth report``
reads it from the controller's configuration.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from alerting.testing import RecordingNotifier
from core.clock import FakeClock
from core.errors import NotifierUnavailable
from core.records import ActionPhase, ActionRequest, RemediationStep
from gpuhealth.config import load_settings
from gpuhealth.history_sync import HistoryRecorder
from gpuhealth.pipeline import Pipeline
from gpuhealth.report_cli import report
from remediation.actions import ActionStore, StoredIncident
from storage.fleet import AgentRow
from storage.history import IncidentHistory
from tests.pg_server import Postgres, start_postgres
from tests.unit.test_alerts import make_finding

_numbers = itertools.count()


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    with start_postgres() as server:
        yield server


@pytest.fixture
def dsn(pg: Postgres) -> str:
    import psycopg

    name = f"c_{next(_numbers)}"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"host=127.0.0.1 port={pg.port} user=postgres dbname={name}"


def _replica(dsn: str, notifier: RecordingNotifier, leader: list[bool],
             clock: FakeClock) -> Pipeline:
    return Pipeline(facts={"node": "ctl"}, notifiers=[notifier], audit_log_path=None,
                    outbox_path=dsn, is_leader=lambda: leader[0], notify_as_standby=False,
                    clock=clock)


def test_only_the_leader_delivers_and_the_new_leader_sends_what_is_pending_once(
        dsn: str) -> None:
    a_is, b_is = [True], [False]
    a_rec, b_rec = RecordingNotifier(name="hook"), RecordingNotifier(name="hook")
    clock = FakeClock(now=1000.0)
    a, b = _replica(dsn, a_rec, a_is, clock), _replica(dsn, b_rec, b_is, clock)
    try:
        assert a.outbox.db.dialect == "postgres"
        first, second = make_finding(entity="GPU-1"), make_finding(entity="GPU-2")
        for replica in (a, b):  # every replica consumes the accepted records
            replica.observe_findings([first])
        a_rec.inject_error(NotifierUnavailable("503"), times=None)
        asyncio.run(a.aevaluate())  # queued, not delivered: the receiver is down
        asyncio.run(b.aevaluate())  # the standby neither queues nor delivers
        assert (a_rec.sent, b_rec.sent) == ([], [])
        assert b.outbox.depths() == {"hook": 1}
        # the leader dies; the standby takes over once the receiver is due again
        a_is[0], b_is[0] = False, True
        clock.now += 5.0
        for replica in (a, b):
            replica.observe_findings([second])
        asyncio.run(a.aevaluate())  # no longer leader: it delivers nothing
        asyncio.run(b.aevaluate())
        assert sorted(x.labels["entity"] for x in b_rec.sent) == ["GPU-1", "GPU-2"]
        assert a_rec.sent == []
        assert b.outbox.depths() == {}
        asyncio.run(b.aevaluate())
        assert len(b_rec.sent) == 2  # once
    finally:
        a.close()
        b.close()


def _incident(store: ActionStore, node: str, n: int) -> None:
    incident = f"fp{n}"
    store.open_incident(StoredIncident(
        incident=incident, fingerprint=incident, node=node, entity="GPU-1",  # type: ignore[arg-type]
        kind="xid", code="79", severity="critical", state="open", opened_at=1000.0 + n,
        out_of_service_at=1010.0 + n))
    store.add(ActionRequest(step=RemediationStep.DRAIN, node=node, entity="node",  # type: ignore[arg-type]
                            reason="Xid 79", idempotency_key=f"{incident}/drain",
                            dry_run=False),
              incident=incident, fingerprint=incident, severity="critical",
              phase=ActionPhase.SUCCEEDED, now=1010.0 + n)


def test_the_leaders_history_is_shared_and_the_report_reads_it(dsn: str,
                                                               tmp_path: Path) -> None:
    store = ActionStore(dsn)
    agents = [AgentRow(node=f"gpu-0{i}", version="1", gpus=({"entity": "GPU-1"},),
                       facts={"driver_version": "550.54.15"}, first_seen_at=100.0,
                       last_heartbeat_at=2000.0) for i in range(2)]
    try:
        _incident(store, "gpu-00", 0)
        _incident(store, "gpu-01", 1)
        for _ in range(2):  # the leader, then the standby after a fail-over: same rows
            history = IncidentHistory(dsn)
            recorder = HistoryRecorder(history)
            recorder.observe_agents(agents)
            recorder.sync(store, 2000.0)
            history.close()
    finally:
        store.close()
    with IncidentHistory(dsn) as shared:
        incidents, inventory = shared.incidents(), shared.inventory()
    assert list(incidents["incident_id"]) == ["gpu-00/fp0", "gpu-01/fp1"]
    assert list(incidents.iloc[0]["actions"]) == ["drain"]
    assert len(inventory) == 2
    assert set(inventory["driver_version"]) == {"550.54.15"}
    config = tmp_path / "controller.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n\n'
                      f'[controller]\nstate = "{dsn}"\n')
    assert load_settings(config, env={}).controller.state == dsn
    result = CliRunner().invoke(report, ["--config", str(config), "--since", "0",
                                         "--until", "5000", "--format", "json"])
    assert result.exit_code == 0, result.output
    inputs = json.loads(result.output)["inputs"]
    assert (inputs["incidents_in_window"], inputs["inventory_residencies"]) == (2, 2)
    assert inputs["history"].endswith(dsn.rsplit("dbname=", 1)[1])


def test_the_controller_keeps_its_outbox_and_history_in_the_shared_state(
        dsn: str, tmp_path: Path) -> None:
    from gpuhealth.controller import Controller

    tokens = tmp_path / "tokens"
    tokens.write_text("gpu-01 tok-0123456789abcdef\n")
    config = tmp_path / "controller.toml"
    config.write_text(f'[node]\nname = "ctl-a"\ndata_dir = "{tmp_path / "data"}"\n\n'
                      f'[controller]\nstate = "{dsn}"\nagent_tokens_file = "{tokens}"\n')
    settings = load_settings(config, env={})
    settings.node.data_dir.mkdir(parents=True, exist_ok=True)
    controller = Controller(settings)
    try:
        assert controller.pipeline.outbox.db.dialect == "postgres"
        assert controller.pipeline.actions.db.dialect == "postgres"
        recorder = controller._open_history()
        assert recorder is not None
        assert recorder.history.db.dialect == "postgres"
        recorder.history.close()
    finally:
        controller.pipeline.close()
        controller.store.close()
    assert not (settings.node.data_dir / "outbox.sqlite").exists()


def test_the_weekly_report_is_written_by_the_leader_only(dsn: str, tmp_path: Path) -> None:
    from apscheduler.schedulers.background import (  # type: ignore[import-untyped,unused-ignore]
        BackgroundScheduler,
    )

    from gpuhealth.report_cli import schedule_weekly_report

    IncidentHistory(dsn).close()
    leader = [False]
    job = schedule_weekly_report(BackgroundScheduler(timezone="UTC"), history_path=dsn,
                                 folder=tmp_path / "reports", only_if=lambda: leader[0])
    assert job.func(**job.kwargs) is None  # the standby skips it
    assert not (tmp_path / "reports").exists()
    leader[0] = True
    written = job.func(**job.kwargs)
    assert written is not None
    assert [Path(f).suffix for f in written["files"]] == [".html", ".json"]

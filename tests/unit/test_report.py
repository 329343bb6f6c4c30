"""The reliability report: figures, the three formats, the CLI and the weekly job."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dashboards.report import (
    SCHEMA,
    SECTIONS,
    ReportOptions,
    build_report,
    render,
    render_html,
    render_markdown,
    summary,
)
from gpuhealth.report_cli import (
    report,
    report_options,
    schedule_weekly_report,
    write_weekly_report,
)
from storage.history import IncidentHistory, IncidentRecord, InventoryRecord, PredictionRecord
from tests.servers import webhook_receiver

H = 3600.0
FIXTURES = Path(__file__).parents[1] / "fixtures" / "history"
NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC).timestamp()
WEEK_START = NOW - 7 * 24 * H


def _incident(incident_id: str, node: str, entity: str, detected: float, back: float | None,
              cause: str, code: str, **kw: object) -> IncidentRecord:
    return IncidentRecord(incident_id=incident_id, node=node, entity=entity, kind="xid",
                          code=code, severity="critical", cause=cause, detected_at=detected,
                          out_of_service_at=detected, back_in_service_at=back,
                          resolved_at=back, **kw)  # type: ignore[arg-type]


def _gpu(entity: str, node: str, driver: str, first: float) -> InventoryRecord:
    return InventoryRecord(entity=entity, node=node, model="NVIDIA H100 80GB HBM3",
                           driver_version=driver, vbios_version="96.00.74.00.01",
                           slot=f"{node}:0000:1b:00.0", first_seen_at=first,
                           last_seen_at=NOW, removed_at=None)


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """A small fleet run by gpuhealth: 8 GPUs on 2 nodes, two driver versions, a week of
    incidents in the report window and one in the week before."""
    path = tmp_path / "history.sqlite"
    store = IncidentHistory(path)
    start = NOW - 30 * 24 * H
    gpus = [_gpu(f"GPU-{n}{i}", f"node{n}", "550.54.15" if n == 1 else "535.161.08", start)
            for n in (1, 2) for i in range(4)]
    store.upsert_inventory(gpus)
    store.upsert_incidents([
        _incident("w1", "node1", "GPU-10", WEEK_START + 10 * H, WEEK_START + 14 * H,
                  "memory", "48", actions=("drain", "reset"), attrs={"approval": "approved"},
                  driver_version="550.54.15"),
        _incident("w2", "node1", "GPU-10", WEEK_START + 50 * H, WEEK_START + 52 * H,
                  "memory", "94", actions=("drain",), attrs={"budget_blocked": "true"}),
        _incident("w3", "node2", "GPU-21", WEEK_START + 90 * H, None, "gpu_lost", "79"),
        _incident("prev", "node2", "GPU-22", WEEK_START - 20 * H, WEEK_START - 19 * H,
                  "nvlink", "74"),
    ])
    store.record_predictions([
        PredictionRecord(entity="GPU-10", node="node1", at=WEEK_START + 5 * H,
                         probability=0.9, horizon_seconds=24 * H,
                         top_features={"ecc_sbe_rate": 0.7}),
    ])
    store.close()
    return path


def _build(path: Path, **kw: object) -> dict[str, Any]:
    options = ReportOptions(since=WEEK_START, until=NOW, **kw)  # type: ignore[arg-type]
    with IncidentHistory(path) as store:
        return build_report(store, options, now=lambda: NOW, history_path=str(path))


def test_report_sections_and_figures(history: Path) -> None:
    figures = _build(history)
    assert figures["schema"] == SCHEMA
    assert list(figures["sections"]) == [key for key, _ in SECTIONS]
    s = figures["sections"]
    assert s["mtbf"]["fleet"]["failures"] == 3
    assert s["mtbf"]["fleet"]["exposure_hours"] == pytest.approx(8 * 168)
    assert s["mtbf"]["fleet"]["mtbf_hours"] == pytest.approx(8 * 168 / 3)
    assert s["availability"]["lost_hours"] == pytest.approx(4 + 2 + 78)
    assert s["availability"]["availability"] == pytest.approx(1 - 84 / (8 * 168))
    assert s["mttr"]["repaired"] == 2
    assert s["mttr"]["median_hours"] == pytest.approx(3.0)
    assert s["causes"]["by_cause"]["memory"] == 2
    assert s["causes"]["by_cause"]["gpu_lost"] == 1
    assert s["causes"]["period"] == "day"
    assert s["causes"]["by_xid"] == {"48": 1, "79": 1, "94": 1}
    assert s["repeat_offenders"]["entities"][0]["key"] == "node1/GPU-10"
    drivers = {r["group"]: r for r in s["mtbf"]["by_driver_version"]}
    assert drivers["550.54.15"]["failures"] == 2
    assert drivers["535.161.08"]["failures"] == 1
    cohort = s["cohorts"]["comparisons"][0]
    assert cohort["by"] == "driver_version"
    # Both first seen together: the higher version is taken as the one being rolled out.
    assert (cohort["candidate"], cohort["baseline"]) == ("550.54.15", "535.161.08")
    assert s["predictions"]["hits"] == 1
    assert s["predictions"]["recall"] == pytest.approx(1 / 3)
    assert s["predictions"]["lead_time_median_hours"] == pytest.approx(5.0)
    assert s["remediation"]["actions"] == {"drain": 2, "reset": 1}
    assert s["remediation"]["approvals"] == {"approved": 1}
    assert s["remediation"]["budget_blocked"] == 1
    node_mtbf = s["checkpointing"]["node_mtbf_hours"]
    assert node_mtbf == pytest.approx(2 * 168 / 3)
    first = s["checkpointing"]["rows"][0]
    assert first["young_minutes"] == pytest.approx((2 * 300 * node_mtbf * H) ** 0.5 / 60)
    assert s["spare_capacity"]["peak_out"] == 1
    assert s["spare_capacity"]["fits"] is True
    wow = {r["figure"]: r for r in s["week_over_week"]["rows"]}
    assert wow["failures"]["previous"] == 1
    assert wow["failures"]["current"] == 3
    assert figures["inputs"]["incidents_in_window"] == 3


def test_report_says_what_is_missing_instead_of_inventing(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    IncidentHistory(path).close()
    figures = _build(path)
    s = figures["sections"]
    assert s["predictions"]["note"] == "no predictions recorded in this window"
    assert s["predictions"]["precision"] is None
    assert s["mttr"]["note"] == "no failure in this window"
    assert "note" in s["cohorts"]
    assert "note" in s["checkpointing"]
    assert s["availability"]["availability"] is None
    assert any("No predictions" in c for c in figures["caveats"])
    text = render_markdown(figures)
    assert "no predictions recorded in this window" in text
    assert "n/a" in text


def test_json_is_stable_and_complete(history: Path) -> None:
    figures = _build(history)
    text = render(figures, "json")
    assert text == render(_build(history), "json")  # deterministic with a fixed clock
    parsed = json.loads(text)
    assert parsed["sections"]["mtbf"]["fleet"]["failures"] == 3
    assert "NaN" not in text


def test_html_is_self_contained_with_plots(history: Path) -> None:
    page = render_html(_build(history))
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "<link" not in page.lower()
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) >= 2
    for _key, title in SECTIONS:
        assert title in page
    assert "Caveats" in page
    assert "Inputs" in page


def test_markdown_has_every_section(history: Path) -> None:
    text = render_markdown(_build(history))
    for _key, title in SECTIONS:
        assert f"## {title}" in text
    assert "| 550.54.15 |" in text


def test_options_parse_windows() -> None:
    options = report_options("7d", "now", None, 0.2, now=NOW)
    assert (options.since, options.until) == (NOW - 7 * 86400, NOW)
    options = report_options("all", "now", "titan", 0.15, now=NOW)
    assert (options.since, options.until, options.source) == (None, None, "titan")
    with pytest.raises(ValueError, match="must be after"):
        report_options("1d", "2d", None, 0.15, now=NOW)
    with pytest.raises(ValueError, match="spare_fraction"):
        ReportOptions(spare_fraction=1.5)
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        ReportOptions(timezone="Mars/Olympus")


def test_cli_import_and_report(tmp_path: Path) -> None:
    runner = CliRunner()
    db = tmp_path / "h.sqlite"
    result = runner.invoke(report, ["import", "titan", str(FIXTURES / "titan"),
                                    "--history", str(db)])
    assert result.exit_code == 0, result.output
    counts = json.loads(result.output)
    assert (counts["incidents"], counts["inventory"]) == (3, 6)
    result = runner.invoke(report, ["import", "lanl", str(FIXTURES / "lanl"),
                                    "--history", str(db)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "r.json"
    result = runner.invoke(report, ["--since", "all", "--source", "titan", "--format", "json",
                                    "-o", str(out), "--history", str(db)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["sections"]["mtbf"]["fleet"]["failures"] == 3
    assert figures["inputs"]["source"] == "titan"
    batches = {r["group"]: r["failures"] for r in figures["sections"]["mtbf"]["by_batch"]}
    assert batches == {"old": 3, "new": 0}
    lemons = figures["sections"]["repeat_offenders"]["lemon_slots"]
    assert [(x["slot"], x["entities"]) for x in lemons] == [("c0-0c0s1n0", 2)]
    # Slot c0-0c0s1n0 was refilled a day after each failure; c0-0c0s2n1 never was.
    assert figures["sections"]["mttr"]["median_hours"] == pytest.approx(24.0)
    assert figures["sections"]["mttr"]["unrepaired"] == 1
    assert figures["sections"]["availability"]["retired_after_failure"] == 1  # the OTB GPU
    result = runner.invoke(report, ["--since", "all", "--format", "md", "--history", str(db),
                                    "--spare-fraction", "0.2"])
    assert result.exit_code == 0, result.output
    assert "# GPU fleet reliability report" in result.output
    assert "20.0%" in result.output


def test_cli_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(report, ["--history", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 1
    assert "no incident history" in result.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "gc_full.csv").write_text("SN,location\n")
    result = runner.invoke(report, ["import", "titan", str(bad), "--history",
                                    str(tmp_path / "h.sqlite")])
    assert result.exit_code == 1
    assert "gc_full.csv:1: missing column" in result.output
    result = runner.invoke(report, ["--since", "yesterday-ish", "--history",
                                    str(tmp_path / "h.sqlite")])
    assert result.exit_code == 2


def test_weekly_job_writes_files_and_posts_the_summary(history: Path, tmp_path: Path) -> None:
    """The webhook is a loopback HTTP server recording the POST (tests/servers.py)."""
    folder = tmp_path / "reports"
    with webhook_receiver() as hook:
        result = write_weekly_report(history_path=history, folder=folder,
                                     webhook_url=hook.url + "/report", clock=lambda: NOW,
                                     link_base="https://reports.example/gpu")
        assert result["delivered"] is True
        body = hook.on("/report")[0].json()
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["reliability-20261130T060000Z.html", "reliability-20261130T060000Z.json"]
    assert body["summary"]["failures"] == 3
    assert body["files"] == [str(folder / n) for n in names]
    assert body["links"][0] == "https://reports.example/gpu/reliability-20261130T060000Z.html"
    assert "3 failures" in body["text"]
    saved = json.loads((folder / names[1]).read_text())
    assert summary(saved) == body["summary"]


def test_weekly_job_survives_a_failing_webhook(history: Path, tmp_path: Path) -> None:
    with webhook_receiver() as hook:
        hook.respond = lambda path, headers, body: 503
        result = write_weekly_report(history_path=history, folder=tmp_path / "r",
                                     webhook_url=hook.url, clock=lambda: NOW, formats=("md",))
    assert result["delivered"] is False
    assert Path(result["files"][0]).read_text().startswith("# GPU fleet reliability report")


def test_schedule_weekly_report_adds_a_cron_job(tmp_path: Path) -> None:
    from apscheduler.schedulers.background import (  # type: ignore[import-untyped,unused-ignore]
        BackgroundScheduler,
    )

    scheduler = BackgroundScheduler(timezone="UTC")
    job = schedule_weekly_report(scheduler, history_path=tmp_path / "h.sqlite",
                                 folder=tmp_path / "r", webhook_url=None, weekday="Tuesday",
                                 at="07:30", timezone="Europe/Paris")
    fire = job.trigger.get_next_fire_time(None, datetime(2026, 11, 30, 0, 0, tzinfo=UTC))
    # Tuesday 1 December 2026, 07:30 in Paris (CET, UTC+1) is 06:30 UTC.
    assert fire.astimezone(UTC) == datetime(2026, 12, 1, 6, 30, tzinfo=UTC)
    assert job.id == "gpuhealth-weekly-report"
    again = schedule_weekly_report(scheduler, history_path=tmp_path / "h.sqlite",
                                   folder=tmp_path / "r", weekday="mon")
    assert again.id == job.id
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="weekday"):
        schedule_weekly_report(scheduler, history_path="h", folder="r", weekday="funday")
    with pytest.raises(ConfigError, match="HH:MM"):
        schedule_weekly_report(scheduler, history_path="h", folder="r", at="25:00")


def test_dry_run_actions_are_labelled_never_counted_as_done(tmp_path: Path) -> None:
    from dashboards.report import render_markdown

    path = tmp_path / "history.sqlite"
    store = IncidentHistory(path)
    store.upsert_inventory([_gpu("GPU-10", "node1", "550.54.15", NOW - 30 * 24 * H)])
    store.upsert_incidents([
        _incident("d1", "node1", "GPU-10", WEEK_START + 10 * H, None, "gpu_lost", "79",
                  actions=("cordon", "drain", "reboot"), attrs={"dry_run": "true"}),
        _incident("l1", "node1", "GPU-10", WEEK_START + 60 * H, WEEK_START + 62 * H,
                  "memory", "48", actions=("drain",)),
    ])
    store.close()
    figures = _build(path)
    rm = figures["sections"]["remediation"]
    assert rm["actions"] == {"drain": 1}  # the old report said reboot 1: a reader believed it
    assert rm["dry_run_actions"] == {"cordon": 1, "drain": 1, "reboot": 1}
    assert rm["incidents_with_dry_run_actions"] == 1
    text = render_markdown(figures)
    assert "Dry-run actions (recorded, not carried out)" in text
    assert "nothing was done to the nodes" in text

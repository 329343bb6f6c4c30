"""``gpuhealth report``: the reliability report, history imports and the weekly schedule.

Commands (registered in :mod:`gpuhealth.cli` with ``main.add_command(report)``):

* ``gpuhealth report [--since 7d|all|ISO] [--until now|ISO] [--format html|md|json]
  [--output PATH] [--history PATH] [--source titan|lanl|gpuhealth]
  [--spare-fraction 0.15]``: compute the report over the window and write it.
* ``gpuhealth report import titan|lanl PATH --history PATH``: import published failure
  records into the incident history (prints the counts, skipped rows by reason).

Exit statuses of both (BSD sysexits where one fits): 0 written, 1 no history at the path
(or a store error, or malformed import rows), 64 usage error (a bad option or time), 66
the history cannot be read as one (not a database, a folder, no permission), 73 the
output file cannot be created (its folder cannot be made, no permission), 74 writing it
failed (disk full), 78 a bad settings file.

``--history`` takes a history file or a PostgreSQL DSN (a controller pair's shared state,
where the leader records the history). It defaults to ``[report] history`` of the
settings file (``--config`` / ``GPUHEALTH_CONFIG``), else ``[controller] state`` when
that is PostgreSQL, else ``<[node] data_dir>/history.sqlite``.

:func:`schedule_weekly_report` adds the weekly job to an apscheduler 3.x scheduler: it
writes the report into a folder and POSTs a JSON summary with the file paths to a webhook.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import click
import httpx

from core.errors import ArtifactError, ConfigError, GpuHealthError
from dashboards.report import Format, ReportOptions, build_report, render, summary
from storage.history import IncidentHistory
from storage.sql import is_postgres, server_of

logger = logging.getLogger(__name__)

HISTORY_FILE = "history.sqlite"
"""File name of the incident history inside ``[node] data_dir``."""

EXIT_NOINPUT, EXIT_CANTCREAT, EXIT_IOERR, EXIT_CONFIG = 66, 73, 74, 78
"""``report`` exit statuses (BSD sysexits): the history cannot be read as one, the output
file cannot be created, writing it failed, a bad settings file."""

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
"""Day names apscheduler's cron trigger takes."""


def _history_path(history: str | None, config_path: str | None) -> Path | str:
    """Return the history to read (a DSN stays a string).

    ``--history``, else ``[report] history``, else a PostgreSQL ``[controller] state``,
    else ``<data_dir>/history.sqlite``.
    """
    if history:
        return history if is_postgres(history) else Path(history)
    from gpuhealth.config import load_settings

    settings = load_settings(config_path)
    section = getattr(settings, "report", None)
    configured = getattr(section, "history", None) if section is not None else None
    if configured:
        return Path(configured)
    controller = getattr(settings, "controller", None)
    state = getattr(controller, "state", None) if controller is not None else None
    if state and is_postgres(str(state)):
        return str(state)
    return settings.node.data_dir / HISTORY_FILE


def _shown(path: Path | str) -> str:
    """The history for messages and the report's inputs (a server, never a password)."""
    return server_of(path) if isinstance(path, str) and is_postgres(path) else str(path)


def _spare_default(config_path: str | None) -> float:
    if config_path is None:
        return 0.15
    from gpuhealth.config import load_settings

    section = getattr(load_settings(config_path), "report", None)
    value = getattr(section, "spare_fraction", None) if section is not None else None
    return float(value) if value is not None else 0.15


def _job_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated node counts, got {text!r}",
                                 param_hint="--job-sizes") from None
    if not sizes or any(n < 1 for n in sizes):
        raise click.BadParameter("job sizes must be >= 1", param_hint="--job-sizes")
    return sizes


def report_options(since: str, until: str | None, source: str | None,
                   spare_fraction: float, *, now: float, **extra: Any) -> ReportOptions:
    """Turn command-line window strings into :class:`ReportOptions`.

    Args:
        since: ``all`` (the whole history), epoch seconds, ISO 8601, or a duration before
            ``now`` (``7d``).
        until: ``None``/``now``, or the same forms as ``since`` (not ``all``).
        source: Only this source, or ``None``.
        spare_fraction: Spare capacity, 0-1.
        now: The current time (epoch s).
        extra: Further :class:`ReportOptions` fields.

    Raises:
        ValueError: An unreadable time or an empty window.
    """
    from storage import parse_when

    since_at = None if since.strip() == "all" else parse_when(since, now=now)
    if until is None or until.strip() == "now":
        until_at = None if since_at is None else now
    else:
        until_at = parse_when(until, now=now)
    if since_at is not None and until_at is not None and until_at <= since_at:
        raise ValueError(f"--until ({until}) must be after --since ({since})")
    return ReportOptions(since=since_at, until=until_at, source=source,
                         spare_fraction=spare_fraction, **extra)


@click.group("report", invoke_without_command=True)
@click.option("--since", default="7d", show_default=True,
              help="Window start: 'all', epoch seconds, ISO 8601, or 7d/24h ago.")
@click.option("--until", default="now", show_default=True, help="Window end, same forms.")
@click.option("--format", "fmt", type=click.Choice(["html", "md", "json"]), default="html",
              show_default=True, help="Output format.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="-",
              help="File to write (default stdout).")
@click.option("--history", default=None,
              help="Incident history file or PostgreSQL DSN (default [report] history, a "
                   "PostgreSQL [controller] state, else <data_dir>/history.sqlite).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file (data_dir, [report]).")
@click.option("--source", default=None, help="Only this source: gpuhealth, titan, lanl...")
@click.option("--spare-fraction", type=click.FloatRange(0, 1), default=None,
              help="Spare capacity as a fraction of the fleet [default: 0.15].")
@click.option("--timezone", default="UTC", show_default=True,
              help="IANA zone for calendar periods in the report.")
@click.option("--checkpoint-seconds", type=click.FloatRange(min=0, min_open=True),
              default=300.0, show_default=True, help="Time to write one checkpoint.")
@click.option("--job-sizes", default="1,8,64,512,4096", show_default=True,
              help="Job sizes (nodes) for the checkpoint table.")
@click.pass_context
def report(ctx: click.Context, since: str, until: str, fmt: str, output: str,
           history: str | None, config_path: str | None, source: str | None,
           spare_fraction: float | None, timezone: str, checkpoint_seconds: float,
           job_sizes: str) -> None:
    """Write the reliability report for a window (or import history: report import)."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        path = _history_path(history, config_path)
        spare = spare_fraction if spare_fraction is not None else _spare_default(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        options = report_options(since, until, source, spare, now=time.time(),
                                 timezone=timezone, checkpoint_seconds=checkpoint_seconds,
                                 job_sizes=_job_sizes(job_sizes))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if isinstance(path, Path) and not path.exists():
        click.echo(f"error: no incident history at {path} (run 'gpuhealth run', or "
                   "'gpuhealth report import', first)", err=True)
        sys.exit(1)
    try:
        with IncidentHistory(path) as store:
            figures = build_report(store, options, history_path=store.where)
    except GpuHealthError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except (sqlite3.DatabaseError, OSError) as exc:
        click.echo(f"error: {_shown(path)} cannot be read as an incident history: {exc}",
                   err=True)
        sys.exit(EXIT_NOINPUT)
    text = render(figures, cast(Format, fmt))
    if output == "-":
        click.echo(text, nl=False)
        return
    _write_output(Path(output), text)
    click.echo(f"wrote {output}", err=True)


def _write_output(target: Path, text: str) -> None:
    """Write the report to ``target``; exit 73 if it cannot be created, 74 if writing fails."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = target.open("w", encoding="utf-8")
    except OSError as exc:
        click.echo(f"error: cannot create {target}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_CANTCREAT)
    try:
        with handle:
            handle.write(text)
    except OSError as exc:
        click.echo(f"error: cannot write {target}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_IOERR)


@report.command("import")
@click.argument("kind", type=click.Choice(["titan", "lanl"]))
@click.argument("path", type=click.Path(exists=True))
@click.option("--history", default=None,
              help="Incident history file or PostgreSQL DSN (default as for report).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file (data_dir).")
@click.option("--lenient", is_flag=True,
              help="Skip and count malformed rows instead of stopping at the first one.")
def import_history(kind: str, path: str, history: str | None, config_path: str | None,
                   lenient: bool) -> None:
    """Import Titan GPU lifetimes or LANL failure records into the incident history."""
    from storage.importers import import_lanl, import_titan

    try:
        target = _history_path(history, config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    importer = import_titan if kind == "titan" else import_lanl
    try:
        result = importer(path, strict=not lenient)
    except ArtifactError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    try:
        with IncidentHistory(target) as store:
            store.upsert_inventory(result.inventory)
            store.upsert_incidents(result.incidents)
    except GpuHealthError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except (sqlite3.DatabaseError, OSError) as exc:
        click.echo(f"error: {_shown(target)} cannot be read as an incident history: {exc}",
                   err=True)
        sys.exit(EXIT_NOINPUT)
    click.echo(json.dumps({**result.summary(), "history": _shown(target)}, indent=2,
                          sort_keys=True))


Poster = Callable[[str, dict[str, Any]], None]
"""Send a JSON body to a URL; raises on failure."""


def _post(url: str, body: dict[str, Any]) -> None:
    response = httpx.post(url, json=body, timeout=10.0)
    response.raise_for_status()


def write_weekly_report(*, history_path: str | Path, folder: str | Path,
                        webhook_url: str | None = None, period_seconds: float = 7 * 86400.0,
                        formats: Sequence[str] = ("html", "json"), source: str | None = None,
                        spare_fraction: float = 0.15, link_base: str | None = None,
                        clock: Callable[[], float] = time.time,
                        post: Poster = _post) -> dict[str, Any]:
    """Write the report of the last ``period_seconds`` into ``folder`` and notify a webhook.

    Files are named ``reliability-<UTC end stamp>.<ext>``. The webhook receives
    ``{"text": ..., "summary": {...}, "files": [...], "links": [...]}`` (links when
    ``link_base`` is set: ``<link_base>/<file name>``). A failing webhook is logged, not
    raised: the files are written either way and the next week tries again.

    Returns:
        ``{"files": [...], "summary": {...}, "delivered": bool | None}`` (``None``: no
        webhook configured).
    """
    now = clock()
    options = ReportOptions(since=now - period_seconds, until=now, source=source,
                            spare_fraction=spare_fraction)
    with IncidentHistory(history_path) as store:
        figures = build_report(store, options, now=lambda: now, history_path=store.where)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")
    files: list[str] = []
    for fmt in formats:
        ext = {"html": "html", "md": "md", "json": "json"}[fmt]
        path = out / f"reliability-{stamp}.{ext}"
        path.write_text(render(figures, cast(Format, fmt)), encoding="utf-8")
        files.append(str(path))
    head = summary(figures)
    delivered: bool | None = None
    if webhook_url:
        links = [f"{link_base.rstrip('/')}/{Path(f).name}" for f in files] if link_base else []
        availability = head["availability"]
        text = (f"Weekly GPU reliability report {head['window_start']} to "
                f"{head['window_end']}: {head['failures']} failures, availability "
                + ("n/a" if availability is None else f"{availability * 100:.3f}%")
                + f", {head['interrupted_jobs']} jobs hit "
                f"({head['gpu_hours_of_jobs_hit']:,.1f} GPU-hours)")
        try:
            post(webhook_url, {"text": text, "summary": head, "files": files, "links": links})
            delivered = True
        except (httpx.HTTPError, OSError) as exc:
            logger.warning("weekly report webhook %s failed: %s", webhook_url, exc)
            delivered = False
    logger.info("weekly report written: %s", ", ".join(files))
    return {"files": files, "summary": head, "delivered": delivered}


def write_weekly_report_if(only_if: Callable[[], bool], **kwargs: Any) -> dict[str, Any] | None:
    """Write the weekly report (:func:`write_weekly_report`) if ``only_if()`` says so.

    A controller pair schedules the job on both replicas and only the leader writes it.

    Returns:
        What :func:`write_weekly_report` returns, or ``None`` when skipped.
    """
    if not only_if():
        logger.info("weekly report: not the leader; the leader writes it")
        return None
    return write_weekly_report(**kwargs)


def schedule_weekly_report(scheduler: Any, *, history_path: str | Path, folder: str | Path,
                           webhook_url: str | None = None, weekday: str = "mon",
                           at: str = "06:00", timezone: str = "UTC",
                           spare_fraction: float = 0.15, source: str | None = None,
                           formats: Sequence[str] = ("html", "json"),
                           link_base: str | None = None,
                           only_if: Callable[[], bool] | None = None) -> Any:
    """Add the weekly report job to an apscheduler 3.x scheduler.

    Args:
        scheduler: An apscheduler ``BaseScheduler`` (``BackgroundScheduler`` in the service).
        history_path: The incident history file or PostgreSQL DSN.
        folder: Where the reports are written.
        webhook_url: Where the JSON summary is POSTed, or ``None``.
        weekday: ``mon`` ... ``sun``.
        at: ``HH:MM`` (24 h) in ``timezone``.
        timezone: IANA zone of ``at``.
        spare_fraction: Spare capacity, 0-1.
        source: Only this source, or ``None``.
        formats: Formats written (``html``, ``md``, ``json``).
        link_base: URL prefix under which ``folder`` is served, for the webhook's links.
        only_if: Asked when the job fires; the report is written only if it returns true
            (a controller's ``is_leader``). ``None``: always.

    Returns:
        The apscheduler ``Job`` (id ``gpuhealth-weekly-report``; added again, it replaces).

    Raises:
        ConfigError: A bad weekday, time, zone or format.
    """
    from apscheduler.triggers.cron import (  # type: ignore[import-untyped,unused-ignore]
        CronTrigger,
    )

    day = weekday.strip().lower()[:3]
    if day not in WEEKDAYS:
        raise ConfigError(f"[report] weekday: {weekday!r} is not one of {', '.join(WEEKDAYS)}")
    hour_text, _, minute_text = at.partition(":")
    if not (hour_text.isdigit() and minute_text.isdigit()
            and 0 <= int(hour_text) < 24 and 0 <= int(minute_text) < 60):
        raise ConfigError(f"[report] time: {at!r} is not HH:MM (24 h)")
    hour, minute = int(hour_text), int(minute_text)
    bad = [f for f in formats if f not in ("html", "md", "json")]
    if bad:
        raise ConfigError(f"[report] formats: {', '.join(bad)} (use html, md, json)")
    try:
        trigger = CronTrigger(day_of_week=day, hour=hour, minute=minute, timezone=timezone)
    except Exception as exc:  # apscheduler raises plain ValueError/ZoneInfo errors here
        raise ConfigError(f"[report] timezone: {timezone!r}: {exc}") from exc
    kwargs: dict[str, Any] = {
        "history_path": str(history_path), "folder": str(folder), "webhook_url": webhook_url,
        "formats": tuple(formats), "source": source, "spare_fraction": spare_fraction,
        "link_base": link_base}
    job: Callable[..., Any] = write_weekly_report
    if only_if is not None:
        job, kwargs = write_weekly_report_if, {"only_if": only_if, **kwargs}
    return scheduler.add_job(
        job, trigger, id="gpuhealth-weekly-report", replace_existing=True,
        name="gpuhealth weekly reliability report", misfire_grace_time=3600, coalesce=True,
        kwargs=kwargs)

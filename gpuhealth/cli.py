"""The ``gpuhealth`` console script: a thin click group over library functions.

Commands only parse arguments, load settings and call a library function
(style.md C.3.18); every behaviour is reachable, and tested, without the CLI.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, NoReturn, cast

import click

from core import logs
from core.errors import ConfigError, GpuHealthError
from core.plugins import GROUPS, available
from core.protocols import Closeable

logger = logging.getLogger(__name__)

EXIT_USAGE = 64
"""Exit status for usage errors (BSD sysexits EX_USAGE, as fault-model.md asks)."""

EXIT_CONFIG = 78
"""Exit status of ``run`` for an invalid configuration (BSD sysexits EX_CONFIG)."""

EXIT_IOERR = 74
"""Exit status when the output cannot be written (BSD sysexits EX_IOERR): a full disk or a
closed pipe is not a finding's severity (0-4)."""


def _output_failed(exc: OSError, what: str = "the output") -> NoReturn:
    """Say that ``what`` could not be written and exit with :data:`EXIT_IOERR`.

    Standard output is pointed at ``/dev/null`` first, so the interpreter's own flush at
    exit does not fail a second time (the ``BrokenPipeError`` recipe of Python's
    ``signal`` documentation).
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    where = exc.filename or what
    click.echo(f"error: cannot write {where}: {exc.strerror or exc}", err=True)
    sys.exit(EXIT_IOERR)


def _parse_context(values: tuple[str, ...]) -> dict[str, str]:
    from analytics.fault_model import check_facts

    facts: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--context")
        facts[key.strip()] = value.strip()
    problems = check_facts(facts)
    if problems:
        raise click.BadParameter("; ".join(problems), param_hint="--context")
    return facts


class _Group(click.Group):
    """A click group whose usage errors exit with 64 (EX_USAGE) instead of click's 2.

    Commands defined in their own modules are named in :attr:`lazy` and imported when
    they are invoked (or listed by ``--help``): ``gpuhealth --version`` or ``diagnose``
    does not pay for the report's pandas and scipy (issue #14 item 6).
    """

    lazy: dict[str, str] = {}  # noqa: RUF012 (set once, below)
    """Command name -> ``module:attribute`` of its click command."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = super().get_command(ctx, cmd_name)
        if found is None and cmd_name in self.lazy:
            import importlib

            module, _, attribute = self.lazy[cmd_name].partition(":")
            found = cast(click.Command, getattr(importlib.import_module(module), attribute))
            self.add_command(found, cmd_name)
        return found

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            setattr(exc, "exit_code", EXIT_USAGE)  # noqa: B010 (a ClassVar on click's class)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            setattr(exc, "exit_code", EXIT_USAGE)  # noqa: B010 (a ClassVar on click's class)
            raise


@click.group(cls=_Group)
@click.version_option(package_name="gpuhealth", prog_name="gpuhealth")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on standard error.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Log line format on standard error.")
def main(verbose: int, quiet: bool, log_format: str) -> None:
    """Gpuhealth: GPU fleet health, diagnosis and remediation."""
    if quiet:
        level = logging.ERROR
    elif verbose:
        level = logging.DEBUG if verbose > 1 else logging.INFO
    else:
        level = logging.WARNING
    logs.configure(level, log_format)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(readable=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract of fault-model.md.")
@click.option("--context", "context", multiple=True, metavar="KEY=VALUE",
              help="Machine facts not in the files, e.g. nvlink=absent (repeatable).")
def diagnose(paths: tuple[str, ...], as_json: bool, context: tuple[str, ...]) -> None:
    """Diagnose pasted artifacts: kernel logs, nvidia-smi, DCGM, NCCL, InfiniBand output.

    Folders are walked with bounds (docs/fault-model.md, "Folders"): hidden, code and
    virtual-environment folders, links, binary and non-log files are skipped, a file over
    64 MiB is read from its tail, at most 10,000 files; one line on stderr says what was
    left out.

    Exit status: 0 worst is info, 1 warning, 2 major, 3 critical, 4 nothing could
    be parsed, 64 usage error, 74 the output could not be written.
    """
    from gpuhealth.diagnose import diagnose as run_diagnose

    result = run_diagnose(list(paths), _parse_context(context), now=time.time())
    try:
        _print_diagnosis(result, as_json)
    except OSError as exc:
        _output_failed(exc)
    if summary := result.walk.summary():  # what a folder's walk left out, in one line
        click.echo(f"note: {summary}", err=True)
    sys.exit(result.exit_status)


def _print_diagnosis(result: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        for f in result.findings:
            click.echo(f"{f.severity.value.upper():8} {f.action.value:16} {f.node} {f.entity} "
                       f"[{f.kind} {f.code}] {f.summary}")
            for e in f.evidence[:6]:
                click.echo(f"    {e.file}:{e.line}: {e.text.strip()[:160]}")
        if not result.findings and not result.parsed_anything:
            click.echo("nothing could be read: no diagnosis"
                       + (" (see the errors)" if result.issues else
                          " (nothing in the input is a log or tool output gpuhealth knows)"))
        elif not result.findings:
            click.echo("no findings: worst severity info, action none")
        else:
            actions = ", ".join(a.value for a in result.worst_actions)
            click.echo(f"worst: {result.worst_severity.value}; action: {actions}")
        for issue in result.issues:
            where = f"{issue.file}:{issue.line}" if issue.line is not None else issue.file
            click.echo(f"error: {where}: {issue.reason}", err=True)
    sys.stdout.flush()  # a full disk fails here, inside the caller's try


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file (default: embedded defaults).")
@click.pass_context
def run(ctx: click.Context, config_path: str | None) -> None:
    """Run the service: collect, store, analyse, alert and plan remediation (dry-run).

    Stops cleanly on SIGTERM or Ctrl-C after writing everything buffered. Exit
    status 0 on a clean stop, 1 when start-up fails, 78 for an invalid configuration.
    """
    from gpuhealth.config import load_settings
    from gpuhealth.service import run as run_service

    if not ctx.find_root().params.get("quiet") and logging.getLogger().level > logging.INFO:
        logging.getLogger().setLevel(logging.INFO)  # a service says where its data goes
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    sys.exit(run_service(settings))


def _service_settings(ctx: click.Context, config_path: str | None) -> Any:
    from gpuhealth.config import load_settings

    if not ctx.find_root().params.get("quiet") and logging.getLogger().level > logging.INFO:
        logging.getLogger().setLevel(logging.INFO)  # a service says where its data goes
    try:
        return load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file ([agent] names the "
              "controllers and the token).")
@click.pass_context
def agent(ctx: click.Context, config_path: str | None) -> None:
    """Run the node agent of a fleet: collect, judge and detect here, report to the controllers.

    Findings go to the [agent] controllers through a durable outbox (nothing is lost
    while they are away); samples go to [storage]. Exit status 0 on a clean stop, 1
    when start-up fails, 78 for an invalid configuration.
    """
    from gpuhealth.service import run as run_service

    sys.exit(run_service(_service_settings(ctx, config_path), role="agent"))


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file ([controller] names the "
              "state store and the agent tokens).")
@click.pass_context
def controller(ctx: click.Context, config_path: str | None) -> None:
    """Run one replica of the fleet controller: accept agents' batches; lead or stand by.

    Every replica accepts and stores agents' batches; the leader ([remediation]
    election) alerts and remediates for the fleet. Exit status 0 on a clean stop, 1
    when start-up fails, 78 for an invalid configuration.
    """
    try:
        from gpuhealth.controller import run_controller
    except ImportError as exc:
        click.echo(f"error: the controller needs its extra: pip install 'gpuhealth[controller]' "
                   f"({exc})", err=True)
        sys.exit(EXIT_CONFIG)
    sys.exit(run_controller(_service_settings(ctx, config_path)))


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--context", "context", multiple=True, metavar="KEY=VALUE",
              help="Machine facts, as for diagnose (repeatable).")
@click.option("--audit-log", type=click.Path(dir_okay=False), default=None,
              help="Also append the dry-run decisions to this JSONL audit log.")
@click.option("--max-disrupted-fraction", type=click.FloatRange(0.0, 1.0, min_open=True),
              default=None,
              help="Disruption budget: fraction of the replayed nodes (default 0.10; with "
                   "--live the [remediation] setting of --config).")
@click.option("--cluster-size", type=click.IntRange(min=1), default=None,
              help="Nodes in the cluster for the budget (default: the nodes replayed; with "
                   "--live the [remediation] cluster_size of --config).")
@click.option("--node-facts", type=click.Path(exists=True, dir_okay=False), default=None,
              help='JSON of facts per node ({file or node: {"context": {k: v}}}).')
@click.option("--live", is_flag=True,
              help="Carry the steps out through the [remediation] scheduler of --config "
                   "(dry_run = false there); default: dry-run.")
@click.option("--wait", "wait_seconds", type=click.FloatRange(min=0.0), default=600.0,
              show_default=True, help="With --live: seconds to wait for the steps to finish.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings (the scheduler for --live).")
@click.option("--events", "events_path", type=click.Path(dir_okay=False, writable=True),
              default=None, help="Also stream every prediction, anomaly, finding, alert and "
              "warning to this file as JSON lines, in the recording's time ('-': stdout).")
@click.option("--precision", type=click.Choice(["ns", "us", "ms", "s"]), default="ns",
              show_default=True, help="Unit of the line-protocol files' timestamps.")
def replay(paths: tuple[str, ...], as_json: bool, context: tuple[str, ...],
           audit_log: str | None, max_disrupted_fraction: float,
           cluster_size: int | None, node_facts: str | None, live: bool,
           wait_seconds: float, config_path: str | None, events_path: str | None,
           precision: str) -> None:
    """Feed recorded files through the run pipeline; print findings, alerts and actions.

    Each file is its own node (named after the file) unless --context node=NAME is given.
    Remediation is dry-run unless --live. Line-protocol files (.lp, a recorded fleet) also
    go through the online detectors and the failure predictor in record time, with the
    [analytics] settings of --config; their predictions are listed.

    Exit status, as diagnose: 0 worst finding at the end is info, 1 warning, 2 major,
    3 critical, 4 nothing could be read, 64 usage error (a bad --node-facts file, --json
    with --events -), 74 the output (stdout, --events, --audit-log) could not be written,
    78 an invalid --config.
    """
    from gpuhealth.compose import site_rules
    from gpuhealth.replay import load_node_facts, render_errors, render_text, write_json
    from gpuhealth.replay import replay as run_replay

    if audit_log and os.path.exists(audit_log) and not os.path.isfile(audit_log):
        click.echo(f"error: --audit-log {audit_log}: not a regular file", err=True)
        sys.exit(EXIT_USAGE)
    if as_json and events_path == "-":
        click.echo("error: --json and --events - both write to stdout: give --events a file",
                   err=True)
        sys.exit(EXIT_USAGE)
    try:
        facts_of_nodes = load_node_facts(node_facts) if node_facts else None
    except (OSError, ValueError) as exc:
        click.echo(f"error: --node-facts {exc}", err=True)
        sys.exit(EXIT_USAGE)
    live_options: dict[str, Any] = {}
    if live:
        live_options = _live_remediation(config_path, cluster_size=cluster_size,
                                         max_disrupted_fraction=max_disrupted_fraction)
        audit_log = audit_log or live_options.pop("audit_log")
    settings = _replay_settings(config_path)
    try:  # the inputs' read errors are the report's: an OSError here is a write
        with contextlib.ExitStack() as stack:
            try:
                events = (stack.enter_context(click.open_file(events_path, "w",
                                                              encoding="utf-8"))
                          if events_path else None)
            except OSError as exc:  # a usage error, as for any other path given
                click.echo(f"error: --events {events_path}: cannot write: "
                           f"{exc.strerror or exc}", err=True)
                sys.exit(EXIT_USAGE)
            report = run_replay(
                list(paths),
                facts=_parse_context(context),
                audit_log_path=audit_log,
                max_disrupted_fraction=(max_disrupted_fraction
                                        if max_disrupted_fraction is not None else 0.10),
                cluster_size=cluster_size,
                node_facts=facts_of_nodes,
                wait_seconds=wait_seconds if live else 0.0,
                analytics=settings.analytics if settings is not None else None,
                policy=site_rules(settings) if settings is not None else None,
                events=events,
                precision=cast(Any, precision),
                **live_options,
            )
    except OSError as exc:  # the events file's last flush fails on closing, too
        _output_failed(exc, " or ".join(
            [*([f"--events {events_path}"] if events_path else []),
             *([f"--audit-log {audit_log}"] if audit_log else [])]) or "the output")
    try:
        if as_json:  # as it is encoded: a month of a fleet is hundreds of MB of JSON
            write_json(report, sys.stdout)
        else:
            click.echo(render_text(report, errors=False), nl=False)
        sys.stdout.flush()
    except OSError as exc:
        _output_failed(exc)
    if not as_json:
        for line in render_errors(report):  # on stderr, as diagnose puts them
            click.echo(line, err=True)
    if not report.parsed_lines:
        click.echo(f"error: nothing in {', '.join(paths)} could be replayed (line-protocol "
                   "files, logs or tool output)", err=True)
    sys.exit(report.exit_status)


def _replay_settings(config_path: str | None) -> Any:
    """The settings of ``replay --config`` (``None`` without one: replay's defaults).

    Replay takes their ``[analytics]`` and their ``[[policy.rule]]`` (built as ``run``
    builds them, :func:`gpuhealth.compose.site_rules`).
    """
    if not config_path:
        return None
    from gpuhealth.config import load_settings

    try:
        return load_settings(config_path)
    except (ConfigError, ValueError) as exc:  # as run reports it
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)


def _silence_store(config_path: str | None) -> Any:
    from alerting.silences import SilenceStore
    from gpuhealth.config import alerting_path, load_settings

    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    from storage.sql import is_postgres

    if is_postgres(settings.controller.state):  # a controller pair shares its silences
        return SilenceStore(path=settings.controller.state)
    return SilenceStore(path=alerting_path(settings, "silences"))


_config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), default=None,
    envvar="GPUHEALTH_CONFIG", help="TOML settings file (names the silences file).")


def _live_remediation(config_path: str | None, *, cluster_size: int | None,
                      max_disrupted_fraction: float | None) -> dict[str, Any]:
    """The scheduler and guards of ``replay --live``, built as ``run`` builds them.

    Every guard comes from the settings (:func:`gpuhealth.compose.guards`); a
    ``--cluster-size`` or ``--max-disrupted-fraction`` given on the command line wins.
    """
    from gpuhealth.compose import build_schedulers, guards
    from gpuhealth.config import load_settings

    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    if settings.remediation.dry_run:
        click.echo(f"error: {settings.source}: --live needs [remediation] dry_run = false and "
                   "a scheduler", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        scheduler, _ = build_schedulers(settings, live=True)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    return {
        "scheduler": scheduler,
        "guard": guards(settings, cluster_size=cluster_size,
                        max_disrupted_fraction=max_disrupted_fraction, dry_run=False),
        "action_store_path": str(settings.action_store_path),
        "audit_log": str(settings.audit_log_path),
    }


@main.group()
def silences() -> None:
    """Create, list and expire silences (shared with `run` and its HTTP API)."""


@silences.command("add")
@click.argument("matchers", nargs=-1, required=True)
@click.option("--duration", default="2h", show_default=True,
              help="How long, e.g. 30m, 2h, 1d.")
@click.option("--author", default=None, help="Who (default: $USER).")
@click.option("--comment", required=True, help="Why.")
@_config_option
def silences_add(matchers: tuple[str, ...], duration: str, author: str | None, comment: str,
                 config_path: str | None) -> None:
    """Silence alerts matching every MATCHER (name=value, name!=value, name=~re, name!~re).

    Prints the new silence's id.
    """
    import getpass

    from alerting.silences import parse_matchers
    from gpuhealth.config import parse_duration

    try:
        parsed = parse_matchers(matchers)
        seconds = float(parse_duration(duration))  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    store = _silence_store(config_path)
    try:
        made = store.add(parsed, duration_seconds=seconds, created_by=author or getpass.getuser(),
                         comment=comment)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(made.id)


@silences.command("list")
@click.option("--state", type=click.Choice(["active", "pending", "expired"]), default=None,
              help="Only silences in this state.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_config_option
def silences_list(state: str | None, as_json: bool, config_path: str | None) -> None:
    """List silences, newest first."""
    from alerting.silences import SilenceState, format_silences

    store = _silence_store(config_path)
    found = store.list_silences(state=SilenceState(state) if state else None)
    now = store.clock()
    if as_json:
        click.echo(json.dumps([s.to_json(now) for s in found], indent=2))
    else:
        click.echo(format_silences(found, now), nl=False)


@silences.command("expire")
@click.argument("ids", nargs=-1, required=True)
@_config_option
def silences_expire(ids: tuple[str, ...], config_path: str | None) -> None:
    """Expire the silences with these IDS now; exit 1 if one is unknown."""
    store = _silence_store(config_path)
    missing = 0
    for silence_id in ids:
        try:
            store.expire(silence_id)
        except KeyError:
            click.echo(f"error: no silence {silence_id}", err=True)
            missing += 1
    sys.exit(1 if missing else 0)


@main.group()
def rules() -> None:
    """Export gpuhealth's alerts as Prometheus rules."""


@rules.command("export")
@click.argument("output", required=False, type=click.Path(dir_okay=False, allow_dash=True),
                default="-")
@click.option("--runbook-base-url", default="docs/runbooks", show_default=True,
              help="Prefix of the runbook_url annotation.")
@click.option("--cluster", default=None, help="Add cluster=NAME to every rule.")
def rules_export(output: str, runbook_base_url: str, cluster: str | None) -> None:
    """Write the Prometheus rule file to OUTPUT (default: standard output).

    Check it with `promtool check rules OUTPUT`.
    """
    from alerting.promrules import render_rules

    text = render_rules(runbook_base_url=runbook_base_url,
                        extra_labels={"cluster": cluster} if cluster else None)
    if output == "-":
        click.echo(text, nl=False)
    else:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)


def _open_store(config_path: str | None) -> Any:
    from gpuhealth.config import load_settings
    from storage import open_store

    settings = load_settings(config_path)
    return open_store(settings.storage.type, settings.store_options,
                      spool_path=settings.node.data_dir / "spool")


@main.command("export")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file naming the store.")
@click.option("--since", required=True, help="Start: epoch seconds, ISO 8601, or 7d/30m ago.")
@click.option("--until", default="now", show_default=True, help="End, same forms.")
@click.option("--metric", "metrics", multiple=True, help="Only this metric (repeatable).")
@click.option("-o", "--output", type=click.File("w"), default="-", help="File (default stdout).")
@click.option("--precision", type=click.Choice(["ns", "us", "ms", "s"]), default="ns",
              show_default=True, help="Timestamp unit written.")
def export_cmd(config_path: str | None, since: str, until: str, metrics: tuple[str, ...],
               output: Any, precision: str) -> None:
    """Write a time range of the store as InfluxDB line protocol."""
    from storage import export, parse_when

    now = time.time()
    try:
        since_at, until_at = parse_when(since, now=now), parse_when(until, now=now)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if since_at > until_at:
        raise click.BadParameter(f"--since {since} is after --until {until}: nothing to export")
    try:
        store = _open_store(config_path)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        report = export(store, output, since_at=since_at, until_at=until_at,
                        metrics=list(metrics) or None, precision=cast(Any, precision))
    except GpuHealthError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        if isinstance(store, Closeable):
            store.close()
    from core.catalog import BY_NAME

    for name in metrics:
        if name not in BY_NAME:
            click.echo(f"warning: --metric {name}: not a catalogued metric (names such as "
                       "gpu_temperature_celsius; the catalog is core/catalog.py)", err=True)
    older = (f" ({report.aggregated} of them 1-minute means: the store keeps only aggregates "
             "past its raw retention)" if report.aggregated else "")
    click.echo(f"exported {report.samples} samples{older} and {report.events} events", err=True)


@main.command("import")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file naming the store.")
@click.option("--precision", type=click.Choice(["ns", "us", "ms", "s"]), default="ns",
              show_default=True, help="Timestamp unit of the files.")
def import_cmd(paths: tuple[str, ...], config_path: str | None, precision: str) -> None:
    """Write line-protocol files into the store, keeping their timestamps."""
    from storage import import_lines

    try:
        store = _open_store(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    from storage import store_stats

    waiting_before = store_stats(store).spool_depth
    try:
        report = import_lines(store, paths, precision=cast(Any, precision))
        waiting = store_stats(store).spool_depth
    except GpuHealthError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        if isinstance(store, Closeable):
            store.close()
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(report.rejected.items()))
    verb = "accepted" if waiting else "imported"
    click.echo(f"{verb} {report.samples} samples and {report.events} events"
               + (f"; skipped or converted: {skipped}" if skipped else ""), err=True)
    out_of_range = report.rejected["future"] + report.rejected["past"]
    if out_of_range and out_of_range >= report.samples:
        click.echo(f"hint: {out_of_range} value(s) fell outside the accepted time range: is "
                   f"--precision {precision} the unit of the file's timestamps?", err=True)
    if waiting_before and waiting < waiting_before:
        click.echo(f"delivered {waiting_before - waiting if waiting else waiting_before} of the "
                   f"{waiting_before} record(s) an earlier run had spooled", err=True)
    if waiting:
        click.echo(f"warning: the store did not answer: {waiting} record(s) wait in the spool "
                   f"({getattr(store, 'path', 'spool')}) and reach the store "
                   "with the next import or `gpuhealth run` once it answers", err=True)
    if report.past_raw_retention:
        kept = report.past_raw_retention - report.past_all_retention
        click.echo(f"warning: {report.past_raw_retention} sample(s) are older than the store's "
                   "raw retention ([storage] retention_seconds): "
                   + (f"{kept} are kept only as downsampled aggregates" if kept else "")
                   + (", " if kept and report.past_all_retention else "")
                   + (f"{report.past_all_retention} are older than every tier and will be "
                      "deleted" if report.past_all_retention else ""), err=True)
    if report.rejected and not (report.samples or report.events):
        sys.exit(1)


@main.group()
def evaluate() -> None:
    """Score detectors and predictors on benchmarks (NAB, Titan, the labelled stream)."""


@evaluate.command("nab")
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="NAB folder (default: $GPUHEALTH_TEST_DATA/nab, else ../shared/data/nab).")
@click.option("--profile", "profiles", multiple=True,
              type=click.Choice(["standard", "reward_low_FP_rate", "reward_low_FN_rate"]),
              help="Profiles to report (repeatable; default: all three).")
@click.option("--files", "max_files", type=int, default=0,
              help="Only N files spread over the corpus (0: all).")
@click.option("--cooldown", type=int, default=200, show_default=True, help="Debounce, rows.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def evaluate_nab(data_dir: str | None, profiles: tuple[str, ...], max_files: int,
                 cooldown: int, as_json: bool) -> None:
    """Score gpuhealth's detectors on NAB beside the published scoreboard."""
    from analytics import nab

    root = nab.data_root(data_dir)
    if not nab.is_nab_folder(root):
        raise click.ClickException(f"no NAB data in {root} (use --data or GPUHEALTH_TEST_DATA)")
    keys = (
        nab.spread_keys([f.key for f in nab.load_corpus(root)], max_files) if max_files else None
    )
    try:
        results = nab.evaluate(root, keys=keys, cooldown_rows=cooldown)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    wanted = set(profiles) or {"standard", "reward_low_FP_rate", "reward_low_FN_rate"}
    results = {d: {p: s for p, s in r.items() if p in wanted} for d, r in results.items()}
    if as_json:
        click.echo(json.dumps({d: {p: round(s.normalised, 2) for p, s in r.items()}
                               for d, r in results.items()}, indent=2, sort_keys=True))
        return
    if keys:
        click.echo(f"{len(keys)} of the corpus's files only: the scoreboard below is over all "
                   "58, so the rows are not comparable; run without --files to compare.")
    click.echo(nab.format_table(results, nab.load_scoreboard(root)))


@evaluate.command("titan")
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="Titan folder (default: $GPUHEALTH_TEST_DATA/titan-gpu-lifetimes).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the report.")
def evaluate_titan(data_dir: str | None, as_json: bool) -> None:
    """Rank Titan GPUs and slots by failure risk; concordance beside a location-only Cox."""
    from analytics import survival

    try:
        result = survival.evaluate_titan(survival.data_dir(data_dir))
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        click.echo(survival.render(result), nl=False)


@evaluate.command("stream")
@click.option("--small", is_flag=True, help="64 GPUs x 3 days, failures sped up 600x (CI).")
@click.option("--gpus", type=click.IntRange(min=8), default=None,
              help="GPUs (and as many IB ports), a multiple of 8 (default 1,000).")
@click.option("--days", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Days of stream (default 30).")
@click.option("--seed", type=int, default=None,
              help="Stream seed (default: the reporting seed 61708293; develop on 1-3).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings: the replay's [analytics] "
              "(which detectors run, the predictor), as for replay --config.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              default=None, help="Also write the results as JSON to this file ('-': stdout only).")
def evaluate_stream(small: bool, gpus: int | None, days: float | None, seed: int | None,
                    config_path: str | None, json_path: str | None) -> None:
    """Replay the labelled synthetic GPU/link stream as `replay` does; score it.

    The stream is written as line protocol to a temporary folder and replayed through the
    code `run` uses (online detectors, prediction stage, fault model); its predictions at
    0.5 and 0.9, each anomaly detector, the findings and the alerts are scored against the
    stream's failures. Which detectors run is [analytics] of --config (the old --only is
    gone: there is one code path).
    """
    from analytics import stream_eval
    from gpuhealth.evaluate import evaluate_stream as run_evaluation
    from gpuhealth.evaluate import render

    if json_path and json_path != "-":
        _check_writable(json_path, "--json")  # before the run, not after minutes of it
    settings = _replay_settings(config_path)
    analytics = settings.analytics if settings is not None else None
    try:
        config = stream_eval.stream_config(small=small, gpus=gpus, days=days)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    result = run_evaluation(config, stream_eval.REPORTING_SEED if seed is None else seed,
                            analytics=analytics)
    if json_path == "-":
        click.echo(json.dumps(result, indent=2))
        return
    if json_path:
        try:
            with open(json_path, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            raise click.ClickException(f"cannot write {json_path}: {exc.strerror}") from exc
    click.echo(render(result), nl=False)


def _check_writable(path: str, option: str) -> None:
    """Fail with a usage error unless a file can be written at ``path``.

    Raises:
        click.BadParameter: Its folder is missing or read-only, or the file is read-only.
    """
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"folder {folder} does not exist", param_hint=option)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise click.BadParameter(f"{path} is not writable", param_hint=option)
    if not os.path.exists(path) and not os.access(folder, os.W_OK):
        raise click.BadParameter(f"folder {folder} is not writable", param_hint=option)


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("check")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="The settings file (the same as PATH, as the other commands take it).")
@click.option("--role", type=click.Choice(["run", "agent", "controller"]), default="run",
              show_default=True, help="The command the file is for: agent and controller "
              "need keys that run does not.")
@click.option("--show", is_flag=True,
              help="Also print the settings in effect (every default filled in) as JSON.")
def config_check(path: str | None, config_path: str | None, role: str, show: bool) -> None:
    """Validate a settings file and GPUHEALTH_* overrides; print the result, exit 1 if invalid.

    Without PATH (or --config), checks the embedded defaults (plus the environment
    overrides). --role agent also needs [agent] controllers and a token; --role controller
    needs [controller] agent_tokens_file. A valid file gives one line (with --show, the
    settings in effect as JSON after it).
    """
    from gpuhealth.config import check, load_settings

    if path and config_path and path != config_path:
        raise click.UsageError(f"two settings files given: {path} and --config {config_path}")
    path = path or config_path

    problems = check(path)
    if not problems:
        from gpuhealth.compose import scheduler_problems

        problems.extend(scheduler_problems(load_settings(path)))
    if not problems and role != "run":
        settings = load_settings(path)
        if role == "agent" and not settings.agent.controllers:
            problems.append(f"{settings.source}: [agent] controllers: the agent needs the URL "
                            "of at least one controller replica")
        if role == "agent" and not (settings.agent.token_env or settings.agent.token_file):
            problems.append(f"{settings.source}: [agent] token_env or token_file: the agent "
                            "needs its token")
        if role == "controller" and settings.controller.agent_tokens_file is None:
            problems.append(f"{settings.source}: [controller] agent_tokens_file: the "
                            "controller accepts only agents with a token; list them")
        if role == "controller":
            from gpuhealth.controller import listener_token_problem

            problem = listener_token_problem(settings)
            if problem:
                problems.append(problem)
    if problems:
        for line in problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(1)
    settings = load_settings(path)
    rules = len(settings.policy.rule)
    # The controller runs no collector (its agents do): counting them would mislead.
    collected = ("" if role == "controller"
                 else f"{len(settings.enabled_collectors())} collector(s) enabled, ")
    click.echo(f"{path or 'embedded defaults'}: valid ({collected}"
               f"{rules} policy rule(s); --show prints the settings in effect)")
    if show:
        click.echo(json.dumps(settings.model_dump(mode="json"), indent=2, sort_keys=True))


@main.group()
def plugins() -> None:
    """Inspect installed plugins."""


@plugins.command("list")
def plugins_list() -> None:
    """List installed collectors, stores, detectors, notifiers and scheduler adapters."""
    for group in GROUPS:
        click.echo(f"{group}:")
        for name, target in available(group).items():
            click.echo(f"  {name:16} {target}")


EXIT_TEMPFAIL = 75
"""Exit status when a remote service is unavailable (BSD sysexits EX_TEMPFAIL)."""


@main.group()
def dashboards() -> None:
    """Render the Grafana dashboards or provision them."""


@dashboards.command("render")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output folder: dashboards/<flavour>/*.json and provisioning/dashboards/.")
@click.option("--flavour", "flavours", multiple=True,
              type=click.Choice(["prometheus", "influxdb"]),
              help="Datasource flavour (repeatable); both by default.")
def dashboards_render(out_dir: str, flavours: tuple[str, ...]) -> None:
    """Write the dashboards and a Grafana file-provisioning YAML under OUT."""
    from pathlib import Path

    from dashboards.render import Flavour, write_dashboards

    chosen = tuple(Flavour(f) for f in flavours) or tuple(Flavour)
    for path in write_dashboards(Path(out_dir), chosen):
        click.echo(str(path))


@dashboards.command("provision")
@click.option("--url", required=True, help="Grafana root URL, e.g. http://127.0.0.1:3000.")
@click.option("--token-env", default="GPUHEALTH_GRAFANA_TOKEN", show_default=True,
              metavar="VAR", help="Environment variable holding a service-account token.")
@click.option("--folder", default="GPU Health", show_default=True,
              help="Grafana folder (created when missing).")
@click.option("--flavour", "flavours", multiple=True,
              type=click.Choice(["prometheus", "influxdb"]),
              help="Datasource flavour (repeatable); prometheus by default.")
def dashboards_provision(url: str, token_env: str, folder: str,
                         flavours: tuple[str, ...]) -> None:
    """Save the dashboards in Grafana through its HTTP API (grafana-client)."""
    import os

    from core.errors import PermanentError, TemporaryError
    from dashboards.render import Flavour

    try:
        from dashboards.grafana import provision
    except ImportError as exc:
        raise click.ClickException(
            "grafana-client is not installed: URLLIB3_NO_OVERRIDE=1 pip install "
            "'gpuhealth[grafana]' --no-binary urllib3-future") from exc
    token = os.environ.get(token_env) or None
    if token is None:
        logger.warning("environment variable %s is empty; sending no credentials", token_env)
    chosen = tuple(Flavour(f) for f in flavours) or (Flavour.PROMETHEUS,)
    try:
        results = provision(url, token=token, folder=folder, flavours=chosen)
    except TemporaryError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(EXIT_TEMPFAIL)
    except PermanentError as exc:
        raise click.ClickException(str(exc)) from exc
    for result in results:
        click.echo(f"{result.uid}\t{result.status}\tversion {result.version}")


def _register() -> None:
    """Name the command groups defined in their own modules (imported when used)."""
    main.lazy = {
        "actions": "gpuhealth.actions_cli:actions",
        "check": "gpuhealth.check_cli:check",
        "drill": "gpuhealth.drill_cli:drill",
        "mark-healthy": "gpuhealth.mark_healthy_cli:mark_healthy",
        "report": "gpuhealth.report_cli:report",
    }


_register()

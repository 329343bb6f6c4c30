"""The ``gpuhealth`` console script: a thin click group over library functions.

Commands only parse arguments, load settings and call a library function
(style.md C.3.18); every behaviour is reachable, and tested, without the CLI.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import click

from core import logs
from core.errors import ConfigError
from core.plugins import GROUPS, available
from gpuhealth.diagnose import diagnose as run_diagnose

logger = logging.getLogger(__name__)

EXIT_USAGE = 64
"""Exit status for usage errors (BSD sysexits EX_USAGE, as fault-model.md asks)."""

EXIT_CONFIG = 78
"""Exit status of ``run`` for an invalid configuration (BSD sysexits EX_CONFIG)."""


def _parse_context(values: tuple[str, ...]) -> dict[str, str]:
    facts: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--context")
        facts[key.strip()] = value.strip()
    return facts


class _Group(click.Group):
    """A click group whose usage errors exit with 64 (EX_USAGE) instead of click's 2."""

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
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract of fault-model.md.")
@click.option("--context", "context", multiple=True, metavar="KEY=VALUE",
              help="Machine facts not in the files, e.g. nvlink=absent (repeatable).")
def diagnose(paths: tuple[str, ...], as_json: bool, context: tuple[str, ...]) -> None:
    """Diagnose pasted artifacts: kernel logs, nvidia-smi, DCGM, NCCL, InfiniBand output.

    Exit status: 0 worst is info, 1 warning, 2 major, 3 critical, 4 nothing could
    be parsed, 64 usage error.
    """
    result = run_diagnose(list(paths), _parse_context(context), now=time.time())
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        for f in result.findings:
            click.echo(f"{f.severity.value.upper():8} {f.action.value:16} {f.node} {f.entity} "
                       f"[{f.kind} {f.code}] {f.summary}")
            for e in f.evidence[:6]:
                click.echo(f"    {e.file}:{e.line}: {e.text.strip()[:160]}")
        if not result.findings:
            click.echo("no findings: worst severity info, action none")
        else:
            actions = ", ".join(a.value for a in result.worst_actions)
            click.echo(f"worst: {result.worst_severity.value}; action: {actions}")
        for issue in result.issues:
            where = f"{issue.file}:{issue.line}" if issue.line is not None else issue.file
            click.echo(f"error: {where}: {issue.reason}", err=True)
    sys.exit(result.exit_status)


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


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--context", "context", multiple=True, metavar="KEY=VALUE",
              help="Machine facts, as for diagnose (repeatable).")
@click.option("--audit-log", type=click.Path(dir_okay=False), default=None,
              help="Also append the dry-run decisions to this JSONL audit log.")
@click.option("--max-disrupted-fraction", type=click.FloatRange(0.0, 1.0), default=0.10,
              show_default=True, help="Disruption budget: fraction of the replayed nodes.")
@click.option("--cluster-size", type=click.IntRange(min=1), default=None,
              help="Nodes in the cluster for the budget (default: the nodes replayed).")
def replay(paths: tuple[str, ...], as_json: bool, context: tuple[str, ...],
           audit_log: str | None, max_disrupted_fraction: float,
           cluster_size: int | None) -> None:
    """Feed recorded files through the run pipeline; print findings, alerts and dry-run actions.

    Each file is its own node (named after the file) unless --context node=NAME is given.
    """
    from gpuhealth.replay import render_text, to_json
    from gpuhealth.replay import replay as run_replay

    report = run_replay(list(paths), facts=_parse_context(context), audit_log_path=audit_log,
                        max_disrupted_fraction=max_disrupted_fraction, cluster_size=cluster_size)
    if as_json:
        click.echo(json.dumps(to_json(report), indent=2))
    else:
        click.echo(render_text(report))


@main.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("check")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
def config_check(path: str | None) -> None:
    """Validate a settings file and GPUHEALTH_* overrides; print the result, exit 1 if invalid.

    Without PATH, checks the embedded defaults (plus the environment overrides).
    """
    from gpuhealth.config import check, load_settings

    problems = check(path)
    if problems:
        for line in problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(1)
    settings = load_settings(path)
    click.echo(f"{path or 'embedded defaults'}: valid")
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

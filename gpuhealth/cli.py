"""The ``gpuhealth`` console script: a thin click group over library functions."""

from __future__ import annotations

import json
import logging
import sys
import time

import click

from gpuhealth.diagnose import diagnose as run_diagnose

logger = logging.getLogger(__name__)


def _parse_context(values: tuple[str, ...]) -> dict[str, str]:
    facts: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--context")
        facts[key.strip()] = value.strip()
    return facts


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on standard error.")
def main(verbose: int, quiet: bool) -> None:
    """Gpuhealth: GPU fleet health, diagnosis and remediation."""
    level = logging.ERROR if quiet else logging.DEBUG if verbose > 1 else (
        logging.INFO if verbose else logging.WARNING
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract of fault-model.md.")
@click.option("--context", "context", multiple=True, metavar="KEY=VALUE",
              help="Machine facts not in the files, e.g. nvlink=absent.")
def diagnose(paths: tuple[str, ...], as_json: bool, context: tuple[str, ...]) -> None:
    """Diagnose pasted artifacts: kernel logs, nvidia-smi, DCGM, NCCL, InfiniBand output."""
    result = run_diagnose(list(paths), _parse_context(context), now=time.time())
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        for f in result.findings:
            click.echo(f"{f.severity.value.upper():8} {f.action.value:16} {f.node}/{f.entity} "
                       f"[{f.kind} {f.code}] {f.summary}")
            for e in f.evidence[:4]:
                click.echo(f"           {e.file}:{e.line}: {e.text.strip()[:160]}")
        if not result.findings:
            click.echo("no findings: worst severity info")
        for issue in result.issues:
            where = f"{issue.file}:{issue.line}" if issue.line is not None else issue.file
            click.echo(f"error: {where}: {issue.reason}", err=True)
    sys.exit(result.exit_status)

"""``gpuhealth check``: the node-local readiness gate (HealthCheckProgram, prolog, init).

Reads the node's state now (``nvidia-smi -q -x``, the kernel log since the boot:
:mod:`collectors.node_check`), or the artifacts given with ``--input``, judges it with the
fault model exactly as ``gpuhealth diagnose`` does, prints the findings and exits:

- 0 when nothing at or above ``--fail-at`` (default ``major``) was found;
- 2 (``major``) or 3 (``critical``) with the findings otherwise (1 for ``--fail-at
  warning``): a Slurm prolog or a Kubernetes init container that exits non-zero keeps
  work off the node;
- 75 when slurmctld cannot be reached in ``--slurm`` mode.

A source that cannot be read (no ``nvidia-smi``, a tool that hangs past ``--timeout``)
is named on stderr and counts as nothing: a check never fails a node for what it could
not read. When nothing at all could be read the verdict is ``not judged`` (exit 0, and
with ``--slurm`` the node's state is left as it is: neither drained nor resumed).
``--config`` applies its ``[[policy.rule]]`` as ``run`` does; ``--slurm --dry-run`` gives
its verdict even when slurmctld cannot be reached (with a warning). With ``--slurm`` it
acts as LBNL NHC does (:mod:`remediation.node_check`): drains its own node with a
``gpuhealth: check:`` reason, resumes only its own drains.
It finishes in a few seconds, well inside slurmd's 60 s ``HealthCheckProgram`` limit.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import tempfile
import time
from pathlib import Path

import click

from core.errors import ConfigError, PermanentError, TemporaryError
from core.records import Finding, Severity

EXIT_TEMPFAIL, EXIT_CONFIG = 75, 78
_EXIT = {Severity.WARNING: 1, Severity.MAJOR: 2, Severity.CRITICAL: 3}


@click.command("check")
@click.option("--input", "inputs", multiple=True, type=click.Path(exists=True),
              help="Judge these artifacts instead of reading the node now (repeatable).")
@click.option("--fail-at", type=click.Choice(["warning", "major", "critical"]),
              default="major", show_default=True,
              help="The lowest severity that fails the check (and drains with --slurm).")
@click.option("--slurm", "slurm", is_flag=True,
              help="Act as Slurm's HealthCheckProgram: drain this node with a "
                   "'gpuhealth: check:' reason on failure, resume only such drains.")
@click.option("--node", default=None, help="This node's name (default: [node] name, the "
              "short host name).")
@click.option("--dry-run", is_flag=True, help="With --slurm: say what would be done.")
@click.option("--timeout", "timeout_seconds", type=float, default=20.0, show_default=True,
              help="Longest wait for one tool (nvidia-smi can hang on a bad GPU), seconds.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file ([inventory] facts, "
              "[remediation.scheduler_options] env for Slurm).")
def check(inputs: tuple[str, ...], fail_at: str, slurm: bool, node: str | None,
          dry_run: bool, timeout_seconds: float, config_path: str | None) -> None:
    """Check this node now; exit non-zero with the findings if it must not take work."""
    from collectors.node_check import gather
    from gpuhealth.compose import site_rules
    from gpuhealth.config import load_settings
    from gpuhealth.diagnose import diagnose

    started = time.monotonic()
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    name = node or (settings.node.name if config_path else socket.gethostname().split(".")[0])
    threshold = Severity(fail_at)
    with tempfile.TemporaryDirectory(prefix="gpuhealth-check-") as folder:
        if inputs:
            paths = list(inputs)
        else:
            files, gaps = gather(Path(folder), timeout_seconds=timeout_seconds)
            for gap in gaps:
                click.echo(f"gpuhealth check: not read: {gap.what}: {gap.why}", err=True)
            paths = [str(f) for f in files]
        findings: list[Finding] = []
        judged = False
        if paths:
            now = time.time()
            result = diagnose(paths, facts={**settings.inventory, "node": name}, now=now)
            # The site's [[policy.rule]] (ignore, count, overrides) as run applies them.
            rules = site_rules(settings)
            found = rules.apply(result.findings, now=now) if rules else result.findings
            findings = sorted((f for f in found if f.severity.rank >= Severity.WARNING.rank),
                              key=lambda f: -f.severity.rank)
            judged = result.parsed_anything
            for issue in result.issues[:5]:
                where = f"{issue.file}:{issue.line}" if issue.line else issue.file
                click.echo(f"gpuhealth check: not read: {where}: {issue.reason}", err=True)
            if len(result.issues) > 5:
                click.echo(f"gpuhealth check: ... and {len(result.issues) - 5} more lines "
                           "not read", err=True)
        if not judged:
            click.echo("gpuhealth check: nothing could be read: the node is not judged",
                       err=True)
    failing = [f for f in findings if f.severity.rank >= threshold.rank]
    for f in findings:
        click.echo(f"{f.severity.value:<8} {f.kind} {f.code} on {f.entity}: {f.summary}")
    took = time.monotonic() - started
    if not judged:
        # Neither drained nor called ready (nor resumed) for what could not be read; exit 0
        # as for any source that could not be read, so slurmd leaves the node as it is.
        if slurm:
            click.echo(f"{name}: Slurm state left as it is (not judged)")
        click.echo(f"{name}: not judged: nothing could be read ({took:.1f} s)")
        return
    if slurm:
        from remediation.node_check import act
        from remediation.slurm import SlurmScheduler

        options = dict(settings.remediation.scheduler_options)
        env = options.get("env") if isinstance(options.get("env"), dict) else None
        try:
            done = asyncio.run(act(SlurmScheduler(env=env), name, findings,
                                   fail_at=threshold, dry_run=dry_run))
        except (TemporaryError, PermanentError) as exc:
            if not dry_run:
                if isinstance(exc, TemporaryError):
                    click.echo(f"gpuhealth check: slurmctld: {exc}", err=True)
                    sys.exit(EXIT_TEMPFAIL)
                click.echo(f"gpuhealth check: Slurm refused: {exc}", err=True)
                sys.exit(1)
            # A dry run changes nothing, so it needs slurmctld only to say what it would
            # do: the verdict stands without it.
            click.echo(f"gpuhealth check: warning: the node's Slurm state could not be read "
                       f"(dry run, nothing would change without it): {exc}", err=True)
            done = "Slurm state not read (dry run)"
        click.echo(f"{name}: {done}")
        took = time.monotonic() - started
    if not failing:
        click.echo(f"{name}: ready ({len(findings)} finding(s) below {fail_at}; {took:.1f} s)")
        return
    click.echo(f"{name}: NOT ready: {len(failing)} finding(s) at or above {fail_at} "
               f"({took:.1f} s)", err=True)
    sys.exit(_EXIT[max(failing, key=lambda f: f.severity.rank).severity])

"""``gpuhealth mark-healthy NODE [ENTITY] --reason ...``: a person's word that a node is fine.

Every finding has a way to clear: a healthy reading of the same state, a recovery event,
its window ending, or this. It asks the running ``gpuhealth run`` or controller (its
alerting API, ``[alerting] api_listen_address``/``api_port``, with the bearer token of
``[alerting] api_token_env``) to clear the node's findings (or one entity's), with an
audit record naming who and why; the alerts then resolve and remediation returns the
node to service. A node kept unhealthy by a 90 s monitor outage for 8 days (the EKS node
monitoring agent's issue #266) is one command away from service, with a trail.

The node name must be one (:func:`core.names.node_name_problem`: an RFC 1123 subdomain of
at most 253 characters, no glob, path or control character), and the entity, the reason
and ``--by`` hold no control character; the service checks the same and answers that a
well-formed node it has never heard of is unknown, recording nothing.

Exit statuses (BSD sysexits): 0 cleared (also when nothing was open on a node the service
knows), 1 refused by the service (the message says why), 64 usage error (a malformed node
name, entity, reason or ``--url``), 68 the service does not know the node (nothing was
recorded), 75 the service cannot be reached or cannot record it now (retry), 78
configuration error (an unreadable settings file, an ``[alerting] api_token_env`` that
names an unset variable).
"""

from __future__ import annotations

import getpass
import json
import sys
from typing import NoReturn

import click

from core.errors import ConfigError
from core.names import entity_problem, node_name_problem, text_problem

EXIT_REFUSED, EXIT_USAGE, EXIT_NOHOST, EXIT_TEMPFAIL, EXIT_CONFIG = 1, 64, 68, 75, 78
"""Exit statuses (see the module docstring)."""


def _usage(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _check_url(url: str) -> str:
    """Return ``url`` without a trailing ``/``; exit 64 unless it is an http(s) URL."""
    import httpx

    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as exc:
        _usage(f"--url {url!r} is not a URL: {exc}")
    if parsed.scheme not in ("http", "https") or not parsed.host:
        _usage(f"--url {url!r} is not an http:// or https:// URL with a host "
               "(e.g. http://127.0.0.1:9101)")
    if port is not None and not 0 < port < 65536:
        _usage(f"--url {url!r}: port {port} is out of range")
    return url.rstrip("/")


@click.command("mark-healthy")
@click.argument("node")
@click.argument("entity", required=False)
@click.option("--reason", required=True, help="Why (goes into the audit trail).")
@click.option("--by", "who", default=None, help="Who says so (default: $USER).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file (names the API).")
@click.option("--url", default=None,
              help="The service's API base URL (default: from [alerting] api_listen_address "
                   "and api_port).")
def mark_healthy(node: str, entity: str | None, reason: str, who: str | None,
                 config_path: str | None, url: str | None) -> None:
    """Clear the findings of NODE (or of one ENTITY: a GPU, a port) with an audit record."""
    import httpx  # here: the CLI's start-up imports no HTTP client

    from gpuhealth.config import api_token, load_settings

    by = who or getpass.getuser()
    problem = (node_name_problem(node) or (entity_problem(entity) if entity is not None
                                           else None)
               or text_problem("--reason", reason) or text_problem("--by", by))
    if problem is None and not reason.strip():
        problem = "--reason: required (it goes into the audit trail)"
    if problem:
        _usage(problem)
    checked = _check_url(url) if url is not None else None

    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    a = settings.alerting
    host = "127.0.0.1" if a.api_listen_address in ("0.0.0.0", "::") else a.api_listen_address
    base = checked or f"http://{host}:{a.api_port}"
    token = api_token(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"node": node, "entity": entity, "reason": reason, "by": by}
    try:
        answer = httpx.post(f"{base}/api/v1/mark-healthy", json=body, headers=headers,
                            timeout=10.0)
    except httpx.InvalidURL as exc:  # the configured address makes no URL
        click.echo(f"error: {base} is not a URL: {exc}", err=True)
        sys.exit(EXIT_CONFIG if checked is None else EXIT_USAGE)
    except httpx.HTTPError as exc:
        click.echo(f"error: cannot reach the gpuhealth API at {base}: {exc}", err=True)
        sys.exit(EXIT_TEMPFAIL)
    try:
        data = answer.json()
    except json.JSONDecodeError:
        data = {"error": answer.text[:200]}
    if answer.status_code == 503:
        click.echo(f"error: {base}: {data.get('error')} (nothing was cleared; retry)", err=True)
        sys.exit(EXIT_TEMPFAIL)
    error = str(data.get("error", "")) if isinstance(data, dict) else ""
    if answer.status_code == 404 and error.startswith("unknown node"):
        click.echo(f"error: {base}: {error}", err=True)
        sys.exit(EXIT_NOHOST)
    if answer.status_code != 200:
        click.echo(f"error: {base}: HTTP {answer.status_code}: {error}", err=True)
        sys.exit(EXIT_REFUSED)
    cleared = data.get("cleared", [])
    what = f"{node} {entity}" if entity else node
    if not cleared:
        click.echo(f"{what}: nothing was open; recorded in the audit trail")
        return
    click.echo(f"{what}: {len(cleared)} finding(s) cleared, recorded in the audit trail:")
    for f in cleared:
        click.echo(f"  {f['severity']:<8} {f['kind']} {f['code']} on {f['entity']}")

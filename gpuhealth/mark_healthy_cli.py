"""``gpuhealth mark-healthy NODE [ENTITY] --reason ...``: a person's word that a node is fine.

Every finding has a way to clear: a healthy reading of the same state, a recovery event,
its window ending, or this. It asks the running ``gpuhealth run`` or controller (its
alerting API, ``[alerting] api_listen_address``/``api_port``, with the bearer token of
``[alerting] api_token_env``) to clear the node's findings (or one entity's), with an
audit record naming who and why; the alerts then resolve and remediation returns the
node to service. A node kept unhealthy by a 90 s monitor outage for 8 days (the EKS node
monitoring agent's issue #266) is one command away from service, with a trail.

Exit statuses: 0 cleared (also when nothing was open), 1 refused (the message says why),
75 the service cannot be reached or cannot record it now (retry), 78 configuration error.
"""

from __future__ import annotations

import getpass
import json
import sys

import click

from core.errors import ConfigError

EXIT_TEMPFAIL, EXIT_CONFIG = 75, 78


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

    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    a = settings.alerting
    host = "127.0.0.1" if a.api_listen_address in ("0.0.0.0", "::") else a.api_listen_address
    base = (url or f"http://{host}:{a.api_port}").rstrip("/")
    token = api_token(settings)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"node": node, "entity": entity, "reason": reason, "by": who or getpass.getuser()}
    try:
        answer = httpx.post(f"{base}/api/v1/mark-healthy", json=body, headers=headers,
                            timeout=10.0)
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
    if answer.status_code != 200:
        click.echo(f"error: {base}: HTTP {answer.status_code}: {data.get('error')}", err=True)
        sys.exit(1)
    cleared = data.get("cleared", [])
    what = f"{node} {entity}" if entity else node
    if not cleared:
        click.echo(f"{what}: nothing was open; recorded in the audit trail")
        return
    click.echo(f"{what}: {len(cleared)} finding(s) cleared, recorded in the audit trail:")
    for f in cleared:
        click.echo(f"  {f['severity']:<8} {f['kind']} {f['code']} on {f['entity']}")

"""gpuhealth's alerts as a Prometheus rule file, for sites that alert from Prometheus.

:func:`prometheus_rules` returns rule groups (``docs/ecosystem-reference.md`` §3.4)
over gpuhealth's own ``/metrics`` (catalog names, labels ``node`` and ``entity``)
(label ``exporter="gpuhealth"``) and over dcgm-exporter's series (``DCGM_FI_*``,
label ``exporter="dcgm-exporter"``, whose host label is ``Hostname``
on released tags and ``hostname`` on main, and whose GPU label is ``UUID``: both
are mapped onto ``node`` and ``entity`` with ``label_replace``). The alert names,
``severity``, ``kind`` and ``code`` labels and the ``summary``, ``action`` and
``runbook_url`` annotations are those gpuhealth's own alerts carry
(:func:`alerting.alerts.alert_name`), so routes and silences written for one work
for the other. A rule whose name lost a doubled prefix (``GpuGpuhealthNotifierBacklog``
is now ``GpuhealthNotifierBacklog``) names its old name in an ``alias`` annotation for one
release. Severities follow ``docs/fault-model.md``.

Only states that a metric shows by itself are exported: recovery actions, row
remap and SRAM flags, retired-page pending, clock event reasons, NVLink and
InfiniBand port states, Xids by count (gpuhealth) or by dcgm-exporter's last-Xid
gauge, and gpuhealth's own notification backlog. Findings that need several
inputs together (a diagnostic table, Xid 45 folding, NVLink context) stay with
gpuhealth itself.

:func:`render_rules` writes the YAML (every scalar double-quoted, so no value
is misread); ``promtool check rules`` accepts it (tested against the Debian
``prometheus`` package, 2.42).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from alerting.alerts import alert_name, legacy_alert_name
from analytics.fault_model.xid import RESET_GPU_XIDS

DEFAULT_RUNBOOK_BASE_URL = "docs/runbooks"
"""Prefix of the ``runbook_url`` annotation (a folder here, or the site's URL)."""

CRITICAL_XIDS: tuple[int, ...] = tuple(sorted({48, 79, 154} | set(RESET_GPU_XIDS)))
"""Xids that page as critical (fault-model.md: lost GPU, DBE, the RESET_GPU bucket, 154)."""

WARNING_XIDS: tuple[int, ...] = (63, 94)
"""Xids that make a ticket (fault-model.md: contained ECC error, row remap event)."""

_ACTION_OF_XID = {48: "reset_gpu", 79: "reboot_node", 154: "reset_gpu", 63: "reset_gpu",
                  94: "reset_gpu"}


@dataclass(frozen=True, slots=True, kw_only=True)
class PromRule:
    """One Prometheus alerting rule.

    Attributes:
        kind: Fault kind (the ``kind`` label and the runbook name).
        code: Fault code (the ``code`` label).
        severity: ``critical``, ``major`` or ``warning``.
        action: Recommended action (fault-model.md vocabulary).
        expr: PromQL; its result must carry ``node`` and ``entity`` labels.
        summary: ``summary`` annotation (Go template, ``$labels`` and ``$value``).
        for_: Prometheus ``for`` duration (``"0m"`` fires at the first evaluation).
    """

    kind: str
    code: str
    severity: str
    action: str
    expr: str
    summary: str
    for_: str = "0m"

    @property
    def alert(self) -> str:
        """The alert name, as gpuhealth names its own alert for the same fault."""
        return alert_name(self.kind, self.code)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromGroup:
    """A rule group."""

    name: str
    rules: tuple[PromRule, ...] = field(default_factory=tuple)
    labels: Mapping[str, str] = field(default_factory=dict)


_WHERE = "{{ $labels.node }} {{ $labels.entity }}"


def _dcgm(expr: str) -> str:
    """Map dcgm-exporter's host and GPU labels onto ``node`` and ``entity``."""
    inner = f'label_replace({expr}, "node", "$1", "Hostname", "(.+)")'
    inner = f'label_replace({inner}, "node", "$1", "hostname", "(.+)")'
    return f'label_replace({inner}, "entity", "$1", "UUID", "(.+)")'


_RECOVERY_ACTIONS = (
    # (gpu_recovery_action value, code, severity, action, NVML's name)
    (1, "gpu_reset", "critical", "reset_gpu", "GPU Reset Required"),
    (2, "node_reboot", "critical", "reboot_node", "Node Reboot Required"),
    (3, "drain_p2p", "major", "reset_gpu", "Drain P2P"),
    (4, "drain_and_reset", "critical", "reset_gpu", "Drain and Reset"),
)


def _xid_rule(xid: int, severity: str, expr: str, summary: str) -> PromRule:
    return PromRule(kind="xid", code=str(xid), severity=severity,
                    action=_ACTION_OF_XID.get(xid, "reset_gpu"), expr=expr,
                    summary=f"{_WHERE}: {summary}")


def _gpuhealth_rules() -> tuple[PromRule, ...]:
    rules = [
        PromRule(kind="recovery_action", code=code, severity=severity, action=action,
                 expr=f"gpu_recovery_action == {value}",
                 summary=f"{_WHERE}: recovery action {name}")
        for value, code, severity, action, name in _RECOVERY_ACTIONS
    ]
    rules += [
        PromRule(kind="row_remap", code="failure", severity="critical",
                 action="service_hardware", expr="gpu_row_remap_failure > 0",
                 summary=f"{_WHERE}: row remapping failed (RMA candidate)"),
        PromRule(kind="row_remap", code="pending", severity="warning",
                 action="reset_gpu", expr="gpu_row_remap_pending > 0",
                 summary=f"{_WHERE}: row remap pending; reset the GPU at the next opportunity"),
        PromRule(kind="ecc", code="sram_threshold_exceeded", severity="critical",
                 action="service_hardware", expr="gpu_sram_threshold_exceeded > 0",
                 summary=f"{_WHERE}: SRAM error threshold exceeded (RMA candidate)"),
        PromRule(kind="retired_pages", code="pending", severity="warning",
                 action="reset_gpu", expr="gpu_retired_pages_pending > 0",
                 summary=f"{_WHERE}: retired pages pending; reset the GPU"),
        PromRule(kind="throttle", code="hw_power_brake", severity="major",
                 action="fix_config",
                 expr='gpu_clock_event_active{reason="hw_power_brake"} == 1',
                 summary=f"{_WHERE}: HW power brake asserted"),
        PromRule(kind="throttle", code="thermal", severity="warning",
                 action="service_hardware", for_="1m",
                 expr='max without (reason) '
                      '(gpu_clock_event_active{reason=~"hw_thermal|sw_thermal"}) == 1',
                 summary=f"{_WHERE}: thermal slowdown; check cooling"),
        PromRule(kind="nvlink", code="link_down", severity="major", action="reset_gpu",
                 expr="count without (link) (gpu_nvlink_state == 0) > 0",
                 summary=f"{_WHERE}: {{{{ $value }}}} NVLink(s) down"),
        PromRule(kind="ib_port", code="state_down", severity="major", action="check_network",
                 expr="ib_port_state != 4",
                 summary=f"{_WHERE}: InfiniBand port not Active (state {{{{ $value }}}})"),
    ]
    for xid in (*CRITICAL_XIDS, *WARNING_XIDS):
        severity = "critical" if xid in CRITICAL_XIDS else "warning"
        series = f'gpu_xid_events_total{{xid="{xid}"}}'
        # The counter's series is born at 1 with the first Xid, where increase() sees no
        # change: a series that did not exist 10 minutes ago also fires.
        rules.append(_xid_rule(xid, severity,
                               f"increase({series}[10m]) > 0 or "
                               f"({series} unless {series} offset 10m)",
                               f"Xid {xid} in the last 10 minutes"))
    return tuple(rules)


def _dcgm_rules() -> tuple[PromRule, ...]:
    rules = [
        PromRule(kind="row_remap", code="failure", severity="critical",
                 action="service_hardware", expr=_dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE > 0"),
                 summary=f"{_WHERE}: row remapping failed (dcgm-exporter)"),
    ]
    for xid in CRITICAL_XIDS:
        rules.append(_xid_rule(xid, "critical", _dcgm(f"DCGM_FI_DEV_XID_ERRORS == {xid}"),
                               f"last Xid is {xid} (dcgm-exporter; check the kernel log)"))
    return tuple(rules)


def _self_rules() -> tuple[PromRule, ...]:
    return (
        PromRule(kind="gpuhealth", code="notifier_backlog", severity="warning", action="none",
                 for_="15m", expr="max by (notifier) (gpuhealth_outbox_depth) > 0",
                 summary="gpuhealth cannot deliver to notifier {{ $labels.notifier }} "
                         "({{ $value }} queued)"),
    )


def prometheus_rules() -> tuple[PromGroup, ...]:
    """Return the rule groups gpuhealth exports."""
    return (
        PromGroup(name="gpuhealth-gpu", rules=_gpuhealth_rules(),
                  labels={"exporter": "gpuhealth"}),
        PromGroup(name="gpuhealth-dcgm-exporter", rules=_dcgm_rules(),
                  labels={"exporter": "dcgm-exporter"}),
        PromGroup(name="gpuhealth-self", rules=_self_rules(), labels={"exporter": "gpuhealth"}),
    )


def rules_to_json(
    groups: Iterable[PromGroup],
    *,
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL,
    extra_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Return the rule file as a JSON-able object (``{"groups": [...]}``).

    Args:
        groups: Rule groups.
        runbook_base_url: Prefix of ``runbook_url`` (``<base>/<kind>.md``).
        extra_labels: Labels added to every rule (``cluster``).
    """
    out: list[dict[str, Any]] = []
    for group in groups:
        rules: list[dict[str, Any]] = []
        for rule in group.rules:
            labels = {**(extra_labels or {}), **group.labels, "severity": rule.severity,
                      "kind": rule.kind, "code": rule.code}
            annotations = {
                "summary": rule.summary,
                "description": f"{rule.severity} {rule.kind} {rule.code} on "
                               f"{_WHERE} (value {{{{ $value }}}}). Recommended action: "
                               f"{rule.action}. Exported from gpuhealth.",
                "action": rule.action,
                "runbook_url": f"{runbook_base_url.rstrip('/')}/{rule.kind}.md",
            }
            old = legacy_alert_name(rule.kind, rule.code)
            if old is not None:  # a deprecated alias, kept for one release
                annotations["alias"] = old
                annotations["description"] += f" Named {old} before (deprecated alias)."
            rules.append({
                "alert": rule.alert,
                "expr": rule.expr,
                "for": rule.for_,
                "labels": labels,
                "annotations": annotations,
            })
        out.append({"name": group.name, "rules": rules})
    return {"groups": out}


def _yaml(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(item, Mapping | list):
                lines.append(f"{pad}{key}:")
                lines.extend(_yaml(item, indent + 2))
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
    elif isinstance(value, list):
        for item in value:
            sub = _yaml(item, indent + 2)
            if sub:
                sub[0] = f"{pad}- {sub[0].lstrip()}"
            lines.extend(sub)
    else:
        lines.append(f"{pad}{json.dumps(value)}")
    return lines


def render_rules(
    groups: Sequence[PromGroup] | None = None,
    *,
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL,
    extra_labels: Mapping[str, str] | None = None,
) -> str:
    """Return the Prometheus rule file as YAML text.

    Args:
        groups: Rule groups; :func:`prometheus_rules` by default.
        runbook_base_url: Prefix of ``runbook_url``.
        extra_labels: Labels added to every rule (``cluster``).

    Examples:
        >>> text = render_rules()
        >>> text.startswith("# Generated by gpuhealth")
        True
        >>> 'alert: "GpuXid79"' in text
        True
    """
    data = rules_to_json(groups if groups is not None else prometheus_rules(),
                         runbook_base_url=runbook_base_url, extra_labels=extra_labels)
    header = ("# Generated by gpuhealth (gpuhealth rules export); do not edit.\n"
              "# Check with: promtool check rules <file>\n")
    return header + "\n".join(_yaml(data, 0)) + "\n"


def export_rules(
    path: str,
    *,
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL,
    extra_labels: Mapping[str, str] | None = None,
) -> int:
    """Write the rule file to ``path`` (``-`` is not handled here); return the rule count.

    Raises:
        OSError: The file cannot be written.
    """
    groups = prometheus_rules()
    text = render_rules(groups, runbook_base_url=runbook_base_url, extra_labels=extra_labels)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return sum(len(g.rules) for g in groups)

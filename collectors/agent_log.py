"""Monitoring-agent logs that say the agent cannot reach its DCGM host engine.

dcgm-exporter (logrus ``time=... level=error|fatal msg="..."``), ``dcgmi`` (``Error: Unable to
connect to host engine. Host engine connection invalid/disconnected.``), the EKS node
monitoring agent and other agents (zap/JSON lines), and DCGM's Python bindings all print
``dcgmErrorString(DCGM_ST_CONNECTION_NOT_VALID)`` = "Host engine connection
invalid/disconnected" (DCGM ``dcgm_errors.h``/``dcgm_structs.h``) or a failure to connect to
``nv-hostengine`` when the agent's DCGM host engine is down, not started, or not reachable
(``DCGM_REMOTE_HOSTENGINE_INFO``, the socket not mounted). Each such line is a
``monitoring_agent`` event with code ``hostengine_unreachable``: the GPUs are not watched,
which says nothing about their health (``analytics.fault_model.host.monitoring_agent_rule``).
Other lines of the log are left to the other parsers or ignored.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.textparse import Session, line_evidence
from core.records import NODE_ENTITY, Event, Record

_UNREACHABLE = re.compile(
    r"Host engine connection invalid/disconnected"
    r"|unable to establish a connection to the specified host"
    r"|Unable to connect to (?:the )?(?:DCGM )?host ?engine"
    r"|(?:error|failed|unable to|cannot|could not|couldn't) connect(?:ing)? to (?:the )?"
    r"(?:remote )?(?:nv-?hostengine|DCGM host ?engine)"
    r"|DCGM_ST_CONNECTION_NOT_VALID|DCGMError_ConnectionNotValid"
    r"|Failed to connect to (?:the )?DCGM(?: host ?engine| daemon)?\b",
    re.IGNORECASE,
)
_AGENT = re.compile(
    r"dcgm-exporter|dcgmi|nv-hostengine|hostengine|EKSNodeMonitoringAgent|gpud|nvsentinel"
    r"|gpu-health-monitor|DCGM",
    re.IGNORECASE,
)
_LOGRUS = re.compile(r'^time="(?P<ts>[^"]+)" level=(?P<level>\w+) msg=')
_JSON_TS = re.compile(r'"(?:ts|time|timestamp)"\s*:\s*"(?P<ts>\d{4}-\d\d-\d\dT[^"]+)"')
_HOST = re.compile(r"at (?P<host>[\w.:-]+:\d+)")


def _epoch(stamp: str) -> float | None:
    text = stamp.replace("Z", "+00:00")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


class AgentLogSession(Session):
    """Emit one ``monitoring_agent`` event per line that reports the host engine unreachable."""

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each matching line gives its event at once."""
        out: list[Record] = []
        for line in lines:
            text = line.text
            if not _UNREACHABLE.search(text):
                continue
            stamp = _LOGRUS.match(text) or _JSON_TS.search(text)
            at = _epoch(stamp["ts"]) if stamp else None
            attrs = {"agent": self._agent(text)}
            target = _HOST.search(text)
            if target:
                attrs["hostengine"] = target["host"]
            out.append(
                Event(
                    kind="monitoring_agent",
                    code="hostengine_unreachable",
                    node=self.ctx.node,
                    entity=NODE_ENTITY,
                    observed_at=at,
                    message=text.strip()[:300],
                    attrs=attrs,
                    evidence=(line_evidence(self.ctx, line),),
                    source="agent_log",
                )
            )
        return out

    def _agent(self, text: str) -> str:
        command = self.ctx.command or ""
        for name in ("dcgm-exporter", "dcgmi", "EKSNodeMonitoringAgent", "gpud", "nvsentinel"):
            if name.lower() in text.lower() or name.lower() in command.lower():
                return name
        return "unknown"


class AgentLogParser:
    """Logs of GPU monitoring agents (dcgm-exporter, dcgmi, node agents) naming DCGM."""

    kind = "monitoring_agent"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 85 when host-engine connection failures are a good share of the block."""
        sample = lines[:200]
        hits = sum(1 for ln in sample if _UNREACHABLE.search(ln.text))
        if not hits:
            return 0
        if hits * 4 >= len(sample) or (command is not None and _AGENT.search(command)):
            return 85
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return AgentLogSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (AgentLogParser(),)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = ["PARSERS", "AgentLogParser"]

"""Linux NIC bonds: ``/proc/net/bonding/<bond>`` for ``diagnose`` and for the live collector.

The bonding driver (``drivers/net/bonding/bond_procfs.c``, ``bond_info_show_master`` and
``bond_info_show_slave``; kernel ``Documentation/networking/bonding.rst``, "Querying Bonding
Configuration") prints the bond (``Bonding Mode``, ``MII Status``, for 802.3ad the ``Active
Aggregator Info`` with its ``Aggregator ID`` and ``Number of ports``), then one block per
enslaved member (``Slave Interface``, ``MII Status``, ``Link Failure Count``, for 802.3ad its
``Aggregator ID``). A member carries traffic when its MII status is up and, in 802.3ad, it
belongs to the active aggregator.

Both paths give the same samples (entity: the bond), catalogued in ``core/catalog.py``:

* ``net_bond_up``: 1 when the bond's MII status is up;
* ``net_bond_members``: members enslaved to the bond (the configured ones the driver holds);
* ``net_bond_members_active``: members carrying traffic;
* ``net_bond_member_up{interface}``: 1 when that member carries traffic;
* ``net_bond_member_link_failures_total{interface}``: the driver's ``Link Failure Count``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.infiniband import unquote
from collectors.textparse import Session, line_evidence
from core.records import EntityId, Evidence, NodeName, Record, Sample


@dataclass(slots=True)
class BondMember:
    """One enslaved interface as the driver reports it."""

    name: str
    mii_up: bool = False
    link_failures: int | None = None
    aggregator: str | None = None
    evidence: list[Evidence] = field(default_factory=list)


@dataclass(slots=True)
class BondState:
    """One bond: its mode, MII status, active aggregator and members."""

    name: str
    mode: str = ""
    mii_up: bool | None = None
    active_aggregator: str | None = None
    members: list[BondMember] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)

    def active(self, member: BondMember) -> bool:
        """True when ``member`` carries traffic (up, and in the active 802.3ad aggregator)."""
        if not member.mii_up:
            return False
        if self.active_aggregator is None or member.aggregator is None:
            return True
        return member.aggregator == self.active_aggregator


_HEADER = re.compile(r"^Ethernet Channel Bonding Driver:")
_KEY = re.compile(r"^\s*(?P<key>[A-Za-z][\w .()/-]*?):\s*(?P<value>.*?)\s*$")
_BOND_IN_COMMAND = re.compile(r"/proc/net/bonding/(?P<bond>[\w.@*-]+)")
_HEAD_FILE = re.compile(r"^==> /proc/net/bonding/(?P<bond>[\w.@-]+) <==$")


class BondReader:
    """Line-by-line reader of one ``/proc/net/bonding/<bond>`` text."""

    def __init__(self, bond: str) -> None:
        self.state = BondState(name=bond)
        self._member: BondMember | None = None
        self._in_active_aggregator = False

    def line(self, text: str, evidence: Evidence | None = None) -> None:
        """Account for one line (``evidence`` cites it, for artifacts)."""
        key_value = _KEY.match(text)
        if key_value is None:
            return
        key, value = key_value["key"].strip(), key_value["value"]
        state = self.state
        if key == "Slave Interface":
            self._member = BondMember(name=value)
            state.members.append(self._member)
            self._in_active_aggregator = False
            if evidence is not None:
                self._member.evidence.append(evidence)
            return
        if key == "Active Aggregator Info":
            self._in_active_aggregator = True
            return
        member = self._member
        if member is None:
            if key == "Bonding Mode":
                state.mode = value
            elif key == "MII Status":
                state.mii_up = value.lower() == "up"
                if evidence is not None:
                    state.evidence.append(evidence)
            elif key == "Aggregator ID" and self._in_active_aggregator:
                state.active_aggregator = value
            elif key == "Number of ports" and evidence is not None and self._in_active_aggregator:
                state.evidence.append(evidence)
            return
        if key == "MII Status":
            member.mii_up = value.lower() == "up"
        elif key == "Link Failure Count" and value.isdigit():
            member.link_failures = int(value)
        elif key == "Aggregator ID":
            member.aggregator = value
        else:
            return
        if evidence is not None:
            member.evidence.append(evidence)


def bond_samples(
    state: BondState, *, node: NodeName, observed_at: float | None
) -> list[Sample]:
    """Return the samples of one bond (module doc), the same for artifacts and ``run``."""
    entity = EntityId(state.name)
    bond_labels = {"bond": state.name}
    first = state.evidence[0] if state.evidence else None

    def sample(metric: str, value: float, labels: dict[str, str], ev: Evidence | None) -> Sample:
        return Sample(
            metric=metric,
            value=value,
            observed_at=observed_at,
            node=node,
            entity=entity,
            labels=labels,
            evidence=ev,
        )

    out: list[Sample] = []
    if state.mii_up is not None:
        out.append(sample("net_bond_up", 1.0 if state.mii_up else 0.0, bond_labels, first))
    out.append(sample("net_bond_members", float(len(state.members)), bond_labels, first))
    active = [m for m in state.members if state.active(m)]
    out.append(sample("net_bond_members_active", float(len(active)), bond_labels, first))
    for member in state.members:
        labels = {"bond": state.name, "interface": member.name}
        ev = member.evidence[1] if len(member.evidence) > 1 else (
            member.evidence[0] if member.evidence else None
        )
        out.append(
            sample("net_bond_member_up", 1.0 if state.active(member) else 0.0, labels, ev)
        )
        if member.link_failures is not None:
            failure_ev = next(
                (e for e in member.evidence if "Link Failure Count" in e.text), ev
            )
            out.append(
                sample(
                    "net_bond_member_link_failures_total",
                    float(member.link_failures),
                    labels,
                    failure_ev,
                )
            )
    return out


def read_bond(text: str, bond: str, *, node: NodeName, observed_at: float) -> list[Sample]:
    """Return the samples of one ``/proc/net/bonding/<bond>`` file read by the collector."""
    reader = BondReader(bond)
    for raw in text.splitlines():
        reader.line(raw)
    if not reader.state.members and reader.state.mii_up is None:
        return []
    return bond_samples(reader.state, node=node, observed_at=observed_at)


class BondingSession(Session):
    """Parse ``cat /proc/net/bonding/<bond>`` output; one bond a header line."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        found = _BOND_IN_COMMAND.search(ctx.command or "")
        self._name = found["bond"] if found and "*" not in found["bond"] else "bond"
        self._reader: BondReader | None = None
        self._bonds = 0
        self._named = False

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; a bond's samples come when the next bond starts or at close."""
        out: list[Record] = []
        for line in unquote(lines):
            text = line.text
            named = _HEAD_FILE.match(text.strip())
            if named:
                out.extend(self._finish())
                self._name, self._named = named["bond"], True
                continue
            if _HEADER.match(text.strip()):
                out.extend(self._finish())
                self._bonds += 1
                name = self._name
                if self._bonds > 1 and not self._named:
                    name = f"{self._name}#{self._bonds}"  # several bonds, names not printed
                self._named = False
                self._reader = BondReader(name)
                continue
            if self._reader is None:
                self._reader = BondReader(self._name)
            self._reader.line(text, line_evidence(self.ctx, line))
        return out

    def close(self) -> list[Record]:
        """Emit the last bond."""
        return list(self._finish())

    def _finish(self) -> list[Sample]:
        reader, self._reader = self._reader, None
        if reader is None or (not reader.state.members and reader.state.mii_up is None):
            return []
        return bond_samples(reader.state, node=self.ctx.node, observed_at=None)


class BondingParser:
    """``/proc/net/bonding/<bond>`` (Linux bonding driver)."""

    kind = "bonding"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 95 on the driver's header line, 80 on a bond or member block."""
        sample = unquote(lines)[:200]
        texts = [ln.text.strip() for ln in sample]
        if any(_HEADER.match(t) for t in texts[:3]) or any(_HEAD_FILE.match(t) for t in texts[:2]):
            return 95
        members = sum(1 for t in texts if t.startswith("Slave Interface:"))
        mode = any(t.startswith(("Bonding Mode:", "Link Failure Count:")) for t in texts)
        if (members or mode) and (
            any(t.startswith("MII Status:") for t in texts)
            or (command is not None and "/proc/net/bonding" in command)
        ):
            return 80
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return BondingSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (BondingParser(),)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = [
    "PARSERS",
    "BondMember",
    "BondReader",
    "BondState",
    "BondingParser",
    "bond_samples",
    "read_bond",
]

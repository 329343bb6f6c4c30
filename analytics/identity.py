"""One identity per GPU and per port, and which findings are failures the predictor learns.

NVML keys samples by GPU UUID, the kernel log keys Xids by PCI bus id
(``PCI:0000:b1:00``), nvidia-smi and DCGM by index (``gpu:3``), the hardware
inventory by serial. :class:`EntityResolver` learns from the inventory records the
collectors emit, ``gpu_info`` samples (labels ``uuid``, ``pci_bus_id``, ``serial``,
``index``) and ``gpu_identity`` events (entity: the PCI bus id, attr ``uuid``), that
these name one GPU, and maps every alias to one entity: the UUID when it is known
(architecture.md: "GPU UUID, or PCI bus id where the UUID is unknown"), else the PCI
bus id as first seen (a recording keeps its own spelling; the other spellings of that
address resolve to it). InfiniBand ports are ``<device>:<port>`` (``mlx5_0:1``, as
:func:`collectors.infiniband.port_entity` and the port rules name them), whether a
source wrote ``mlx5_0/1`` or gave the device and port as labels.

:func:`failure_kind` says which findings label the predictor's vectors:

* critical findings (a GPU that must leave service);
* port findings that end a port's service although they are ``major``: a port not
  Active (``ib_port`` ``state_*``: down, polling, init) and a flapping link
  (``LinkDownedCounter``);
* thermal findings at ``major`` or worse (a GPU held at its slowdown temperature).

Findings with no numeric precursor (Xid 79 and the other ways a GPU falls off the bus)
are failures too, but nothing in the telemetry foretells them: labelling the day before
them positive teaches the model noise. They are :data:`UNPREDICTABLE` and counted apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from core.ids import gpu_index_entity, normalize_pci_bus_id
from core.records import EntityId, Event, Finding, NodeName, Record, Sample, Severity

PREDICTABLE = "predictable"
"""A failure with numeric precursors: its horizon labels the vectors positive."""

UNPREDICTABLE = "unpredictable"
"""A failure without numeric precursor: not a positive label, counted apart."""

NO_PRECURSOR_CODES = frozenset({
    ("xid", "79"),
    ("gpu_lost", "fallen_off_bus"),
    ("gpu_lost", "gpu_lost"),
    ("gpu_lost", "lost"),
})
"""``(kind, code)`` of findings about a GPU that fell off the bus."""

NO_PRECURSOR_KINDS = frozenset({"gpu_lost", "gpu_init_failure"})
"""Finding kinds that are a GPU gone from the bus whatever their code."""

_PORT_END_CODES = frozenset({"LinkDownedCounter"})


def failure_kind(finding: Finding) -> str | None:
    """Return :data:`PREDICTABLE`, :data:`UNPREDICTABLE` or ``None`` (not a failure).

    Examples:
        >>> from core.records import Action
        >>> def f(kind, code, severity):
        ...     return Finding(node="n", entity="e", kind=kind, code=code, severity=severity,
        ...                    action=Action.NONE, summary="", evidence=(), source="t")
        >>> failure_kind(f("xid", "48", Severity.CRITICAL))
        'predictable'
        >>> failure_kind(f("xid", "79", Severity.CRITICAL))
        'unpredictable'
        >>> failure_kind(f("ib_port", "state_down", Severity.MAJOR))
        'predictable'
        >>> failure_kind(f("ib_port", "port_errors", Severity.WARNING)) is None
        True
    """
    if (finding.kind, finding.code) in NO_PRECURSOR_CODES or finding.kind in NO_PRECURSOR_KINDS:
        return UNPREDICTABLE
    if finding.severity is Severity.CRITICAL:
        return PREDICTABLE
    rank = finding.severity.rank
    if finding.kind == "ib_port" and (
        finding.code.startswith("state_") or finding.code in _PORT_END_CODES
    ):
        return PREDICTABLE
    if finding.kind == "thermal" and rank >= Severity.MAJOR.rank:
        return PREDICTABLE
    return None


def port_identity(entity: str, labels: Mapping[str, str] | None = None) -> EntityId:
    """Return a port's one entity, ``<device>:<port>``.

    Examples:
        >>> port_identity("x", {"device": "mlx5_0", "port": "1"})
        'mlx5_0:1'
        >>> port_identity("mlx5_0/1")
        'mlx5_0:1'
        >>> port_identity("mlx5_0:1")
        'mlx5_0:1'
    """
    if labels:
        device, port = labels.get("device"), labels.get("port")
        if device and port:
            return EntityId(f"{device}:{port}")
    device, sep, port = entity.rpartition("/")
    if sep and device and port and ":" not in device:
        return EntityId(f"{device}:{port}")
    return EntityId(entity)


class EntityResolver:
    """Maps every alias of a GPU (UUID, PCI bus id, index, serial) to one entity per node.

    Feed it every record (:meth:`learn`); only inventory records teach it. Until a GPU's
    inventory is seen its aliases resolve to themselves (a PCI bus id in canonical form).
    """

    def __init__(self) -> None:
        self._alias: dict[tuple[str, str], EntityId] = {}
        self.other_names: dict[tuple[str, str], list[str]] = {}
        """The other names of each GPU the inventory named, by ``(node, entity)``, sorted
        (UUID, PCI bus id, ``gpu:N``, ``serial:S``; not the entity itself)."""

    def __len__(self) -> int:
        return len(self._alias)

    def learn(self, record: Record) -> bool:
        """Learn the aliases an inventory record names; return whether it was one."""
        if isinstance(record, Sample):
            if record.metric != "gpu_info":
                return False
            labels = record.labels
            self._bind(record.node, record.entity, uuid=labels.get("uuid", ""),
                       pci=labels.get("pci_bus_id", ""), serial=labels.get("serial", ""),
                       index=labels.get("index", ""))
            return True
        if isinstance(record, Event) and record.kind == "gpu_identity":
            attrs = record.attrs
            self._bind(record.node, record.entity, uuid=attrs.get("uuid", ""),
                       pci=record.entity, serial=attrs.get("serial", ""),
                       index=attrs.get("index", ""))
            return True
        return False

    def _bind(self, node: NodeName, entity: str, *, uuid: str, pci: str, serial: str,
              index: str) -> None:
        pci_id = normalize_pci_bus_id(pci) if pci else None
        canonical = EntityId(uuid or pci_id or self.gpu(node, entity))
        aliases = {entity, canonical}
        if uuid:
            aliases.add(uuid)
        if pci_id:
            aliases.add(pci_id)
        if serial:
            aliases.add(f"serial:{serial}")
        if index.isdigit():
            aliases.add(gpu_index_entity(index))
        before = {self._alias.get((node, alias)) for alias in aliases} - {None, canonical}
        if before:  # spellings resolved before the inventory named the GPU follow it
            for key, value in self._alias.items():
                if key[0] == node and value in before:
                    self._alias[key] = canonical
        for alias in aliases:
            self._alias[(node, alias)] = canonical
        for old in before:
            if old is not None:
                self.other_names.pop((node, old), None)
        self.other_names[(node, canonical)] = sorted(
            alias for (n, alias), value in self._alias.items()
            if n == node and value == canonical and alias != canonical)

    def gpu(self, node: str, entity: str) -> EntityId:
        """Return the one entity of the GPU ``entity`` names on ``node``."""
        found = self._alias.get((node, entity))
        if found is not None:
            return found
        if ":" in entity and not entity.startswith("gpu:"):
            pci = normalize_pci_bus_id(entity)
            if pci is not None:
                # before the inventory: the first spelling seen of a PCI address is the GPU
                # (a recording's own entity stays as it is), the others resolve to it
                found = self._alias.get((node, pci))
                if found is None:
                    found = self._alias[(node, pci)] = EntityId(entity)
                self._alias[(node, entity)] = found
                return found
        return EntityId(entity)

    def finding(self, finding: Finding) -> EntityId:
        """Return the one entity a finding is about (GPU, port, or as it came)."""
        if finding.kind == "ib_port" or "/" in finding.entity:
            return port_identity(finding.entity)
        return self.gpu(finding.node, finding.entity)

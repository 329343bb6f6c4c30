"""Normalisation of device identifiers seen in logs and tool output.

NVIDIA tools spell one PCI address several ways: ``PCI:0000:b1:00`` in Xid lines,
``0000:b1:00.0`` in NVRM and kernel lines, ``00000000:1A:00.0`` in ``nvidia-smi``
(32-bit domain), ``GPU0000:B1:00.0`` in NVML errors. gpuhealth keys GPUs by the
canonical form ``dddd:bb:dd.f`` (lower case, 16-bit domain, function 0 when absent).
"""

from __future__ import annotations

import re

_PCI = re.compile(
    r"(?:PCI:|GPU)?(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"(?:\.(?P<fn>[0-7]))?"
)


def normalize_pci_bus_id(text: str) -> str | None:
    """Return the canonical PCI bus id found at the start of ``text``, or ``None``.

    Args:
        text: A PCI address in any of NVIDIA's spellings.

    Returns:
        ``dddd:bb:dd.f`` in lower case, or ``None`` if ``text`` holds no address.

    Examples:
        >>> normalize_pci_bus_id("PCI:0000:b1:00")
        '0000:b1:00.0'
        >>> normalize_pci_bus_id("00000000:1A:00.0")
        '0000:1a:00.0'
        >>> normalize_pci_bus_id("GPU0000:B1:00.0")
        '0000:b1:00.0'
        >>> normalize_pci_bus_id("no address") is None
        True
    """
    match = _PCI.search(text)
    if match is None:
        return None
    domain = match["domain"][-4:].lower()
    return f"{domain}:{match['bus'].lower()}:{match['dev'].lower()}.{match['fn'] or '0'}"


def gpu_index_entity(index: int | str) -> str:
    """Return the entity id of a GPU known only by its index (``nvidia-smi``/DCGM GPU id).

    Used where neither a UUID nor a PCI bus id appears in the input.

    Examples:
        >>> gpu_index_entity(1)
        'gpu:1'
    """
    return f"gpu:{int(index)}"

"""Checks of names a person types: node names, entity names, free text for the audit trail.

A node name follows the Kubernetes node-name rule (an RFC 1123 DNS subdomain: at most
253 characters, dot-separated labels of at most 63 letters, digits and ``-`` that start
and end with a letter or digit), which every Slurm ``NodeName`` of a real cluster meets
too. Letters may be upper case (Slurm keeps the case it was given; hostnames compare
without it). Nothing else gets in: no glob or hostlist characters (``*``, ``?``,
``[``), no path (``../``), no white space or control character.
"""

from __future__ import annotations

import re
import unicodedata

MAX_NODE_NAME = 253
"""Longest node name (an RFC 1123 subdomain)."""

MAX_ENTITY = 253
"""Longest entity name (a PCI address, a GPU UUID, a port)."""

MAX_TEXT = 2000
"""Longest free text (a reason, a name of a person)."""

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


def _shown(text: str) -> str:
    """``text`` for a message: quoted with escapes, cut to 60 characters."""
    return repr(text if len(text) <= 60 else text[:57] + "...")


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character (a newline, an escape, NUL...)."""
    return any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in text)


def node_name_problem(name: str) -> str | None:
    """Return why ``name`` is not a node name, or ``None`` when it is one.

    Examples:
        >>> node_name_problem("gpu-017") is None
        True
        >>> node_name_problem("gpu-01?") is None
        False
    """
    if not name:
        return "a node name is required"
    if len(name) > MAX_NODE_NAME:
        return f"a node name is at most {MAX_NODE_NAME} characters, got {len(name)}"
    if has_control(name):
        return f"{_shown(name)} is not a node name: it holds a control character"
    if not all(_LABEL.fullmatch(label) for label in name.split(".")):
        return (f"{_shown(name)} is not a node name: letters, digits, '-' and '.' only "
                "(an RFC 1123 subdomain, as Kubernetes and Slurm name nodes)")
    return None


def entity_problem(entity: str) -> str | None:
    """Return why ``entity`` is not an entity name, or ``None`` when it is one.

    An entity is a PCI address (``0000:b1:00.0``), a GPU UUID, a port (``mlx5_0/1``).
    """
    if not entity:
        return "an entity name is required (or leave it out for the whole node)"
    if len(entity) > MAX_ENTITY:
        return f"an entity name is at most {MAX_ENTITY} characters, got {len(entity)}"
    if has_control(entity) or not _ENTITY.fullmatch(entity.replace("_", "-")):
        return (f"{_shown(entity)} is not an entity name: a PCI address, GPU UUID or "
                "port (letters, digits and . _ : / @ + -)")
    return None


def text_problem(what: str, text: str) -> str | None:
    """Return why ``text`` cannot go into the audit trail as ``what``, or ``None``."""
    if len(text) > MAX_TEXT:
        return f"{what}: at most {MAX_TEXT} characters, got {len(text)}"
    if has_control(text):
        return f"{what}: no control characters (newlines, escapes)"
    return None

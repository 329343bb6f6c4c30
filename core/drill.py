"""The drill marker, readable by every stage (``remediation.drill`` runs the drills).

A drill's fault is a kernel-log line that ends with ``gpuhealth-drill=<id>``. That
marker travels in the evidence of the event and of the finding made from it, so each
stage can tell a drill from a real fault without any other channel: the alert gets the
label ``drill=<id>`` (:func:`alerting.alerts.alert_labels`), remediation marks its steps
``attrs["drill"]`` and never hands the node to hardware service, and the incident
history row gets ``attrs["drill"]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from core.records import Evidence

DRILL = "drill"
"""The marker's key: alert label, step attribute, audit detail, history attribute."""

MARK = "gpuhealth-drill"
"""Written at the end of the injected kernel-log line as ``gpuhealth-drill=<id>``."""

ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
"""A drill id: letters, digits and ``_.-``, 63 at most (a label value, a file name)."""

_MARKED = re.compile(rf"(?:^|\s){MARK}=({ID_PATTERN})\s*$")


def drill_of_text(text: str) -> str:
    """Return the drill id a line ends with (``... gpuhealth-drill=<id>``), or ``""``.

    Examples:
        >>> drill_of_text("NVRM: Xid (PCI:0000:b1:00): 79, ... gpuhealth-drill=d1")
        'd1'
        >>> drill_of_text("NVRM: Xid (PCI:0000:b1:00): 79, GPU has fallen off the bus.")
        ''
    """
    if MARK not in text:  # the common case, cheap
        return ""
    match = _MARKED.search(text)
    return match[1] if match else ""


def drill_of_evidence(evidence: Sequence[Evidence]) -> str:
    """Return the drill id of ``evidence``'s latest line, or ``""`` when it is unmarked.

    The latest line decides (a finding keeps its first lines, then the latest): a second
    drill of the same fault on the same GPU is the newest drill, and a real occurrence
    after a drill makes the finding real again (it is then handled as a real fault, with
    the hand-off a drill never makes), never hidden as a drill.
    """
    return drill_of_text(evidence[-1].text) if evidence else ""

"""The agent's drill inbox: marked kernel-log lines a drill drops into ``<data_dir>/drill-inbox``.

``gpuhealth drill inject`` (or ``gpuhealth drill --fleet``) writes one file per drill,
``<data_dir>/drill-inbox/<id>.line``, holding one kernel-log line that ends with
``gpuhealth-drill=<id>`` (:mod:`core.drill`). The running ``gpuhealth agent`` polls the
folder (every second) and reads each file with the real kernel-log parser
(:func:`collectors.kernel_log.parse_kernel_lines`), so what it detects is what it would
detect in the kernel log; the events then go the way real ones go (fault model, outbox,
controller, alert, remediation), the marker in their evidence all the way.

A file is refused, never read into a fault, when it is larger than
:data:`MAX_BYTES`, not UTF-8 text, not exactly one line, when the line does not end
with the drill marker (the inbox is no way to fake a real fault), when the parser finds
no fault in it, or when it names another node. A refused file is renamed
``<name>.refused`` beside ``<name>.why`` (the reason) and logged at ERROR; a taken one is
renamed ``<name>.taken``. Nothing here raises into the agent: a file that cannot even be
renamed is remembered and skipped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from collectors.artifact import ParseContext
from collectors.kernel_log import parse_kernel_lines
from core.drill import drill_of_evidence, drill_of_text
from core.records import Event, NodeName, Record

logger = logging.getLogger(__name__)

INBOX = "drill-inbox"
"""The inbox folder inside the agent's ``[node] data_dir``."""

MAX_BYTES = 4096
"""Largest file taken (one kernel-log line)."""

SOURCE = "kernel_log"
"""The events' source, as the kernel-log collector's."""


class DrillRefused(ValueError):
    """An inbox file that is not a marked drill line (the message says why)."""


def read_drill_line(data: bytes, *, node: str, name: str,
                    clock: Callable[[], float] = time.time) -> list[Event]:
    """Return the events of one inbox file's content, read by the kernel-log parser.

    Args:
        data: The file's bytes.
        node: This agent's node (every event must be about it).
        name: The file's name (the events' evidence file is ``drill-inbox/<name>``).
        clock: Stamps events whose line carries no time.

    Raises:
        DrillRefused: Why the content is no marked drill line.
    """
    if len(data) > MAX_BYTES:
        raise DrillRefused(f"{len(data)} bytes: a drill line has at most {MAX_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DrillRefused("not UTF-8 text") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise DrillRefused(f"{len(lines)} lines: a drill file holds exactly one "
                           "kernel-log line")
    line = lines[0]
    drill = drill_of_text(line)
    if not drill:
        raise DrillRefused("the line does not end with gpuhealth-drill=<id>: only a line "
                           "marked as a drill is taken (the inbox never fakes a real fault)")
    ctx = ParseContext(file=f"{INBOX}/{name}", node=NodeName(node))
    events = list(parse_kernel_lines([line], ctx))
    if not events:
        raise DrillRefused("the kernel-log parser finds no fault in the line")
    now = clock()
    out: list[Event] = []
    for event in events:
        if event.node != node:
            raise DrillRefused(f"the line is about node {event.node!r}, this agent is "
                               f"{node!r}")
        if drill_of_evidence(event.evidence) != drill:
            raise DrillRefused("the parsed event lost the drill marker")
        out.append(replace(event, observed_at=now if event.observed_at is None
                           else event.observed_at, source=event.source or SOURCE))
    return out


class DrillInbox:
    """The agent's drill inbox as a polling collector (module docstring).

    Args:
        node: This agent's node.
        folder: The inbox (``<data_dir>/drill-inbox``), created when missing.
        clock: Stamps events whose line carries no time.

    Attributes:
        taken: Drill files read into events so far.
        refused: Drill files refused so far.
    """

    name = "drill_inbox"

    def __init__(self, *, node: str, folder: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.folder = Path(folder)
        self.clock = clock
        self.taken = 0
        self.refused = 0
        self._stuck: set[str] = set()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("drill inbox %s cannot be created: %s (no drills on this agent)",
                           self.folder, exc)

    def collect(self) -> list[Record]:
        """Return the events of the drill files dropped since the last call."""
        try:
            paths = sorted(p for p in self.folder.glob("*.line") if p.is_file())
        except OSError:
            return []
        out: list[Record] = []
        for path in paths:
            if path.name in self._stuck:
                continue
            try:
                events = read_drill_line(path.read_bytes()[:MAX_BYTES + 1], node=self.node,
                                         name=path.name, clock=self.clock)
            except DrillRefused as exc:
                self._refuse(path, str(exc))
                continue
            except Exception as exc:  # unreadable, vanished: refused, never raised
                self._refuse(path, f"cannot be read: {exc}")
                continue
            if self._move(path, path.with_suffix(".taken")):
                self.taken += 1
                logger.warning("drill inbox: %s taken: %d event(s) marked drill %s",
                               path.name, len(events), drill_of_evidence(events[0].evidence))
                out.extend(events)
        return out

    def _refuse(self, path: Path, why: str) -> None:
        self.refused += 1
        logger.error("drill inbox: %s refused: %s", path.name, why)
        with contextlib.suppress(OSError):
            path.with_suffix(".why").write_text(why + "\n", encoding="utf-8")
        self._move(path, path.with_suffix(".refused"))

    def _move(self, path: Path, target: Path) -> bool:
        try:
            path.replace(target)
        except OSError as exc:
            logger.error("drill inbox: %s cannot be moved aside (%s); skipped from now on",  # noqa: TRY400
                         path.name, exc)
            self._stuck.add(path.name)
            return False
        return True

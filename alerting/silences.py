"""Silences with Alertmanager-style matchers, kept in a durable JSON file.

A matcher is written as amtool and Alertmanager write it (``docs/ecosystem-reference.md``
§3.6): ``name=value``, ``name!=value``, ``name=~regex`` or ``name!~regex``; values may
be double-quoted. Regular expressions are anchored at both ends, as Alertmanager
anchors them. A silence mutes every alert whose labels satisfy all of its matchers
between ``starts_at`` and ``ends_at`` (epoch seconds); it is ``pending`` before,
``active`` between and ``expired`` after, the three states Alertmanager reports.

:class:`SilenceStore` keeps silences in one JSON file, written atomically (a
temporary file then ``os.replace``), and re-reads it when another process (the CLI
while ``gpuhealth run`` is up) changed it, so that silences made from the CLI and
from the HTTP API are the same silences. Expired silences are kept for
``retention_seconds`` (5 days, Alertmanager's ``--data.retention``) and then dropped.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from alerting.alerts import alert_names
from core.clock import Clock, system_clock
from core.errors import TemporaryError
from storage.sql import PostgresDatabase, is_postgres, server_of

logger = logging.getLogger(__name__)

DEFAULT_RETENTION_SECONDS = 5 * 86400.0
"""How long an expired silence is kept (Alertmanager's default ``--data.retention`` 120 h)."""

_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MATCHER = re.compile(
    r"^\s*(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*(?P<value>.*?)\s*$"
)


class MatchOp(StrEnum):
    """Matcher operators (Alertmanager's ``isEqual`` and ``isRegex`` flags)."""

    EQUAL = "="
    NOT_EQUAL = "!="
    REGEX = "=~"
    NOT_REGEX = "!~"


@dataclass(frozen=True, slots=True, kw_only=True)
class Matcher:
    """One label matcher.

    Attributes:
        name: Label name.
        op: Operator.
        value: Literal value, or a regular expression for ``=~`` and ``!~``
            (anchored at both ends).
    """

    name: str
    op: MatchOp
    value: str
    # worked out once: inhibition matches every firing alert against every rule (a new
    # leader's first round: 10^4 alerts), and the operator's tuple tests were its hot spot
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False,
                                             compare=False)
    _equal: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _LABEL_NAME.match(self.name):
            raise ValueError(f"invalid label name {self.name!r}")
        if self.op in (MatchOp.REGEX, MatchOp.NOT_REGEX):
            try:
                object.__setattr__(self, "_pattern", _compiled(self.value))
            except re.error as exc:
                raise ValueError(f"invalid regular expression {self.value!r}: {exc}") from exc
        object.__setattr__(self, "_equal", self.op in (MatchOp.EQUAL, MatchOp.REGEX))

    @property
    def is_regex(self) -> bool:
        """Whether the value is a regular expression."""
        return self._pattern is not None

    @property
    def is_equal(self) -> bool:
        """Whether the matcher selects matching labels (``=``, ``=~``) rather than others."""
        return self._equal

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Return whether ``labels`` satisfy the matcher (a missing label is the empty string).

        Examples:
            >>> Matcher(name="node", op=MatchOp.REGEX, value="gpu-0[0-9]+").matches(
            ...     {"node": "gpu-017"})
            True
            >>> Matcher(name="severity", op=MatchOp.NOT_EQUAL, value="info").matches({})
            True
        """
        if self.name == "alertname":
            # a renamed alert still answers to its old name for one release
            # (alerting.alerts.legacy_alert_name): = and =~ select it by either name,
            # != and !~ only when neither name is excluded
            verdicts = [self._verdict(name) for name in alert_names(labels)]
            return any(verdicts) if self.is_equal else all(verdicts)
        return self._verdict(labels.get(self.name, ""))

    def _verdict(self, actual: str) -> bool:
        pattern = self._pattern
        hit = (pattern.fullmatch(actual) is not None if pattern is not None
               else actual == self.value)
        return hit if self._equal else not hit

    def __str__(self) -> str:
        return f"{self.name}{self.op.value}{json.dumps(self.value)}"

    def to_alertmanager(self) -> dict[str, Any]:
        """Return the matcher as Alertmanager API v2 writes it (``isRegex``, ``isEqual``)."""
        return {
            "name": self.name,
            "value": self.value,
            "isRegex": self.is_regex,
            "isEqual": self.is_equal,
        }

    @classmethod
    def from_alertmanager(cls, data: Mapping[str, Any]) -> Matcher:
        """Build a matcher from Alertmanager API v2 JSON (``isEqual`` defaults to true).

        Raises:
            ValueError: Missing or invalid fields.
        """
        try:
            name, value = str(data["name"]), str(data["value"])
        except KeyError as exc:
            raise ValueError(f"matcher without {exc.args[0]!r}") from None
        regex = bool(data.get("isRegex", False))
        equal = bool(data.get("isEqual", True))
        op = {
            (False, True): MatchOp.EQUAL,
            (False, False): MatchOp.NOT_EQUAL,
            (True, True): MatchOp.REGEX,
            (True, False): MatchOp.NOT_REGEX,
        }[(regex, equal)]
        return cls(name=name, op=op, value=value)


_REGEX_CACHE: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    found = _REGEX_CACHE.get(pattern)
    if found is None:
        if len(_REGEX_CACHE) > 1024:
            _REGEX_CACHE.clear()
        found = _REGEX_CACHE[pattern] = re.compile(pattern)
    return found


def parse_matcher(text: str) -> Matcher:
    """Parse one matcher written as amtool writes it.

    Args:
        text: ``name=value``, ``name!=value``, ``name=~regex`` or ``name!~regex``;
            the value may be double-quoted (JSON escapes apply inside quotes).

    Returns:
        The matcher.

    Raises:
        ValueError: Not a matcher, an invalid label name or an invalid regex.

    Examples:
        >>> str(parse_matcher('node=~"gpu-0.*"'))
        'node=~"gpu-0.*"'
        >>> parse_matcher("severity!=info").op
        <MatchOp.NOT_EQUAL: '!='>
    """
    match = _MATCHER.match(text)
    if match is None:
        raise ValueError(f"not a matcher: {text!r} (write name=value, name!=value, "
                         "name=~regex or name!~regex)")
    value = match["value"]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"bad quoted value in matcher {text!r}") from exc
    return Matcher(name=match["name"], op=MatchOp(match["op"]), value=value)


def parse_matchers(texts: Iterable[str]) -> tuple[Matcher, ...]:
    """Parse several matchers; a ``{a="1",b="2"}`` selector is split into its matchers too.

    Raises:
        ValueError: No matcher at all, or one that does not parse.

    Examples:
        >>> [str(m) for m in parse_matchers(['{node="a", severity=~"major|critical"}'])]
        ['node="a"', 'severity=~"major|critical"']
    """
    out: list[Matcher] = []
    for text in texts:
        text = text.strip()
        if text.startswith("{") and text.endswith("}"):
            out.extend(parse_matcher(part) for part in _split_selector(text[1:-1]))
        elif text:
            out.append(parse_matcher(text))
    if not out:
        raise ValueError("a silence needs at least one matcher")
    return tuple(out)


def _split_selector(body: str) -> list[str]:
    """Split ``a="x,y", b=~"z"`` on the commas outside quotes."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for ch in body:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return [p for p in parts if p.strip()]


def matches_all(matchers: Sequence[Matcher], labels: Mapping[str, str]) -> bool:
    """Return whether ``labels`` satisfy every matcher."""
    return all(m.matches(labels) for m in matchers)


class SilenceState(StrEnum):
    """Where a silence stands (Alertmanager's states)."""

    PENDING = "pending"
    ACTIVE = "active"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True, kw_only=True)
class Silence:
    """A silence: mute matching alerts between two times.

    Attributes:
        id: Unique id (a UUID, as Alertmanager's).
        matchers: All must match for an alert to be muted.
        starts_at: Epoch seconds it takes effect.
        ends_at: Epoch seconds it ends; expiring sets it to now.
        created_by: Who made it.
        comment: Why.
        updated_at: Epoch seconds of the last change.
    """

    id: str
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float
    created_by: str
    comment: str
    updated_at: float

    def state(self, now: float) -> SilenceState:
        """Return the state at ``now`` (epoch seconds)."""
        if now < self.starts_at:
            return SilenceState.PENDING
        if now < self.ends_at:
            return SilenceState.ACTIVE
        return SilenceState.EXPIRED

    def mutes(self, labels: Mapping[str, str], now: float) -> bool:
        """Return whether the silence is active at ``now`` and matches ``labels``."""
        return self.starts_at <= now < self.ends_at and matches_all(self.matchers, labels)

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """Return the silence as JSON (times in epoch seconds; ``state`` when ``now`` is given)."""
        out: dict[str, Any] = {
            "id": self.id,
            "matchers": [m.to_alertmanager() for m in self.matchers],
            "starts_at": self.starts_at,
            "ends_at": self.ends_at,
            "created_by": self.created_by,
            "comment": self.comment,
            "updated_at": self.updated_at,
        }
        if now is not None:
            out["state"] = self.state(now).value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Silence:
        """Build a silence from :meth:`to_json` output.

        Raises:
            ValueError: Missing or invalid fields.
        """
        try:
            return cls(
                id=str(data["id"]),
                matchers=tuple(Matcher.from_alertmanager(m) for m in data["matchers"]),
                starts_at=float(data["starts_at"]),
                ends_at=float(data["ends_at"]),
                created_by=str(data.get("created_by", "")),
                comment=str(data.get("comment", "")),
                updated_at=float(data.get("updated_at", data["starts_at"])),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"invalid silence: {exc}") from exc


class SilenceStore:
    """Silences in one JSON file, shared by the CLI, the HTTP API and the pipeline.

    A controller pair shares them in PostgreSQL instead (table ``silences``, one row per
    silence with its JSON; written in one transaction per change and read back at every
    look, so a silence made through one replica mutes on both).

    Args:
        path: The JSON file, a PostgreSQL DSN (a controller pair), or ``None`` to keep
            silences in memory only (tests, replay).
        clock: Returns now, epoch seconds.
        retention_seconds: Expired silences are dropped after this long, seconds.

    Raises:
        ValueError: ``retention_seconds`` is negative.
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike[str] | None = None,
        clock: Clock = system_clock,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
    ) -> None:
        if retention_seconds < 0:
            raise ValueError(f"retention_seconds must be >= 0, got {retention_seconds!r}")
        self.path = path
        self.clock = clock
        self.retention_seconds = retention_seconds
        self._path = Path(path) if path is not None else None
        self._lock = threading.RLock()
        self._silences: dict[str, Silence] = {}
        self._mtime_ns: int | None = None
        self._db: Any = None
        if path is not None and is_postgres(str(path)):
            self._path = None
            self._db = PostgresDatabase(str(path), component="silences", pool_size=1)
        self._load()

    # --- persistence -------------------------------------------------------------------

    def _load(self) -> None:
        if self._db is not None:
            try:
                rows = self._db.execute("SELECT body FROM silences")
                self._silences = {s.id: s for s in
                                  (Silence.from_json(json.loads(r[0])) for r in rows)}
            except (TemporaryError, ValueError) as exc:
                logger.error("silences in %s unreadable, keeping the last good copy: %s",  # noqa: TRY400
                             server_of(str(self.path)), exc)
            return
        if self._path is None:
            return
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            self._silences = {}
            self._mtime_ns = None
            return
        if stat.st_mtime_ns == self._mtime_ns:
            return
        try:
            data = json.loads(self._path.read_text(encoding="utf-8") or "[]")
            silences = [Silence.from_json(item) for item in data]
        except (OSError, ValueError) as exc:
            logger.error(  # noqa: TRY400 (expected: no traceback)
                "silences file %s unreadable, keeping the last good copy: %s", self._path, exc
            )
            return
        self._silences = {s.id: s for s in silences}
        self._mtime_ns = stat.st_mtime_ns

    def _save(self) -> None:
        if self._db is not None:
            with self._db.transaction() as db:
                kept = list(self._silences.values())
                db.execute("DELETE FROM silences")
                for silence in kept:
                    db.execute("INSERT INTO silences (id, body, updated_at) VALUES (?, ?, ?)",
                               (silence.id, json.dumps(silence.to_json()), silence.updated_at))
            return
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps([s.to_json() for s in self._silences.values()], indent=1)
        fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".silences-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self._path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._mtime_ns = self._path.stat().st_mtime_ns

    def _gc(self, now: float) -> bool:
        old = [s.id for s in self._silences.values()
               if s.ends_at + self.retention_seconds < now]
        for key in old:
            del self._silences[key]
        return bool(old)

    # --- operations --------------------------------------------------------------------

    def add(
        self,
        matchers: Sequence[Matcher],
        *,
        duration_seconds: float | None = None,
        starts_at: float | None = None,
        ends_at: float | None = None,
        created_by: str,
        comment: str,
        silence_id: str | None = None,
    ) -> Silence:
        """Create a silence, or replace silence ``silence_id`` (as Alertmanager's update).

        Args:
            matchers: At least one.
            duration_seconds: Length from ``starts_at``; alternative to ``ends_at``.
            starts_at: Epoch seconds; now by default.
            ends_at: Epoch seconds; ``starts_at + duration_seconds`` by default.
            created_by: Who makes it (required, as in Alertmanager).
            comment: Why (required, as in Alertmanager).
            silence_id: Update this silence instead of creating one.

        Returns:
            The stored silence.

        Raises:
            ValueError: No matcher, no author or comment, an end not after the start,
                neither ``duration_seconds`` nor ``ends_at``, or an unknown ``silence_id``.
        """
        now = self.clock()
        if not matchers:
            raise ValueError("a silence needs at least one matcher")
        if not created_by.strip() or not comment.strip():
            raise ValueError("a silence needs created_by and comment")
        start = now if starts_at is None else starts_at
        if ends_at is None:
            if duration_seconds is None:
                raise ValueError("give duration_seconds or ends_at")
            ends_at = start + duration_seconds
        if ends_at <= start:
            raise ValueError("a silence must end after it starts")
        if all(m.matches({}) for m in matchers):
            raise ValueError("at least one matcher must not match the empty label set "
                             "(a silence would mute every alert)")
        with self._lock:
            self._load()
            if silence_id is not None and silence_id not in self._silences:
                raise ValueError(f"no silence {silence_id!r}")
            silence = Silence(
                id=silence_id or str(uuid.uuid4()),
                matchers=tuple(matchers),
                starts_at=start,
                ends_at=ends_at,
                created_by=created_by,
                comment=comment,
                updated_at=now,
            )
            self._silences[silence.id] = silence
            self._gc(now)
            self._save()
        logger.info("silence %s until %.0f by %s: %s", silence.id, silence.ends_at, created_by,
                    " ".join(map(str, silence.matchers)))
        return silence

    def expire(self, silence_id: str) -> Silence:
        """End silence ``silence_id`` now (a pending one ends before it starts).

        Raises:
            KeyError: No such silence.
        """
        now = self.clock()
        with self._lock:
            self._load()
            silence = self._silences[silence_id]
            if silence.state(now) is not SilenceState.EXPIRED:
                start = min(silence.starts_at, now)
                silence = replace(silence, starts_at=start, ends_at=now, updated_at=now)
                self._silences[silence_id] = silence
                self._save()
        logger.info("silence %s expired", silence_id)
        return silence

    def get(self, silence_id: str) -> Silence | None:
        """Return silence ``silence_id`` or ``None``."""
        with self._lock:
            self._load()
            return self._silences.get(silence_id)

    def list_silences(self, *, state: SilenceState | None = None) -> list[Silence]:
        """Return the silences (in one ``state`` if given), newest first."""
        now = self.clock()
        with self._lock:
            self._load()
            found = [s for s in self._silences.values()
                     if state is None or s.state(now) is state]
        return sorted(found, key=lambda s: (-s.updated_at, s.id))

    def active(self) -> list[Silence]:
        """Return the silences in effect now."""
        return self.list_silences(state=SilenceState.ACTIVE)

    def muting(self, labels: Mapping[str, str], silences: Sequence[Silence] | None = None
               ) -> list[str]:
        """Return the ids of the active silences that mute ``labels``."""
        now = self.clock()
        pool = self.active() if silences is None else silences
        return [s.id for s in pool if s.mutes(labels, now)]


def format_silences(silences: Sequence[Silence], now: float) -> str:
    """Return silences as a table for the CLI: id, state, end (UTC), author, matchers, comment.

    Examples:
        >>> print(format_silences([], 0.0), end="")
        no silences
    """
    if not silences:
        return "no silences\n"
    lines = [f"{'ID':36}  {'STATE':8}  {'ENDS (UTC)':20}  {'BY':12}  MATCHERS  COMMENT"]
    for s in silences:
        ends = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.ends_at))
        matchers = ",".join(map(str, s.matchers))
        lines.append(f"{s.id:36}  {s.state(now).value:8}  {ends:20}  {s.created_by[:12]:12}  "
                     f"{{{matchers}}}  {s.comment}")
    return "\n".join(lines) + "\n"

"""A scheduler adapter that POSTs each remediation step to an external automation endpoint.

Entry point ``webhook`` (``docs/remediation-webhook.md``). :class:`WebhookScheduler`
writes every :class:`~core.records.ActionRequest` to a durable SQLite outbox first,
then delivers it as one JSON POST, signed per Standard Webhooks 1.0
(``docs/ecosystem-reference.md`` §7.3, the same signing as the alert webhook:
:func:`alerting.webhook.sign`):

* ``webhook-id``: the request's ``idempotency_key`` (the same on every retry, so the
  receiver dedupes on it); ``webhook-timestamp``: Unix seconds of this attempt;
  ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` with
  the ``whsec_<base64>`` secret.
* body (Standard Webhooks payload shape, ``type``/``timestamp``/``data``)::

      {"type": "gpuhealth.action.requested", "timestamp": "<RFC 3339, enqueued>",
       "data": {"ref", "step", "node", "entity", "reason", "idempotency_key",
                "dry_run", "not_before_at", "attrs"},
       "status_url": "<api>/api/v1/actions/<ref>/status"}   (when configured)

Answers (per attempt): 2xx delivered; 408, 429, 5xx, a connection error or a timeout
is retried with capped, jittered exponential back-off (at least ``Retry-After`` when
the receiver sends one); 3xx and any other 4xx fail the action for good. Delivery is
in order: the oldest undelivered action blocks the younger ones until it is delivered
or failed (a receiver that is down gets them all later, in the order they were asked
for). An action still undelivered after ``give_up_after_seconds`` fails.

:meth:`WebhookScheduler.status` reports ``pending`` while the action is queued,
``succeeded`` once delivered (the receiver acknowledged it) or, with
``await_completion``, ``running`` until the receiver reports its outcome through
``POST /api/v1/actions/{ref}/status`` on gpuhealth's API (:meth:`WebhookScheduler.report`),
and ``failed`` after a permanent refusal. Delivery is driven by :meth:`submit` and
:meth:`status` (each first delivers what is due) and by :meth:`deliver` for a
service loop; everything survives a restart (the same SQLite file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sqlite3
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from alerting.alertmanager import rfc3339
from alerting.webhook import _retry_after, _ssl_context, secret_key, sign
from core.clock import Clock, system_clock
from core.errors import ConfigError, PermanentError, SchedulerUnavailable
from core.records import ActionPhase, ActionRequest, ActionStatus

logger = logging.getLogger(__name__)

EVENT_TYPE = "gpuhealth.action.requested"
"""The ``type`` of every action message."""

REF_PREFIX = "webhook-"

_TERMINAL = frozenset({ActionPhase.SUCCEEDED, ActionPhase.FAILED, ActionPhase.CANCELLED})
_REPORTABLE = frozenset({ActionPhase.RUNNING, *_TERMINAL})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS actions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ref TEXT NOT NULL UNIQUE,
    idempotency_key TEXT NOT NULL UNIQUE,
    body TEXT NOT NULL,
    phase TEXT NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL DEFAULT 0,
    enqueued_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    reported INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS actions_undelivered ON actions (delivered, seq);
"""


def resolve_secret(
    *,
    secret: str | None,
    secret_env: str | None,
    secret_file: str | None,
    what: str,
    env: Mapping[str, str] | None = None,
) -> str:
    """Return a signing secret given as a value, an environment variable or a file.

    Configuration files name where the secret is (``secret_env``, ``secret_file``) and
    never hold it; tests and programs may pass the value itself (``secret``).

    Args:
        secret: The secret's value.
        secret_env: Name of the environment variable holding it.
        secret_file: File whose first line holds it.
        what: The adapter's name, for errors.
        env: The environment (``os.environ`` by default).

    Raises:
        ConfigError: Not exactly one source given, an unset variable, an unreadable or
            empty file; the message names the key, never the value.
    """
    given = [k for k, v in (("secret", secret), ("secret_env", secret_env),
                            ("secret_file", secret_file)) if v]
    if len(given) != 1:
        raise ConfigError(f"{what}: set exactly one of secret, secret_env, secret_file "
                          f"(got {', '.join(given) or 'none'})")
    if secret:
        return secret
    if secret_env:
        value = (env if env is not None else os.environ).get(secret_env, "").strip()
        if not value:
            raise ConfigError(f"{what}: secret_env: environment variable {secret_env!r} "
                              "is not set")
        return value
    assert secret_file is not None
    try:
        lines = Path(secret_file).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{what}: secret_file: cannot read {secret_file!r}: "
                          f"{exc.strerror}") from None
    if not lines or not lines[0].strip():
        raise ConfigError(f"{what}: secret_file: {secret_file!r} is empty")
    return lines[0].strip()


def node_agent_key(url_template: str, *, secret: str | None, secret_env: str | None,
                   secret_file: str | None, what: str) -> bytes:
    """Check a node agent's URL template and return the key that signs requests to it.

    The GPU-reset, validation and bundle clients of the node agent share this check.

    Raises:
        ConfigError: The template is not an http(s) URL with ``{node}``, or the secret is
            missing, unreadable or malformed (names ``what``).
    """
    if "{node}" not in url_template or not url_template.startswith(("http://", "https://")):
        raise ConfigError(f"url_template must be an http(s) URL with {{node}}, "
                          f"got {url_template!r}")
    value = resolve_secret(secret=secret, secret_env=secret_env, secret_file=secret_file,
                           what=what)
    try:
        return secret_key(value)
    except ValueError as exc:
        raise ConfigError(f"node agent secret: {exc}") from None


def action_ref(idempotency_key: str) -> str:
    """Return the ref of an action: ``webhook-`` + 20 hex digits of SHA-256 of its key.

    Deterministic, so a resubmission after a restart finds the same action, and safe in
    a URL path (``/api/v1/actions/{ref}/status``) whatever the key holds.

    Examples:
        >>> action_ref("3afbb2cf3bce01b7/cordon")
        'webhook-370d49e275cfa453dd78'
    """
    return REF_PREFIX + hashlib.sha256(idempotency_key.encode("utf-8")).hexdigest()[:20]


def request_to_json(request: ActionRequest, ref: str) -> dict[str, Any]:
    """Return the ``data`` object of an action message."""
    return {
        "ref": ref,
        "step": request.step.value,
        "node": request.node,
        "entity": request.entity,
        "reason": request.reason,
        "idempotency_key": request.idempotency_key,
        "dry_run": request.dry_run,
        "not_before_at": request.not_before_at,
        "attrs": dict(request.attrs),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliveryRound:
    """What one :meth:`WebhookScheduler.deliver` call did.

    Attributes:
        delivered: Actions the receiver acknowledged (2xx).
        failed: Actions refused for good (or given up).
        deferred: Whether the head of the queue is waiting for a retry.
    """

    delivered: int = 0
    failed: int = 0
    deferred: bool = False


class WebhookScheduler:
    """Carries out remediation steps by POSTing them, signed, to an automation endpoint.

    Args:
        url: ``http://`` or ``https://`` endpoint of the external automation.
        secret: Standard Webhooks secret, ``whsec_<base64>`` (a plain string is used as
            its UTF-8 bytes).
        secret_env: Or the environment variable holding it (for configuration files).
        secret_file: Or the file whose first line holds it.
        path: SQLite file of the outbox (created with its folder), or ``None`` for an
            in-memory one (tests, replays): lost at exit.
        status_url_base: gpuhealth's API base URL; when given, each message carries
            ``status_url`` where the receiver may report the outcome.
        await_completion: After delivery report ``running`` until the receiver reports
            an outcome, instead of ``succeeded`` at once.
        timeout_seconds: Whole-request timeout of one attempt, seconds (> 0).
        backoff_initial_seconds: First retry delay, seconds.
        backoff_max_seconds: Longest retry delay, seconds (``Retry-After`` may exceed it).
        give_up_after_seconds: An action undelivered this long after it was queued
            fails; ``None`` retries for ever. One hour by default, the remediation
            engine's default step timeout: a step the engine gave up on is never sent
            late.
        max_pending: Most undelivered actions; beyond it :meth:`submit` raises
            :class:`~core.errors.SchedulerUnavailable` (actions are never dropped).
        retention_seconds: Finished actions (delivered, failed, reported) are kept this
            long after their last change, then deleted when the next action is submitted;
            within it a resubmitted key is recognised (30 days by default).
        send_dry_run: POST dry-run requests too (``dry_run: true`` in ``data``; the
            receiver must change nothing). By default they are recorded as
            ``succeeded`` with message ``dry run: not sent`` and not POSTed.
        clock: Returns now, epoch seconds.
        jitter: Returns a factor applied to each delay; uniform in [0.8, 1.2] by default.
        transport: An ``httpx`` transport (tests); the default network one otherwise.

    Raises:
        ConfigError: Bad URL scheme, non-positive timeout or delays, no secret (or more
            than one source of it), or a malformed ``whsec_`` secret.
    """

    name = "webhook"

    def __init__(
        self,
        *,
        url: str,
        secret: str | None = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        path: str | None = None,
        status_url_base: str | None = None,
        await_completion: bool = False,
        timeout_seconds: float = 10.0,
        backoff_initial_seconds: float = 1.0,
        backoff_max_seconds: float = 300.0,
        give_up_after_seconds: float | None = 3600.0,
        max_pending: int = 10_000,
        retention_seconds: float = 30 * 86400.0,
        send_dry_run: bool = False,
        clock: Clock = system_clock,
        jitter: Callable[[], float] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"webhook scheduler url must start with http:// or https://, "
                              f"got {url!r}")
        secret = resolve_secret(secret=secret, secret_env=secret_env, secret_file=secret_file,
                                what="webhook scheduler")
        if timeout_seconds <= 0:
            raise ConfigError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if not 0 < backoff_initial_seconds <= backoff_max_seconds:
            raise ConfigError("need 0 < backoff_initial_seconds <= backoff_max_seconds")
        if give_up_after_seconds is not None and give_up_after_seconds <= 0:
            raise ConfigError(f"give_up_after_seconds must be > 0, got {give_up_after_seconds!r}")
        if max_pending < 1:
            raise ConfigError(f"max_pending must be >= 1, got {max_pending!r}")
        if retention_seconds <= 0:
            raise ConfigError(f"retention_seconds must be > 0, got {retention_seconds!r}")
        try:
            self._key = secret_key(secret)
        except ValueError as exc:
            raise ConfigError(f"webhook scheduler secret: {exc}") from None
        self.url = url
        self.path = path
        self.status_url_base = status_url_base.rstrip("/") if status_url_base else None
        self.await_completion = await_completion
        self.timeout_seconds = timeout_seconds
        self.backoff_initial_seconds = backoff_initial_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.give_up_after_seconds = give_up_after_seconds
        self.max_pending = max_pending
        self.retention_seconds = retention_seconds
        self.send_dry_run = send_dry_run
        self.clock = clock
        self.jitter = jitter
        self._transport = transport
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False,
                                   isolation_level=None)
        self._lock = threading.RLock()
        self._pump = threading.Lock()
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)

    def __repr__(self) -> str:
        """Return a representation that never shows the secret."""
        return f"WebhookScheduler(url={self.url!r}, path={self.path!r})"

    def close(self) -> None:
        """Close the outbox database."""
        with self._lock:
            self._db.close()

    # --- the SchedulerAdapter Protocol -----------------------------------------------

    async def submit(self, request: ActionRequest) -> str:
        """Queue ``request`` (idempotent on its key), try to deliver; return its ref.

        A second submission with the same ``idempotency_key`` returns the first one's
        ref and queues nothing. Delivery failures do not raise: the action stays
        queued and :meth:`status` says so.

        Raises:
            SchedulerUnavailable: ``max_pending`` actions are already undelivered.
            ValueError: The idempotency key is empty, not ASCII or holds a control
                character (it becomes the ``webhook-id`` header).
        """
        key = request.idempotency_key
        if not key or not key.isascii() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
            raise ValueError(f"idempotency_key {key!r} cannot be a webhook-id")
        ref = action_ref(key)
        now = self.clock()
        with self._lock:
            self._db.execute("DELETE FROM actions WHERE delivered=1 AND updated_at<?",
                             (now - self.retention_seconds,))
            row = self._db.execute("SELECT ref FROM actions WHERE idempotency_key=?",
                                   (key,)).fetchone()
            if row is not None:
                return str(row[0])
            pending = int(self._db.execute(
                "SELECT COUNT(*) FROM actions WHERE delivered=0 AND phase=?",
                (ActionPhase.PENDING.value,)).fetchone()[0])
            if pending >= self.max_pending:
                raise SchedulerUnavailable(
                    f"webhook {self.url}: {pending} actions undelivered (max_pending)")
            message: dict[str, Any] = {
                "type": EVENT_TYPE,
                "timestamp": rfc3339(now),
                "data": request_to_json(request, ref),
            }
            if self.status_url_base:
                message["status_url"] = f"{self.status_url_base}/api/v1/actions/{ref}/status"
            body = json.dumps(message, sort_keys=True, separators=(",", ":"))
            if request.dry_run and not self.send_dry_run:
                phase, delivered, note = ActionPhase.SUCCEEDED, 1, "dry run: not sent"
            else:
                phase, delivered, note = ActionPhase.PENDING, 0, "queued"
            self._db.execute(
                "INSERT INTO actions (ref, idempotency_key, body, phase, delivered, "
                "enqueued_at, updated_at, message) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (ref, key, body, phase.value, delivered, now, now, note),
            )
        logger.info("webhook action %s queued: %s %s/%s", ref, request.step.value,
                    request.node, request.entity)
        await self.deliver()
        return ref

    async def status(self, ref: str) -> ActionStatus:
        """Deliver what is due, then report how far action ``ref`` got.

        Raises:
            PermanentError: ``ref`` is not an action of this outbox (or was forgotten
                after ``retention_seconds``).
        """
        await self.deliver()
        with self._lock:
            row = self._db.execute(
                "SELECT phase, message, attempts FROM actions WHERE ref=?", (ref,)).fetchone()
        if row is None:
            raise PermanentError(f"unknown webhook action ref {ref!r}")
        phase, message, attempts = ActionPhase(row[0]), str(row[1]), int(row[2])
        if phase is ActionPhase.PENDING and attempts:
            message = f"{message} (attempt {attempts})"
        return ActionStatus(ref=ref, phase=phase, message=message)

    def cancel(self, ref: str) -> ActionStatus:
        """Withdraw action ``ref`` if it was not delivered yet (``gpuhealth actions cancel``).

        Returns:
            ``cancelled`` when it was still queued; otherwise its status unchanged (a
            delivered message cannot be called back).

        Raises:
            PermanentError: Unknown ``ref``.
        """
        with self._lock:
            done = self._db.execute(
                "UPDATE actions SET phase=?, delivered=1, message=?, updated_at=? "
                "WHERE ref=? AND delivered=0",
                (ActionPhase.CANCELLED.value, "cancelled before delivery", self.clock(), ref),
            ).rowcount
            row = self._db.execute("SELECT phase, message FROM actions WHERE ref=?",
                                   (ref,)).fetchone()
        if row is None:
            raise PermanentError(f"unknown webhook action ref {ref!r}")
        if done:
            logger.info("webhook action %s cancelled before delivery", ref)
        return ActionStatus(ref=ref, phase=ActionPhase(row[0]), message=str(row[1]))

    # --- completion reports ----------------------------------------------------------

    def report(self, ref: str, phase: ActionPhase, message: str = "") -> ActionStatus:
        """Record the outcome the receiver reports for ``ref`` (the API calls this).

        Args:
            ref: The action's ref (``data.ref`` of the message).
            phase: ``running``, ``succeeded``, ``failed`` or ``cancelled``.
            message: The receiver's words, kept up to 500 characters.

        Returns:
            The action's status after the report.

        Raises:
            KeyError: Unknown ``ref``.
            ValueError: ``phase`` is not reportable, or the action already reached a
                different outcome by an earlier report (the first outcome stands).
        """
        if phase not in _REPORTABLE:
            raise ValueError(f"phase must be one of {sorted(p.value for p in _REPORTABLE)}, "
                             f"got {phase.value!r}")
        with self._lock:
            row = self._db.execute("SELECT phase, message, reported FROM actions WHERE ref=?",
                                   (ref,)).fetchone()
            if row is None:
                raise KeyError(f"unknown webhook action ref {ref!r}")
            current, current_message = ActionPhase(row[0]), str(row[1])
            if current in _TERMINAL and phase is ActionPhase.RUNNING:
                return ActionStatus(ref=ref, phase=current, message=current_message)
            if row[2] and current in _TERMINAL:
                if current is phase:
                    return ActionStatus(ref=ref, phase=current, message=current_message)
                raise ValueError(f"action {ref} was already reported {current.value}")
            text = f"reported {phase.value} by the receiver" + (
                f": {message[:500]}" if message else "")
            self._db.execute(
                "UPDATE actions SET phase=?, delivered=1, reported=1, message=?, updated_at=? "
                "WHERE ref=?", (phase.value, text, self.clock(), ref),
            )
        logger.info("webhook action %s %s", ref, text)
        return ActionStatus(ref=ref, phase=phase, message=text)

    # --- delivery ----------------------------------------------------------------------

    def pending(self) -> int:
        """Return how many actions wait for delivery."""
        with self._lock:
            return int(self._db.execute(
                "SELECT COUNT(*) FROM actions WHERE delivered=0").fetchone()[0])

    def next_attempt_at(self) -> float | None:
        """Return when the head of the queue is due, epoch seconds, or ``None`` if empty."""
        head = self._head()
        return head[4] if head is not None else None

    def _head(self) -> tuple[int, str, str, int, float, float] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT seq, ref, body, attempts, next_at, enqueued_at FROM actions "
                "WHERE delivered=0 ORDER BY seq LIMIT 1").fetchone()
        if row is None:
            return None
        return int(row[0]), str(row[1]), str(row[2]), int(row[3]), float(row[4]), float(row[5])

    def _finish(self, seq: int, phase: ActionPhase, message: str, attempts: int) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE actions SET delivered=1, phase=?, message=?, attempts=?, updated_at=? "
                "WHERE seq=?", (phase.value, message, attempts, self.clock(), seq))

    def _defer(self, seq: int, attempts: int, retry_after: float | None, message: str
               ) -> float:
        delay = min(self.backoff_max_seconds,
                    self.backoff_initial_seconds * (2.0 ** min(attempts - 1, 30)))
        delay *= self.jitter() if self.jitter is not None else random.uniform(0.8, 1.2)
        if retry_after is not None:
            delay = max(delay, retry_after)
        with self._lock:
            self._db.execute(
                "UPDATE actions SET attempts=?, next_at=?, message=?, updated_at=? WHERE seq=?",
                (attempts, self.clock() + delay, message, self.clock(), seq))
        return delay

    async def deliver(self, *, force: bool = False) -> DeliveryRound:
        """Deliver due actions in order until the queue is empty or its head must wait.

        Args:
            force: Ignore the back-off of the head (shutdown, tests).

        Returns:
            What was delivered, failed, and whether the head waits for a retry. A call
            made while another is delivering returns at once (nothing is sent twice).
        """
        if not self._pump.acquire(blocking=False):
            return DeliveryRound(deferred=True)
        delivered = failed = 0
        try:
            async with httpx.AsyncClient(timeout=self.timeout_seconds, verify=_ssl_context(),
                                         transport=self._transport) as client:
                while (head := self._head()) is not None:
                    seq, ref, body, attempts, next_at, enqueued_at = head
                    now = self.clock()
                    if not force and next_at > now:
                        return DeliveryRound(delivered=delivered, failed=failed, deferred=True)
                    outcome = await self._attempt(client, seq, ref, body, attempts + 1,
                                                  enqueued_at)
                    if outcome == "delivered":
                        delivered += 1
                    elif outcome == "failed":
                        failed += 1
                    else:
                        return DeliveryRound(delivered=delivered, failed=failed, deferred=True)
        finally:
            self._pump.release()
        return DeliveryRound(delivered=delivered, failed=failed)

    async def _attempt(self, client: httpx.AsyncClient, seq: int, ref: str, body: str,
                       attempts: int, enqueued_at: float) -> str:
        raw = body.encode("utf-8")
        key = json.loads(body)["data"]["idempotency_key"]
        timestamp = int(self.clock())
        headers = {
            "content-type": "application/json",
            "webhook-id": key,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self._key, key, timestamp, raw),
        }
        retry_after: float | None = None
        try:
            response = await client.post(self.url, content=raw, headers=headers)
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            status = response.status_code
            if 200 <= status < 300:
                phase = ActionPhase.RUNNING if self.await_completion else ActionPhase.SUCCEEDED
                note = f"delivered ({status})" + (
                    ", awaiting the receiver's report" if self.await_completion else "")
                self._finish(seq, phase, note, attempts)
                logger.info("webhook action %s delivered to %s (%d)", ref, self.url, status)
                return "delivered"
            if status in (408, 429) or status >= 500:
                retry_after = _retry_after(response.headers.get("retry-after"), self.clock())
                problem = f"answered {status}"
            else:
                message = f"refused by the receiver ({status}): {response.text[:200]}"
                self._finish(seq, ActionPhase.FAILED, message, attempts)
                logger.error("webhook action %s refused by %s: %d", ref, self.url, status)
                return "failed"
        give_up = self.give_up_after_seconds
        if give_up is not None and self.clock() - enqueued_at >= give_up:
            message = f"gave up after {attempts} attempts over {give_up:.0f} s: {problem}"
            self._finish(seq, ActionPhase.FAILED, message, attempts)
            logger.error("webhook action %s %s", ref, message)
            return "failed"
        delay = self._defer(seq, attempts, retry_after, f"not delivered yet: {problem}")
        logger.warning("webhook %s: action %s not delivered (%s), retry in %.1f s",
                       self.url, ref, problem, delay)
        return "deferred"

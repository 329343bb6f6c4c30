"""Alert routing: silences, inhibition, re-sends and pages, into the durable outbox.

:class:`AlertRouter` takes each evaluation's changed alerts and the active ones and
decides what every notifier is sent:

- to ``notifiers`` every alert that changed, unless a silence (:mod:`alerting.silences`)
  or an inhibition rule (:mod:`alerting.router`) mutes it; an alert muted while firing is
  not resolved, and one unmuted later is sent then; a notifier that is
  :class:`~core.protocols.Resending` (Alertmanager) gets every firing, unmuted alert again
  at its ``resend_interval_seconds`` (Alertmanager ends an alert not re-sent within its
  ``resolve_timeout``);
- to ``page_notifiers`` (PagerDuty) the pages: one per node group for the firing, unmuted
  alerts of ``page_severity`` or worse (:class:`~alerting.router.PageGrouper`).

Everything goes through one durable, bounded :class:`~alerting.outbox.Outbox`: each
notifier has its own queue, backoff and timeout, so one that is down for an hour loses
nothing and delays no other.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import replace

from alerting.outbox import Outbox, notifier_name
from alerting.router import DEFAULT_INHIBIT_RULES, Inhibitor, InhibitRule, PageGrouper
from alerting.silences import SilenceStore
from core.clock import Clock, system_clock
from core.protocols import AsyncCloseable, Notifier, Resending
from core.records import Alert, AlertState, Severity

_FINGERPRINT = operator.attrgetter("fingerprint")

MAX_BACKLOG = 10_000
"""Undelivered notifications kept per notifier; beyond it the oldest are dropped (and counted)."""


class AlertRouter:
    """Silences, inhibition, re-sends and pages (module docstring); not thread-safe.

    Args:
        notifiers: Where alerts go.
        page_notifiers: Where pages go.
        silences: The silence store consulted at each :meth:`route`; none by default.
        inhibit_rules: Inhibition rules.
        group_by: Labels that group alerts into pages.
        page_severity: Lowest severity that pages.
        outbox_path: SQLite file of the outbox, or ``None`` for memory.
        max_outbox: Notifications kept per notifier while it is down, >= 1.
        clock: Now, epoch seconds.
        notify_timeout_seconds: Longest wait for one notifier's ``send``, > 0.

    Raises:
        ValueError: ``notify_timeout_seconds`` is not > 0.
    """

    def __init__(self, *, notifiers: Sequence[Notifier], page_notifiers: Sequence[Notifier] = (),
                 silences: SilenceStore | None = None,
                 inhibit_rules: Sequence[InhibitRule] = DEFAULT_INHIBIT_RULES,
                 group_by: Sequence[str] = ("cluster", "node"),
                 page_severity: Severity = Severity.MAJOR, outbox_path: str | None = None,
                 max_outbox: int = MAX_BACKLOG, clock: Clock = system_clock,
                 notify_timeout_seconds: float = 30.0) -> None:
        if notify_timeout_seconds <= 0:
            raise ValueError(f"notify_timeout_seconds must be > 0, got {notify_timeout_seconds!r}")
        self.silences = silences
        self.notify_timeout_seconds = notify_timeout_seconds
        self.notify_failures: dict[str, int] = {}
        """Failed and dropped deliveries per notifier name since start."""
        self._inhibitor = Inhibitor(inhibit_rules)
        self._grouper = PageGrouper(group_by=group_by, page_severity=page_severity, clock=clock)
        self._outbox = Outbox(path=outbox_path, clock=clock, max_per_notifier=max_outbox)
        self._alert_targets = _named(notifiers, "")
        self._page_targets = _named(page_notifiers, "page:")
        self._notified: set[str] = set()
        self._told: dict[str, Alert] = {}
        self._last_resend: dict[str, float] = {}
        self._muted: dict[str, str] = {}
        self._silence_key: tuple[tuple[str, float], ...] = ()
        self._silence_cache: dict[str, str | None] = {}

    @property
    def outbox(self) -> Outbox:
        """The durable outbox."""
        return self._outbox

    def muted(self) -> dict[str, str]:
        """Fingerprints of muted firing alerts and why (``silenced:<id>``, ``inhibited:<fp>``)."""
        return dict(self._muted)

    def open_pages(self) -> list[Alert]:
        """The pages firing now."""
        return self._grouper.open_pages()

    def depths(self, *, every_notifier: bool = False) -> dict[str, int]:
        """Undelivered notifications per notifier name (pagers prefixed ``page:``).

        Args:
            every_notifier: Also list notifiers with nothing queued (0).
        """
        depths = self._outbox.depths()
        if every_notifier:
            for name in (*self._alert_targets, *self._page_targets):
                depths.setdefault(name, 0)
        return depths

    def resume(self, active: Sequence[Alert], now: float) -> list[Alert]:
        """Take over what the notifiers were told (a restart, a new leader); return resolutions.

        Reads the outbox's record of the alerts sent as firing: those still firing are not
        sent again (a restart or a fail-over is no news to a receiver), those no longer
        firing are sent resolved now (they resolved while nobody routed).

        Raises:
            TemporaryError: The shared outbox cannot be read now (nothing is assumed sent).
        """
        told = self._outbox.notified()
        firing = {a.fingerprint for a in active}
        self._notified |= set(told) & firing
        self._told = {fp: a for fp, a in told.items() if fp in firing}
        gone = [replace(alert, state=AlertState.RESOLVED, ends_at=now)
                for fp, alert in told.items() if fp not in firing]
        if gone:
            for name in self._alert_targets:
                self._outbox.enqueue(name, gone)
            self._outbox.mark_notified((), [a.fingerprint for a in gone])
        return gone

    def route(self, changed: Sequence[Alert], active: Sequence[Alert], now: float
              ) -> tuple[list[Alert], list[Alert]]:
        """Apply silences and inhibition; queue alerts and pages; return both lists.

        Args:
            changed: Alerts that changed in this evaluation (new, changed, resolved).
            active: Every firing alert now.
            now: Epoch seconds.

        Returns:
            ``(alerts queued for the notifiers, pages queued for the pagers)``.
        """
        muted: dict[str, str] = {
            target: f"inhibited:{source}"
            for target, source in self._inhibitor.muted(active).items()
        }
        silenced: set[str] = set()
        if self.silences is not None:
            live = self.silences.active()
            key = tuple(sorted((s.id, s.updated_at) for s in live))
            if key != self._silence_key or len(self._silence_cache) > 4 * len(active) + 1024:
                # a fingerprint stands for its labels: the answer holds while the set does
                self._silence_key, self._silence_cache = key, {}
            cache = self._silence_cache
            if live:
                # Only alerts not judged since the silences last changed are matched; the
                # rest is a look-up (in C: the fingerprints, their verdicts, the hits).
                fps = list(map(_FINGERPRINT, active))
                for alert in itertools.compress(
                        active, map(operator.not_, map(cache.__contains__, fps))):
                    if alert.fingerprint not in cache:
                        cache[alert.fingerprint] = next(
                            (s.id for s in live if s.mutes(alert.labels, now)), None)
                hits = list(map(cache.__getitem__, fps))
                for fp, hit in zip(itertools.compress(fps, hits),
                                   itertools.compress(hits, hits), strict=True):
                    silenced.add(fp)
                    muted.setdefault(fp, f"silenced:{hit}")
        self._muted = muted
        out: list[Alert] = []
        sent_now: set[str] = set()
        for alert in changed:
            fp = alert.fingerprint
            if alert.state is AlertState.RESOLVED:
                if fp in self._notified:
                    self._notified.discard(fp)
                    out.append(alert)
            elif fp not in muted:
                told = self._told.pop(fp, None)
                if told is not None and _same_news(told, alert):
                    continue  # sent before the restart or the fail-over, unchanged since
                self._notified.add(fp)
                sent_now.add(fp)
                out.append(alert)
        # Unmuted since (a silence expired, the inhibitor resolved): looked for in C first.
        if set(map(_FINGERPRINT, active)).difference(muted, self._notified):
            for alert in active:
                fp = alert.fingerprint
                if fp not in muted and fp not in self._notified:
                    self._notified.add(fp)
                    sent_now.add(fp)
                    out.append(alert)
        for name in self._alert_targets:
            self._outbox.enqueue(name, out)
        if self._alert_targets and out:
            self._outbox.mark_notified(
                [a for a in out if a.state is not AlertState.RESOLVED],
                [a.fingerprint for a in out if a.state is AlertState.RESOLVED])
        for name, notifier in self._alert_targets.items():
            if not isinstance(notifier, Resending):
                continue
            interval = notifier.resend_interval_seconds
            if interval <= 0:
                continue
            last = self._last_resend.setdefault(name, now)
            if now - last >= interval:
                self._last_resend[name] = now
                again = [a for a in active if a.fingerprint in self._notified
                         and a.fingerprint not in sent_now and a.fingerprint not in muted]
                self._outbox.enqueue(name, again)
        inhibited_fps = {fp for fp, why in muted.items() if why.startswith("inhibited:")}
        pages = self._grouper.update(active, silenced=silenced, inhibited=inhibited_fps)
        for name in self._page_targets:
            self._outbox.enqueue(name, pages)
        return out, pages

    async def deliver(self, *, force: bool = False) -> int:
        """Deliver what is due from the outbox; return the failed and dropped deliveries.

        Args:
            force: Try every queue now, ignoring backoff (end of a replay, shutdown).
        """
        targets = {**self._alert_targets, **self._page_targets}
        if not targets:
            return 0
        stats = await self._outbox.deliver(
            targets, timeout_seconds=self.notify_timeout_seconds, force=force
        )
        for counts in (stats.failed, stats.dropped):
            for name, count in counts.items():
                self.notify_failures[name] = self.notify_failures.get(name, 0) + count
        return stats.failures

    async def aclose(self) -> None:
        """Close the notifiers' HTTP clients (on the loop that used them)."""
        for notifier in (*self._alert_targets.values(), *self._page_targets.values()):
            if isinstance(notifier, AsyncCloseable):
                await notifier.aclose()

    def close(self) -> None:
        """Close the outbox (its file stays for the next start)."""
        self._outbox.close()


def _same_news(before: Alert, now: Alert) -> bool:
    """Whether ``now`` tells a receiver nothing ``before`` did not (same state, labels, text)."""
    keep = ("last_seen_at",)
    return (before.state == now.state and dict(before.labels) == dict(now.labels)
            and {k: v for k, v in before.annotations.items() if k not in keep}
            == {k: v for k, v in now.annotations.items() if k not in keep}
            and before.starts_at == now.starts_at)


def _named(notifiers: Sequence[Notifier], prefix: str) -> dict[str, Notifier]:
    """Key notifiers by name (``prefix`` + name, ``#2`` etc. when a name repeats)."""
    out: dict[str, Notifier] = {}
    for notifier in notifiers:
        base = prefix + notifier_name(notifier)
        name, n = base, 1
        while name in out:
            n += 1
            name = f"{base}#{n}"
        out[name] = notifier
    return out

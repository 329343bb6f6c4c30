"""Leader election for ``gpuhealth run``: only the leader decides and acts on remediation.

``[remediation] election`` names an elector (entry-point group ``gpuhealth.electors``:
``local``, ``etcd``, ``postgres``, ``kubernetes``); ``local`` (the default) makes this
process the only controller. A standby keeps collecting, analysing and alerting, and
takes over remediation once the leader's lease lapses (``docs/high-availability.md``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from core import plugins
from core.errors import ConfigError, PluginError
from core.protocols import LeaderElector
from gpuhealth.config import Settings

logger = logging.getLogger(__name__)


class AlwaysLeader:
    """The ``local`` election: this process is the only controller."""

    def __init__(self, identity: str) -> None:
        self.identity = identity

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Nothing to stop."""

    def is_leader_now(self) -> bool:
        """Always ``True``."""
        return True


class ElectionLoop:
    """Keeps a :class:`~core.protocols.LeaderElector` lease in a thread.

    Tries to acquire every ``ttl/3`` seconds as standby and renews every ``ttl/3`` as
    leader. Fencing: :meth:`is_leader_now` is true only while the last successful
    acquire or renew is younger than ``ttl - margin`` by this process's monotonic clock,
    so a leader that cannot reach the backend stops acting before its lease can have
    passed to a standby.

    Args:
        elector: The backend.
        margin_seconds: Safety margin subtracted from the lease, seconds (>= 0).
    """

    def __init__(self, elector: LeaderElector, *, margin_seconds: float = 1.0) -> None:
        self.elector = elector
        self.identity = elector.identity
        self.margin_seconds = margin_seconds
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._leader = False

    def start(self) -> None:
        """Start the election thread (one try happens before this returns)."""
        self._step()
        self._thread = threading.Thread(target=self._loop, name="gpuhealth-election",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and release the lease if held."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._leader:
            try:
                self.elector.release()
            except Exception as exc:
                logger.warning("releasing the leader lease failed: %s", exc)
        self._leader = False
        self._valid_until = 0.0

    def is_leader_now(self) -> bool:
        """Whether this controller may act now (lease held and not stale)."""
        return self._leader and time.monotonic() < self._valid_until

    def _loop(self) -> None:
        while not self._stop.wait(max(0.1, self.elector.ttl_seconds / 3.0)):
            self._step()

    def _step(self) -> None:
        started = time.monotonic()
        try:
            ok = self.elector.renew() if self._leader else self.elector.try_acquire()
        except Exception as exc:
            logger.warning("leader election: %s", exc)
            ok = False
        was = self._leader
        self._leader = ok
        if ok:
            self._valid_until = started + self.elector.ttl_seconds - self.margin_seconds
        if ok and not was:
            logger.warning("leader election: %s is leader", self.identity)
        elif was and not ok:
            logger.error("leader election: %s lost leadership; stops acting", self.identity)


def default_identity() -> str:
    """Return ``<host>:<pid>``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def build_leader_loop(settings: Settings) -> AlwaysLeader | ElectionLoop:
    """Build the election of ``[remediation] election``.

    Raises:
        ConfigError: The elector is unknown or its options are wrong (names the key).
    """
    r = settings.remediation
    identity = r.identity or default_identity()
    if r.election == "local":
        return AlwaysLeader(identity)
    options: dict[str, Any] = {"identity": identity, **r.election_options}
    try:
        elector = plugins.build("gpuhealth.electors", r.election, options,
                                expect=LeaderElector)
    except (PluginError, ValueError, TypeError) as exc:
        raise ConfigError(f"{settings.source}: [remediation] election {r.election!r}: {exc}"
                          ) from exc
    return ElectionLoop(elector)

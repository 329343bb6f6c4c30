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
from typing import Any

from core import plugins
from core.errors import ConfigError, PluginError
from core.protocols import LeaderElector
from gpuhealth.config import Settings
from remediation.election import LeaderLoop

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
    """A :class:`~remediation.election.LeaderLoop` in a thread, as the service wants it.

    Fencing is the loop's: :meth:`is_leader_now` is true only while the last successful
    acquire or renew is younger than the lease minus a safety margin by this process's
    monotonic clock, so a leader that cannot reach the backend stops acting before its
    lease can have passed to a standby.
    """

    def __init__(self, elector: LeaderElector) -> None:
        self.identity = elector.identity
        self.loop = LeaderLoop(elector)

    def start(self) -> None:
        """Start the election thread."""
        self.loop.start()

    def stop(self) -> None:
        """Stop the thread and release the lease if held."""
        self.loop.stop()

    def is_leader_now(self) -> bool:
        """Whether this controller may act now."""
        return self.loop.is_leader


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

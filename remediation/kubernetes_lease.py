"""Leader election on a Kubernetes Lease (entry point ``kubernetes`` of ``gpuhealth.electors``).

Follows client-go's ``tools/leaderelection`` with a ``coordination.k8s.io/v1`` Lease
as the lock (``resourcelock.LeaseLock``): the record is the Lease's ``spec``
(``holderIdentity``, ``leaseDurationSeconds``, ``acquireTime``, ``renewTime``,
``leaseTransitions``), and every write is optimistic on ``metadata.resourceVersion``,
so of two candidates writing the same version one gets 409 Conflict and loses.

* Absent lease: create it with this identity (409 AlreadyExists: another candidate
  won the race).
* Held by another identity whose ``renewTime + leaseDurationSeconds`` is still in the
  future: not leader.
* Held by this identity: renew (``renewTime`` = now, ``acquireTime`` kept).
* Expired or released (empty ``holderIdentity``): take over, ``acquireTime`` = now,
  ``leaseTransitions`` + 1.

Unlike client-go, expiry is judged on the lease's ``renewTime`` against this process's
clock (as the Lease API documents ``leaseDurationSeconds``), so candidates need clocks
in step (NTP) to within a small part of the TTL. ``release`` empties
``holderIdentity`` as client-go's ``ReleaseOnCancel`` does, so a standby takes over at
once.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from datetime import UTC, datetime

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from core.clock import Clock, system_clock
from core.errors import ConfigError, TemporaryError
from remediation.kubernetes import build_api_client

logger = logging.getLogger(__name__)


class MicroTime(datetime):
    """A UTC ``datetime`` that serializes as Kubernetes ``MicroTime`` always does.

    The API server parses ``renewTime``/``acquireTime`` with Go's RFC3339Micro layout
    (``2006-01-02T15:04:05.000000Z07:00``, k8s.io/apimachinery ``metav1.MicroTime``),
    which requires the six fraction digits; ``datetime.isoformat`` drops them when
    the microseconds are 0, and the client serializes datetimes with ``isoformat``.
    """

    def isoformat(self, sep: str = "T", timespec: str = "microseconds") -> str:
        """ISO 8601 with microseconds always present."""
        return super().isoformat(sep, timespec)


def _dt(at: float) -> MicroTime:
    return MicroTime.fromtimestamp(at, UTC)


def _epoch(value: datetime | None) -> float | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


class KubernetesLeaseElector:
    """A ``LeaderElector`` on one Lease object.

    Args:
        identity: This candidate's name (default ``<host name>-<pid>``); must be unique.
        name: The Lease's name (default ``gpuhealth-controller``).
        namespace: Its namespace (default ``default``).
        ttl_seconds: ``leaseDurationSeconds``, whole seconds 1-3600 (default 15, as
            client-go's usual ``LeaseDuration``). Renew well within it (e.g. every
            ``ttl/3``).
        host, kubeconfig, context, in_cluster, token, verify_ssl: Where the API server
            is (``remediation.kubernetes.build_api_client``).
        request_timeout_seconds: Timeout of each API request (default 2 s; keep it
            below ``ttl/3``).
        api_client: A ready ``ApiClient`` (tests).
        clock: Epoch-seconds clock, injectable for tests.

    Raises:
        ConfigError: Bad identity, name or TTL.
    """

    def __init__(
        self,
        *,
        identity: str | None = None,
        name: str = "gpuhealth-controller",
        namespace: str = "default",
        ttl_seconds: float = 15.0,
        host: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        in_cluster: bool = False,
        token: str | None = None,
        verify_ssl: bool = True,
        request_timeout_seconds: float = 2.0,
        api_client: client.ApiClient | None = None,
        clock: Clock = system_clock,
    ) -> None:
        if not (math.isfinite(ttl_seconds) and 1 <= ttl_seconds <= 3600
                and float(ttl_seconds).is_integer()):
            raise ConfigError(f"kubernetes lease: ttl_seconds must be whole seconds in 1-3600 "
                              f"(leaseDurationSeconds is an integer), got {ttl_seconds}")
        if not name or not namespace:
            raise ConfigError("kubernetes lease: name and namespace must not be empty")
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        if not self.identity:
            raise ConfigError("kubernetes lease: identity must not be empty")
        self.ttl_seconds = float(ttl_seconds)
        self.name = name
        self.namespace = namespace
        self._timeout = request_timeout_seconds
        self._api = api_client or build_api_client(
            host=host, kubeconfig=kubeconfig, context=context, in_cluster=in_cluster,
            token=token, verify_ssl=verify_ssl, pool_size=2)
        self._coord = client.CoordinationV1Api(self._api)
        self._clock = clock
        self.retry_after_seconds: float | None = None
        """After a lost :meth:`try_acquire`: seconds until the holder's lease lapses."""

    def _error(self, exc: Exception, what: str) -> TemporaryError:
        status = getattr(exc, "status", 0)
        return TemporaryError(f"kubernetes lease {self.namespace}/{self.name}: {what}: "
                              f"{f'HTTP {status} ' if status else ''}{exc}")

    def _get(self) -> client.V1Lease | None:
        try:
            return self._coord.read_namespaced_lease(self.name, self.namespace,
                                                     _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._error(exc, "read") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._error(exc, "read") from exc

    def _expired(self, spec: client.V1LeaseSpec, now: float) -> bool:
        if not spec.holder_identity:
            return True
        renewed = _epoch(spec.renew_time) or _epoch(spec.acquire_time)
        duration = spec.lease_duration_seconds or self.ttl_seconds
        return renewed is None or renewed + duration <= now

    def _write(self, lease: client.V1Lease | None, *, take: bool, release: bool = False) -> bool:
        now = self._clock()
        spec = client.V1LeaseSpec(
            holder_identity="" if release else self.identity,
            lease_duration_seconds=1 if release else int(self.ttl_seconds),
            acquire_time=_dt(now), renew_time=_dt(now), lease_transitions=0)
        try:
            if lease is None:
                body = client.V1Lease(
                    api_version="coordination.k8s.io/v1", kind="Lease",
                    metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                    spec=spec)
                self._coord.create_namespaced_lease(self.namespace, body,
                                                    _request_timeout=self._timeout)
                return True
            old = lease.spec or client.V1LeaseSpec()
            transitions = old.lease_transitions or 0
            if take and not release:
                spec.lease_transitions = transitions + 1
            else:
                spec.lease_transitions = transitions
                kept = _epoch(old.acquire_time)
                if kept is not None and not release:
                    spec.acquire_time = _dt(kept)
            lease.spec = spec
            self._coord.replace_namespaced_lease(self.name, self.namespace, lease,
                                                 _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 409:
                logger.info("kubernetes lease %s/%s: lost the race (409)", self.namespace,
                            self.name)
                return False
            raise self._error(exc, "write") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._error(exc, "write") from exc
        return True

    def try_acquire(self) -> bool:
        """Become or stay leader if the lease is free, expired or ours.

        Returns:
            Whether this process holds the lease now. When another holder's lease is
            still valid, :attr:`retry_after_seconds` says for how long.

        Raises:
            TemporaryError: The API server cannot be reached or answered an error
                other than 404/409.
        """
        self.retry_after_seconds = None
        lease = self._get()
        if lease is None:
            won = self._write(None, take=True)
            if won:
                logger.info("kubernetes lease %s/%s: %s created it and leads", self.namespace,
                            self.name, self.identity)
            return won
        spec = lease.spec or client.V1LeaseSpec()
        if spec.holder_identity == self.identity:
            return self._write(lease, take=False)
        now = self._clock()
        if not self._expired(spec, now):
            renewed = _epoch(spec.renew_time) or _epoch(spec.acquire_time) or now
            duration = spec.lease_duration_seconds or self.ttl_seconds
            self.retry_after_seconds = max(0.0, renewed + duration - now)
            return False
        won = self._write(lease, take=True)
        if won:
            logger.warning("kubernetes lease %s/%s: %s took over from %r", self.namespace,
                           self.name, self.identity, spec.holder_identity or None)
        return won

    def renew(self) -> bool:
        """Extend our lease; ``False`` if another identity holds it (leadership lost).

        Raises:
            TemporaryError: The API server cannot be reached; the caller must stop
                acting once ``ttl_seconds`` have passed since its last successful renew.
        """
        lease = self._get()
        if lease is None or (lease.spec is None
                             or lease.spec.holder_identity != self.identity):
            return False
        return self._write(lease, take=False)

    def release(self) -> None:
        """Give the lease up (empty ``holderIdentity``), if we hold it.

        Raises:
            TemporaryError: The API server cannot be reached.
        """
        lease = self._get()
        if lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        self._write(lease, take=False, release=True)

    def leader(self) -> str | None:
        """The identity holding an unexpired lease, or ``None``.

        Raises:
            TemporaryError: The API server cannot be reached.
        """
        lease = self._get()
        if lease is None or lease.spec is None:
            return None
        if self._expired(lease.spec, self._clock()):
            return None
        return lease.spec.holder_identity

    def close(self) -> None:
        """Close the API client's connections."""
        self._api.close()  # type: ignore[no-untyped-call]


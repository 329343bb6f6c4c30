"""Provision the dashboards through Grafana's HTTP API with ``grafana-client``.

Uses the folder API (``GET``/``POST /api/folders``) and the legacy dashboard API that
Grafana 12 still documents (``GET /api/dashboards/uid/:uid``,
``POST /api/dashboards/db``; ecosystem-reference §8.3). Each dashboard is written with
optimistic concurrency: read the stored version, post ours on top of it, and when
Grafana answers ``412 version-mismatch`` (someone saved in between) read again and
retry. A dashboard whose stored content already equals ours is left alone, so running
provisioning twice creates no new versions.

Errors are mapped at one seam (:func:`_mapped_errors`): 401, 403 and 404 become
:class:`GrafanaAuthError`, :class:`GrafanaPermissionError` and
:class:`GrafanaNotFound` with a message that says what to fix; 5xx, timeouts and refused
connections become :class:`GrafanaUnavailable` (a :class:`~core.errors.TemporaryError`).

``grafana_client`` (and its HTTP stack ``niquests``) is imported only in this module
(style.md C.1).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from grafana_client.api import GrafanaApi
from grafana_client.client import (
    GrafanaClientError,
    GrafanaException,
    GrafanaServerError,
    GrafanaTimeoutError,
    GrafanaUnauthorizedError,
)
from niquests.exceptions import RequestException

from core.errors import PermanentError, TemporaryError
from dashboards.render import Flavour, folder_uid, render_all

logger = logging.getLogger(__name__)

DEFAULT_FOLDER = "GPU Health"
"""Folder the dashboards go to unless told otherwise."""

_IGNORED_KEYS = frozenset({"id", "version"})


class GrafanaError(PermanentError):
    """Grafana refused the request; retrying will not help."""


class GrafanaAuthError(GrafanaError):
    """401: no token, or Grafana does not accept it."""


class GrafanaPermissionError(GrafanaError):
    """403: the token is valid but may not create folders or save dashboards."""


class GrafanaNotFound(GrafanaError):
    """404 where something must exist: the URL is not a Grafana API root."""


class GrafanaConflict(GrafanaError):
    """412 that retrying does not resolve (name clash, plugin dashboard, endless edits)."""


class GrafanaUnavailable(TemporaryError):
    """Grafana cannot be reached, timed out, or answered 5xx."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvisionResult:
    """What provisioning did to one dashboard.

    Attributes:
        uid: Dashboard uid.
        status: ``created``, ``updated`` or ``unchanged``.
        version: Version stored in Grafana afterwards.
        url: Grafana's path of the dashboard (``/d/<uid>/<slug>``), ``""`` when unchanged.
        attempts: POSTs made (more than one after ``412 version-mismatch``).
    """

    uid: str
    status: str
    version: int
    url: str
    attempts: int


@contextlib.contextmanager
def _mapped_errors(url: str, what: str) -> Iterator[None]:
    """Translate grafana-client exceptions into gpuhealth's error tree."""
    try:
        yield
    except GrafanaUnauthorizedError as exc:
        raise GrafanaAuthError(
            f"Grafana at {url} rejected the credentials while trying to {what} (401): "
            "set a service-account token in the environment variable given by --token-env"
        ) from exc
    except GrafanaTimeoutError as exc:
        raise GrafanaUnavailable(f"Grafana at {url} timed out while trying to {what}") from exc
    except GrafanaServerError as exc:
        raise GrafanaUnavailable(
            f"Grafana at {url} failed ({exc.status_code}) while trying to {what}: {exc.message}"
        ) from exc
    except GrafanaClientError as exc:
        if exc.status_code == 403:
            raise GrafanaPermissionError(
                f"Grafana at {url} denied the token permission to {what} (403): the "
                "service account needs the Editor role (folders:create, dashboards:write)"
            ) from exc
        if exc.status_code == 404:
            raise GrafanaNotFound(
                f"Grafana at {url} has no API to {what} (404): is the URL the Grafana "
                "root (with its sub-path, if any)?"
            ) from exc
        raise GrafanaError(
            f"Grafana at {url} refused to {what} ({exc.status_code}): {exc.message}"
        ) from exc
    except (GrafanaException, RequestException) as exc:
        # No answer at all: refused, DNS, TLS (grafana-client lets niquests' own
        # ConnectionError through, and wraps only HTTPError in GrafanaException).
        raise GrafanaUnavailable(f"cannot reach Grafana at {url} to {what}: {exc}") from exc


def _comparable(dashboard: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in dashboard.items() if key not in _IGNORED_KEYS}


class GrafanaProvisioner:
    """Create a folder and save dashboards in it through Grafana's HTTP API.

    Args:
        url: Grafana root URL (``http://127.0.0.1:3000``; a sub-path is kept).
        token: Service-account token sent as ``Authorization: Bearer``; ``None`` sends
            no credentials (Grafana answers 401 unless anonymous editing is on).
        timeout_seconds: Timeout of each HTTP request.
        max_attempts: POSTs per dashboard before a persisting ``412 version-mismatch``
            becomes :class:`GrafanaConflict`; at least 1.

    Raises:
        ValueError: ``max_attempts`` below 1 or ``timeout_seconds`` not positive.
    """

    def __init__(self, *, url: str, token: str | None = None, timeout_seconds: float = 10.0,
                 max_attempts: int = 3) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        self.url = url
        self.token = token
        self.timeout_seconds = timeout_seconds
        self.max_attempts = max_attempts
        self._api = GrafanaApi.from_url(url=url, credential=token, timeout=timeout_seconds)

    def ensure_folder(self, title: str, uid: str | None = None) -> str:
        """Return the uid of the folder ``title``, creating it when missing.

        Args:
            title: Folder title.
            uid: Folder uid; derived from ``title`` by default.

        Raises:
            GrafanaError: Grafana refused (401, 403, 404 or another 4xx).
            GrafanaUnavailable: Grafana cannot be reached or failed.
        """
        uid = uid or folder_uid(title)
        with _mapped_errors(self.url, f"create folder {title!r}"):
            try:
                folder = self._api.folder.get_folder(uid)
            except GrafanaClientError as exc:
                if exc.status_code != 404:
                    raise
                folder = self._api.folder.create_folder(title, uid=uid)
                logger.info("created Grafana folder %r (uid %s)", title, uid)
        return str(folder.get("uid", uid))

    def _stored(self, uid: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self._api.dashboard.get_dashboard(uid)
        except GrafanaClientError as exc:
            if exc.status_code == 404:
                return None
            raise
        return found

    def save_dashboard(self, dashboard: Mapping[str, Any], *, folder_uid: str,
                       message: str = "provisioned by gpuhealth") -> ProvisionResult:
        """Create or replace one dashboard (by uid) in a folder.

        Args:
            dashboard: Dashboard JSON model with a ``uid``.
            folder_uid: Folder it must live in.
            message: Version-history message.

        Raises:
            ValueError: The dashboard has no uid.
            GrafanaConflict: 412 ``name-exists`` (another dashboard in the folder has the
                same title) or ``plugin-dashboard``, or ``version-mismatch`` on every
                attempt.
            GrafanaError: Grafana refused otherwise (401, 403, 404, other 4xx).
            GrafanaUnavailable: Grafana cannot be reached or failed.
        """
        uid = str(dashboard.get("uid") or "")
        if not uid:
            raise ValueError("dashboard has no uid")
        wanted = _comparable(dashboard)
        for attempt in range(1, self.max_attempts + 1):
            with _mapped_errors(self.url, f"save dashboard {uid}"):
                stored = self._stored(uid)
                if stored is not None:
                    current = stored.get("dashboard", {})
                    meta = stored.get("meta", {})
                    if (_comparable(current) == wanted
                            and meta.get("folderUid", "") == folder_uid):
                        return ProvisionResult(uid=uid, status="unchanged",
                                               version=int(current.get("version", 0)), url="",
                                               attempts=attempt - 1)
                body = dict(dashboard)
                body["id"] = None
                body["version"] = int(stored["dashboard"].get("version", 0)) if stored else 0
                payload = {"dashboard": body, "folderUid": folder_uid, "message": message,
                           "overwrite": False}
                try:
                    answer: dict[str, Any] = self._api.dashboard.update_dashboard(payload)
                except GrafanaClientError as exc:
                    if exc.status_code != 412:
                        raise
                    reason = exc.response.get("status") if isinstance(exc.response, dict) else ""
                    if reason != "version-mismatch":
                        raise GrafanaConflict(
                            f"Grafana at {self.url} refused dashboard {uid} (412 {reason}): "
                            f"{exc.message}"
                        ) from exc
                    logger.info("dashboard %s changed while saving (attempt %d of %d); "
                                "reading it again", uid, attempt, self.max_attempts)
                    continue
            return ProvisionResult(uid=uid, status="updated" if stored else "created",
                                   version=int(answer.get("version", 0)),
                                   url=str(answer.get("url", "")), attempts=attempt)
        raise GrafanaConflict(
            f"dashboard {uid} kept changing in Grafana at {self.url}: "
            f"412 version-mismatch {self.max_attempts} times"
        )


def provision(url: str, *, token: str | None = None, folder: str = DEFAULT_FOLDER,
              flavours: tuple[Flavour, ...] = (Flavour.PROMETHEUS,),
              timeout_seconds: float = 10.0, max_attempts: int = 3) -> list[ProvisionResult]:
    """Create ``folder`` in Grafana and save every gpuhealth dashboard in it.

    Args:
        url: Grafana root URL.
        token: Service-account token, or ``None``.
        folder: Folder title; its uid is derived from it.
        flavours: Datasource flavours to provision (titles and uids differ per flavour).
        timeout_seconds: Timeout of each HTTP request.
        max_attempts: POSTs per dashboard on repeated ``412 version-mismatch``.

    Returns:
        One result per dashboard, in render order.

    Raises:
        GrafanaError: Grafana refused (401, 403, 404, 412 that retrying does not fix).
        GrafanaUnavailable: Grafana cannot be reached or failed.
    """
    provisioner = GrafanaProvisioner(url=url, token=token, timeout_seconds=timeout_seconds,
                                     max_attempts=max_attempts)
    uid = provisioner.ensure_folder(folder)
    results = []
    for flavour in flavours:
        for dashboard in render_all(flavour).values():
            result = provisioner.save_dashboard(dashboard, folder_uid=uid)
            logger.info("dashboard %s %s (version %d)", result.uid, result.status,
                        result.version)
            results.append(result)
    return results

"""Errors raised across gpuhealth.

The tree (style.md C.3.9)::

    GpuHealthError
    ├── TemporaryError(retry_after_seconds)   retry with backoff
    │   ├── CollectorUnavailable              the whole source is gone for now
    │   ├── NotifierUnavailable
    │   └── SchedulerUnavailable
    └── PermanentError                        retrying will not help
        ├── ConfigError                       names the file and key
        ├── PluginError                       unknown plugin or wrong Protocol
        ├── ArtifactError                     input that cannot be parsed (file, line)
        ├── NodeNotFound
        └── ReturnedToService                 a human undid gpuhealth's cordon meanwhile

Backends translate foreign exceptions into these at one seam (``raise ... from exc``);
the runner decides to retry by type, never by message.
"""

from __future__ import annotations


class GpuHealthError(Exception):
    """Base of every error gpuhealth raises on purpose."""


class TemporaryError(GpuHealthError):
    """A transient failure; the caller may retry after ``retry_after_seconds``."""

    def __init__(self, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class PermanentError(GpuHealthError):
    """A failure that retrying does not fix."""


class CollectorUnavailable(TemporaryError):
    """The collector's whole source cannot be read (no driver, file gone)."""


class NotifierUnavailable(TemporaryError):
    """A notifier endpoint is down or rate-limits us."""


class SchedulerUnavailable(TemporaryError):
    """A scheduler adapter cannot reach its scheduler."""


class ConfigError(PermanentError):
    """An invalid configuration; the message names the file and the key."""


class PluginError(PermanentError):
    """No plugin with that name, or it does not implement its Protocol."""


class NodeNotFound(PermanentError):
    """The scheduler does not know the node."""


class ReturnedToService(PermanentError):
    """Someone returned the node to service after gpuhealth took it out in this incident.

    Raised by a scheduler adapter for a step that would take the node out again (a drain
    after a cordon, a reboot) when the request says ``taken_out`` and the node is
    schedulable: re-cordoning would undo a human's decision (fault-model.md: never undo
    what a human did). The engine stops the incident.
    """


class ArtifactError(PermanentError):
    """Input that cannot be parsed.

    Attributes:
        file: The input path.
        line: 1-based line number, or ``None`` when the whole input is at fault.
        reason: What is wrong, in one line.
    """

    def __init__(self, file: str, line: int | None, reason: str) -> None:
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {reason}")
        self.file = file
        self.line = line
        self.reason = reason

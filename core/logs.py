"""Log formatting for the CLI (style.md C.3.12): text or one JSON object per line.

Only the CLI configures handlers; library modules just use ``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import ClassVar


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object: ``ts`` (epoch s), ``level``, ``logger``, ``msg``."""

    _SKIP: ClassVar[frozenset[str]] = frozenset(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        """Return the JSON line for ``record``."""
        data: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._SKIP and not key.startswith("_"):
                data[key] = value if isinstance(value, (int, float, str, bool)) else str(value)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data)


def configure(level: int, fmt: str = "text") -> None:
    """Send logs at ``level`` and above to standard error as ``text`` or ``json``.

    Raises:
        ValueError: ``fmt`` is neither ``text`` nor ``json``.
    """
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)

"""The agents' bearer tokens of a controller (``[controller] agent_tokens_file``).

The file holds ``node token`` lines (a ``#`` starts a comment, on its own line or after
the token) or a JSON object ``{"node": "token"}``; it is re-read when it changes (a
mounted Kubernetes Secret), and a bad edit keeps the tokens read before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from pathlib import Path

from core.errors import ConfigError

logger = logging.getLogger(__name__)


def parse_tokens(text: str, path: Path) -> dict[str, str]:
    """Read a tokens file's text into ``{node: token}``.

    Raises:
        ConfigError: A malformed line or document (names the file and line), or a node
            listed twice.
    """
    tokens: dict[str, str] = {}
    if text.lstrip().startswith("{"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from exc
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in loaded.items()):
            raise ConfigError(f"{path}: expected {{node: token}} strings")
        return dict(loaded)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{number}: expected 'node token', got {len(parts)} "
                              "words")
        if parts[0] in tokens:
            raise ConfigError(f"{path}:{number}: node {parts[0]!r} listed twice")
        tokens[parts[0]] = parts[1]
    return tokens


def token_file_problems(path: Path) -> list[str]:
    """What is wrong with a tokens file (``config check``); ``[]`` when it is fine."""
    try:
        parse_tokens(path.read_text(encoding="utf-8"), path)
    except ConfigError as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"{path}: {exc.strerror}"]
    return []


class AgentTokens:
    """The agents' bearer tokens from ``[controller] agent_tokens_file``, re-read on change.

    The file holds ``node token`` lines (``#`` comments) or a JSON object
    ``{"node": "token"}``. Tokens are compared in constant time and never logged.

    Args:
        path: The file.

    Raises:
        ConfigError: The file cannot be read or a line is malformed (names the line).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._by_node: dict[str, bytes] = {}
        self._by_hash: dict[bytes, str] = {}
        self.reload()

    def reload(self) -> None:
        """Read the file again when its size or modification time changed."""
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._stamp:
                return
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"[controller] agent_tokens_file {self.path}: "
                              f"{exc.strerror}") from exc
        tokens = parse_tokens(text, self.path)
        self._by_node = {node: token.encode() for node, token in tokens.items()}
        self._by_hash = {hashlib.sha256(t.encode()).digest(): n for n, t in tokens.items()}
        self._stamp = stamp
        logger.info("controller: %d agent tokens from %s", len(tokens), self.path)

    def check(self, node: str, token: str) -> int:
        """Return 200 when ``token`` is ``node``'s, 403 when it is another node's, else 401."""
        given = token.encode()
        own = self._by_node.get(node)
        if own is not None and hmac.compare_digest(own, given):
            return 200
        return 403 if hashlib.sha256(given).digest() in self._by_hash else 401



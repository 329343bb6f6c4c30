"""The agents' bearer tokens: the controller's list and an agent's own.

:class:`AgentTokens` is the controller's ``[controller] agent_tokens_file``: ``node
token`` lines (a ``#`` starts a comment, on its own line or after the token) or a JSON
object ``{"node": "token"}``. During a rotation a node may have two tokens, the current
one and the next (``node token next``, ``{"node": ["token", "next"]}``), so the agent is
taken before and after its own token file changes. :class:`TokenFile` is an agent's
``[agent] token_file`` (the token on the first line). Both are re-read when the file
changes (a mounted Kubernetes Secret), and a bad edit keeps the token(s) read before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from pathlib import Path

from core.errors import ConfigError

logger = logging.getLogger(__name__)


def _one_or_two(value: object) -> tuple[str, ...] | None:
    """A JSON value's tokens: a string, or a list of one or two (``None``: neither)."""
    if isinstance(value, str):
        return (value,) if value else None
    if isinstance(value, list) and 1 <= len(value) <= 2 and all(
            isinstance(t, str) and t for t in value):
        return tuple(value)
    return None


def parse_tokens(text: str, path: Path) -> dict[str, tuple[str, ...]]:
    r"""Read a tokens file's text into ``{node: (token,)}`` (or ``(token, next)``).

    Examples:
        >>> parse_tokens("gpu-01 a1  # rack 3\ngpu-02 b1 b2\n", Path("tokens"))
        {'gpu-01': ('a1',), 'gpu-02': ('b1', 'b2')}
        >>> parse_tokens('{"gpu-01": "a1", "gpu-02": ["b1", "b2"]}', Path("tokens"))
        {'gpu-01': ('a1',), 'gpu-02': ('b1', 'b2')}

    Raises:
        ConfigError: A malformed line or document (names the file and line), or a node
            listed twice.
    """
    tokens: dict[str, tuple[str, ...]] = {}
    if text.lstrip().startswith("{"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected {{node: token}} strings")
        for node, value in loaded.items():
            found = _one_or_two(value)
            if not isinstance(node, str) or found is None:
                raise ConfigError(f"{path}: expected {{node: token}} strings (or "
                                  "[token, next] during a rotation)")
            tokens[node] = found
        return tokens
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ConfigError(f"{path}:{number}: expected 'node token' (or 'node token next' "
                              f"during a rotation), got {len(parts)} words")
        if parts[0] in tokens:
            raise ConfigError(f"{path}:{number}: node {parts[0]!r} listed twice")
        tokens[parts[0]] = tuple(parts[1:])
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


def _stamp(path: Path) -> tuple[int, int, int, int]:
    """Device, inode, size and mtime (``stat`` follows a Kubernetes ``..data`` symlink).

    Raises:
        OSError: The file cannot be stat'ed.
    """
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class TokenFile:
    """An agent's own bearer token from ``[agent] token_file``, re-read when it changes.

    Calling it returns the token (the first line, stripped). A file that cannot be read
    or is empty (half-written) keeps the token read before, logged once; so an agent goes
    on sending through a rotation and uses the new token from its next batch.

    Args:
        path: The file.

    Raises:
        ConfigError: The file cannot be read or is empty at start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int, int] | None = None
        self._token = ""
        self._problem = ""
        self._read()
        if not self._token:
            raise ConfigError(f"[agent] token_file {path}: {self._problem or 'empty'}")

    def _read(self) -> None:
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            problem = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        else:
            token = text.splitlines()[0].strip() if text.strip() else ""
            if token:
                self._stamp, self._problem = stamp, ""
                if self._token and token != self._token:
                    logger.info("agent: a new token from %s", self.path)
                self._token = token
                return
            problem = "empty"
        if self._token and problem != self._problem:
            logger.error("agent: [agent] token_file %s: %s; the token read before stays",
                         self.path, problem)
        self._problem = str(problem)

    def __call__(self) -> str:
        """The token (re-read first if the file changed)."""
        self._read()
        return self._token


class AgentTokens:
    """The agents' bearer tokens from ``[controller] agent_tokens_file``, re-read on change.

    The file holds ``node token`` lines (``#`` comments) or a JSON object
    ``{"node": "token"}``; a node may have two during a rotation (module docstring).
    Tokens are compared in constant time and never logged.

    Args:
        path: The file.

    Raises:
        ConfigError: The file cannot be read or a line is malformed (names the line).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int, int] | None = None
        self._by_node: dict[str, tuple[bytes, ...]] = {}
        self._by_hash: dict[bytes, str] = {}
        self._checked_at = float("-inf")
        self.reload()

    def reload(self, *, unless_checked_within: float = 0.0) -> None:
        """Read the file again when its size or modification time changed.

        Args:
            unless_checked_within: Skip the check when the file was checked this many
                seconds ago or less (the controller checks before every batch; a
                ``stat`` per batch showed as 9 % of the API thread's samples in a
                py-spy profile at 2,000 nodes).

        Raises:
            ConfigError: As the constructor.
        """
        now = time.monotonic()
        if unless_checked_within > 0 and now - self._checked_at <= unless_checked_within:
            return
        self._checked_at = now
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"[controller] agent_tokens_file {self.path}: "
                              f"{exc.strerror}") from exc
        tokens = parse_tokens(text, self.path)
        self._by_node = {node: tuple(t.encode() for t in own) for node, own in tokens.items()}
        self._by_hash = {hashlib.sha256(t.encode()).digest(): n
                         for n, own in tokens.items() for t in own}
        self._stamp = stamp
        logger.info("controller: %d agent tokens from %s", len(tokens), self.path)

    def check(self, node: str, token: str) -> int:
        """Return 200 when ``token`` is ``node``'s, 403 when it is another node's, else 401."""
        given = token.encode()
        matches = [hmac.compare_digest(t, given) for t in self._by_node.get(node, ())]
        if any(matches):
            return 200
        return 403 if hashlib.sha256(given).digest() in self._by_hash else 401



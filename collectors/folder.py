"""Which files of a folder are artifacts: the bounded walk of ``diagnose DIR`` and ``replay DIR``.

A folder given to ``diagnose`` is walked in sorted order, but an operator who points it at
``/tmp`` or ``/var`` expects a log triage, not a scan of every byte below: a walk skips

- hidden files and folders (``.git``, ``.venv``), folders of code (:data:`SKIPPED_FOLDERS`:
  ``__pycache__``, ``node_modules``, ``site-packages``, ``venv``...) and any folder holding a
  ``pyvenv.cfg`` (a virtual environment, whatever its name);
- symbolic links, to files or folders (never followed: no loops, no ``/dev`` or ``/proc``
  behind a link) and anything but regular files (a named pipe would block the reader);
- ``README.md`` and ``*.json`` (a case collection's notes and expectations) and files whose
  extension says they are not text (:data:`NOT_LOG_SUFFIXES`: code, images, databases,
  model weights, packages);
- binary files: the first KiB (:data:`SNIFF_BYTES`) holds NUL bytes among control bytes, or
  is not text in UTF-8 or UTF-16 (an archive or a gzip file is read as one, not sniffed);
  a line-protocol recording over the size cap (:data:`MAX_FILE_BYTES`) is skipped by
  ``diagnose`` (name it, or ``replay`` it, to read it whole);

and it stops after :data:`MAX_FILES` files. A member larger than :data:`MAX_FILE_BYTES` is
read from its tail (its last :data:`MAX_FILE_BYTES`, from the first whole line; the latest
lines are the ones that matter for triage). What was skipped or cut is counted in a
:class:`WalkReport`, which the command prints as one line on stderr. Files named one by one
are read whole and never skipped: the bounds are for what a walk finds.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from collectors.archive import archive_kind

SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages",
                             "venv", "virtualenv", "CVS"})
"""Folders a walk does not enter (besides hidden ones): code, not logs."""

NOT_LOG_SUFFIXES = frozenset({
    ".py", ".pyc", ".pyo", ".pyi", ".pyd", ".so", ".o", ".a", ".dll", ".dylib", ".exe",
    ".class", ".jar", ".whl", ".egg", ".deb", ".rpm", ".iso", ".img", ".qcow2",
    ".png", ".jpg", ".jpeg", ".gif", ".svg", ".ico", ".webp", ".pdf",
    ".pkl", ".pickle", ".pt", ".pth", ".safetensors", ".onnx", ".npy", ".npz", ".h5",
    ".ckpt", ".parquet", ".arrow", ".feather",
    ".db", ".sqlite", ".sqlite3", ".sqlite-wal", ".sqlite-shm", ".db-wal", ".db-shm",
    ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".js", ".ts", ".css", ".html",
    ".toml", ".ini", ".cfg", ".sh", ".lock", ".pid", ".sock",
})
"""Extensions a walk skips: files that are never a log or a tool's output (``.yaml`` and
``.md`` are read: ``kubectl get node -o yaml`` and a pasted chat are artifacts)."""

MAX_FILE_BYTES = 64 * 1024 * 1024
"""A folder member larger than this is read from its tail (its last this many bytes)."""
MAX_FILES = 10_000
"""A walk stops after this many files (the rest of the folder is not read)."""
SNIFF_BYTES = 1024
"""How much of a folder member is looked at to tell text from binary data."""

_GZIP_MAGIC = b"\x1f\x8b"
_OTHER_MAGICS = (b"PK\x03\x04", b"PK\x05\x06", b"\xfd7zXZ\x00", b"BZh")
_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


@dataclass(frozen=True, slots=True)
class Member:
    """One file to read: its path and the offset to read it from (0: all of it)."""

    path: str
    offset: int = 0
    size: int = 0


@dataclass(slots=True)
class WalkReport:
    """What a walk skipped, cut or left unread (a summary for the operator).

    Attributes:
        skipped: Files and folders left out, per reason.
        tails: Paths of the members read from their tail only.
        stopped: True when :data:`MAX_FILES` was reached and the walk stopped.
    """

    skipped: Counter[str] = field(default_factory=Counter)
    tails: list[str] = field(default_factory=list)
    stopped: bool = False
    max_files: int = field(default_factory=lambda: MAX_FILES)
    """The walk's cap on files (:data:`MAX_FILES` unless given)."""
    max_file_bytes: int = field(default_factory=lambda: MAX_FILE_BYTES)
    """The walk's cap per file (:data:`MAX_FILE_BYTES` unless given)."""

    def summary(self) -> str:
        """One line (``""`` when nothing was skipped, cut or left out)."""
        parts = [f"{count} {reason}" for reason, count in sorted(self.skipped.items())]
        if self.tails:
            parts.append(f"{len(self.tails)} file(s) over {self.max_file_bytes // 2**20} MiB "
                         f"read from their last {self.max_file_bytes // 2**20} MiB only "
                         f"(line numbers count from there; first: {self.tails[0]})")
        if self.stopped:
            parts.append(f"stopped after {self.max_files} files (the rest not read)")
        return "folder walk: skipped " + "; ".join(parts) if parts else ""


def is_binary(head: bytes) -> bool:
    r"""Whether the first bytes of a file are binary data rather than text.

    NUL bytes among other control bytes (a crashed syslog's NUL padding alone is text),
    or bytes that decode neither as UTF-8 (allowing a character cut at the end) nor as
    UTF-16 with a byte-order mark. gzip, zip, xz and bzip2 data are not called binary:
    their readers open them.

    Examples:
        >>> is_binary(b"[Mon Nov 30 08:00:00 2026] NVRM: Xid 79\n")
        False
        >>> is_binary(bytes(range(256)))
        True
    """
    if not head or head.startswith((_GZIP_MAGIC, *_OTHER_MAGICS)):
        return False
    if head.startswith(_BOMS[1:]):
        return False  # UTF-16 text
    text = head.replace(b"\x00", b"")
    control = sum(1 for b in text if b < 32 and b not in (9, 10, 12, 13, 27))
    if control > 0.02 * max(1, len(text)):
        return True
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(text) - 4:
            # Not UTF-8: a Latin-1 log has the odd high byte, binary data has many.
            high = sum(1 for b in text if b >= 128)
            return high > 0.3 * len(text)
    return False


def _is_venv(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "pyvenv.cfg"))


def walk(paths: Sequence[str], report: WalkReport | None = None, *,
         tail_large: bool = True) -> Iterator[Member]:
    """Yield the files to read for ``paths``: files as given, folders walked (module docstring).

    Args:
        paths: Files (``-`` for standard input) and folders.
        report: Receives what was skipped, cut or left out.
        tail_large: Read folder members over :data:`MAX_FILE_BYTES` from their tail
            (``diagnose``); ``False`` yields them whole (``replay`` of recordings).
    """
    report = report if report is not None else WalkReport()
    count = 0
    for path in paths:
        if not os.path.isdir(path):
            yield Member(path)
            continue
        for root, dirs, files in os.walk(path, followlinks=False):
            kept: list[str] = []
            for d in sorted(dirs):
                full = os.path.join(root, d)
                if os.path.islink(full):
                    report.skipped["symbolic link(s)"] += 1
                elif d.startswith(".") or d in SKIPPED_FOLDERS or _is_venv(full):
                    report.skipped["folder(s) of code or hidden"] += 1
                else:
                    kept.append(d)
            dirs[:] = kept
            for name in sorted(files):
                full = os.path.join(root, name)
                member = _member(full, name, report, tail_large=tail_large)
                if member is None:
                    continue
                if count >= report.max_files:
                    report.stopped = True
                    return
                count += 1
                yield member


def _member(full: str, name: str, report: WalkReport, *, tail_large: bool) -> Member | None:
    if name.startswith(".") or name == "README.md" or name.endswith(".json"):
        report.skipped["hidden or notes file(s)"] += 1
        return None
    suffix = os.path.splitext(name)[1].lower()
    if suffix in NOT_LOG_SUFFIXES:
        report.skipped["file(s) whose extension is not a log's"] += 1
        return None
    try:
        info = os.lstat(full)
    except OSError:
        report.skipped["unreadable file(s)"] += 1
        return None
    if stat.S_ISLNK(info.st_mode):
        report.skipped["symbolic link(s)"] += 1
        return None
    if not stat.S_ISREG(info.st_mode):
        report.skipped["special file(s) (pipes, sockets, devices)"] += 1
        return None
    try:
        with open(full, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        report.skipped["unreadable file(s)"] += 1
        return None
    if archive_kind(full):
        return Member(full, size=info.st_size)  # its reader opens it member by member
    if is_binary(head):
        report.skipped["binary file(s)"] += 1
        return None
    if tail_large and info.st_size > report.max_file_bytes and not head.startswith(_GZIP_MAGIC):
        report.tails.append(full)
        return Member(full, offset=info.st_size - report.max_file_bytes, size=info.st_size)
    return Member(full, size=info.st_size)


class _Window(io.RawIOBase):
    """The rest of an open file, as a stream its reader may close without closing the file."""

    def __init__(self, handle: io.BufferedReader) -> None:
        super().__init__()
        self._handle = handle

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        return self._handle.readinto(buffer)


@contextlib.contextmanager
def open_tail(member: Member) -> Iterator[io.BufferedReader]:
    """Open ``member`` at its offset, past the line the offset cuts (the tail of a big file).

    Raises:
        OSError: The file cannot be read.
    """
    with open(member.path, "rb") as handle:
        handle.seek(member.offset)
        if member.offset:
            handle.readline()  # the rest of a line cut by the offset
        yield io.BufferedReader(_Window(handle))

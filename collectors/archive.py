"""Opening support bundles: tar, tar.gz, tar.xz, tar.bz2 and zip, member by member.

Operators attach a whole bundle to a ticket (a sosreport, an OpenShift must-gather, a
``tar czf`` of ``/var/log``). Read as text, a ``.tar.gz`` is gzip-decompressed into tar
headers, NUL padding and members run together: the first line of each member carries the
header's bytes, a node name is read from the wrong place, and the padding looks like a
crashed syslog's. :func:`archive_kind` tells an archive by its content (not its name, so
``nvidia-bug-report.log.gz``, which is gzip of plain text, stays a text file), and
:func:`members` yields each regular member as its own stream, named
``archive:member``, so that every finding's evidence reads ``archive:member:line``.

Safety and bounds:

- Nothing is extracted: members are read as streams, and names from the archive never
  become paths on this machine. Members whose name is absolute or climbs out with
  ``..``, links (symbolic and hard), devices and folders are not read (the unsafe names
  are reported as issues; links and folders are ordinary in a sosreport and only logged).
- Tar archives are read in stream mode (``r|*``): one pass, one member's buffer at a time,
  and the member list the module keeps is emptied as it goes.
- At most ``max_members`` members are read and ``max_total_bytes`` decompressed bytes in
  all (a zip bomb stops there); reaching a cap is an issue naming it. A member inside the
  archive that is itself an archive is not opened (one issue), since bounds would not
  compose; a gzip member (``kern.log.1.gz``) is plain text and is read.
"""

from __future__ import annotations

import bz2
import contextlib
import dataclasses
import functools
import gzip
import io
import logging
import lzma
import posixpath
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, cast

from collectors.artifact import (
    ArtifactParser,
    ArtifactResult,
    ParseContext,
    ParseIssue,
    read_artifact,
)
from core.records import Record

logger = logging.getLogger(__name__)

MAX_MEMBERS = 20_000
"""Members read from one archive at most (a sosreport holds a few thousand files)."""

MAX_TOTAL_BYTES = 4 * 1024**3
"""Decompressed bytes read from one archive at most (4 GiB)."""

_TAR_MAGIC_AT = 257
_HEAD_BYTES = 512
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_XZ_MAGIC = b"\xfd7zXZ\x00"
_BZ2_MAGIC = b"BZh"
_GZIP_MAGIC = b"\x1f\x8b"


def _is_tar_header(head: bytes) -> bool:
    return head[_TAR_MAGIC_AT:_TAR_MAGIC_AT + 5] == b"ustar"


def _decompressed_head(raw: bytes, stream: IO[bytes]) -> bytes:
    """The first bytes of ``stream`` after the compression ``raw`` (its head) announces."""
    opener: Callable[[], io.BufferedIOBase]
    if raw.startswith(_GZIP_MAGIC):
        opener = functools.partial(gzip.GzipFile, fileobj=stream, mode="rb")
    elif raw.startswith(_XZ_MAGIC):
        opener = functools.partial(lzma.LZMAFile, stream)
    elif raw.startswith(_BZ2_MAGIC):
        opener = functools.partial(bz2.BZ2File, stream)
    else:
        return raw
    with opener() as opened:
        return opened.read(_HEAD_BYTES)


def archive_kind(path: str) -> str | None:
    """Return ``"tar"`` or ``"zip"`` when the file at ``path`` is such an archive, else ``None``.

    Decided by content: a tar header (``ustar`` at byte 257), plain or under gzip, xz or
    bzip2 compression, or a zip's local-file or end-of-directory signature. A gzip file of
    text (``nvidia-bug-report.log.gz``, ``kern.log.2.gz``) is not an archive. Standard
    input (``-``) and unreadable files are not either (the artifact reader reports them).
    """
    if path == "-":
        return None
    try:
        with open(path, "rb") as handle:
            raw = handle.read(_HEAD_BYTES)
            if raw.startswith(_ZIP_MAGICS):
                return "zip"
            handle.seek(0)
            head = _decompressed_head(raw, handle)
    except (OSError, EOFError, lzma.LZMAError, ValueError):
        return None
    return "tar" if _is_tar_header(head) else None


def _is_archive_head(head: bytes) -> bool:
    if head.startswith(_ZIP_MAGICS) or _is_tar_header(head):
        return True
    if head.startswith((_XZ_MAGIC, _BZ2_MAGIC)):
        return True
    if head.startswith(_GZIP_MAGIC):
        with contextlib.suppress(OSError, EOFError):
            return _is_tar_header(_decompressed_head(head, io.BytesIO(head)))
    return False


class _Budget:
    """Decompressed bytes left to read from one archive."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.exhausted = False


class _Capped(io.RawIOBase):
    """A member stream that ends where the archive's byte budget ends."""

    def __init__(self, inner: IO[bytes], budget: _Budget) -> None:
        super().__init__()
        self._inner = inner
        self._budget = budget

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._budget.left <= 0:
            self._budget.exhausted = True
            return 0
        want = min(len(view), self._budget.left)
        try:
            data = self._inner.read(want)
        except (zipfile.BadZipFile, tarfile.TarError, lzma.LZMAError, zlib.error,
                EOFError) as exc:  # a cut or corrupt member: the line reader reports it
            raise OSError(f"member cut or corrupt: {exc}") from exc
        view[:len(data)] = data
        self._budget.left -= len(data)
        return len(data)


@dataclass(frozen=True, slots=True)
class Member:
    """One regular file of an archive, open for reading.

    Attributes:
        name: ``archive:member`` as evidence and issues name it (the archive path as the
            user gave it, the member's name inside it).
        stream: The member's decompressed bytes; valid until the next member is taken.
    """

    name: str
    stream: BinaryIO


def _safe_name(name: str) -> str | None:
    """The member's name if reading it can never mean a path outside the archive."""
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return None
    parts = posixpath.normpath(name.replace("\\", "/")).split("/")
    if ".." in parts:
        return None
    return "".join(c if c.isprintable() else "?" for c in name)


def members(
    path: str,
    issues: list[ParseIssue],
    *,
    max_members: int = MAX_MEMBERS,
    max_total_bytes: int = MAX_TOTAL_BYTES,
) -> Iterator[Member]:
    """Yield the regular members of the archive at ``path``, in archive order.

    Args:
        path: The archive, as the user named it (the prefix of every member's name).
        issues: Where problems go: an unreadable or cut archive, an unsafe member name, a
            nested archive, a cap reached.
        max_members: Members read at most.
        max_total_bytes: Decompressed bytes read at most, over all members.
    """
    budget = _Budget(max_total_bytes)
    kind = archive_kind(path)
    taken = 0
    try:
        for name, opened in (_zip_members(path) if kind == "zip" else _tar_members(path)):
            shown = _safe_name(name)
            if shown is None:
                issues.append(ParseIssue(file=path, line=None, reason=(
                    f"member {name!r}: absolute or outside the archive (..); not read")))
                continue
            if taken >= max_members:
                issues.append(ParseIssue(file=path, line=None, reason=(
                    f"stopped after {max_members} members (the cap on members per "
                    "archive); the rest was not read")))
                return
            if budget.left <= 0:
                break
            taken += 1
            try:
                member = opened()
            except (RuntimeError, NotImplementedError, zipfile.BadZipFile) as exc:
                # an encrypted zip member, a compression method zipfile lacks
                issues.append(ParseIssue(file=f"{path}:{shown}", line=None,
                                         reason=f"cannot read: {exc}"))
                continue
            with member as inner:
                stream = io.BufferedReader(_Capped(inner, budget))
                if _is_archive_head(stream.peek(_HEAD_BYTES)[:_HEAD_BYTES]):
                    issues.append(ParseIssue(file=f"{path}:{shown}", line=None, reason=(
                        "an archive inside the archive: not opened (unpack it and "
                        "name it on its own)")))
                    continue
                yield Member(name=f"{path}:{shown}", stream=cast(BinaryIO, stream))
            if budget.exhausted:
                break
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile, lzma.LZMAError,
            ValueError, RuntimeError, NotImplementedError) as exc:
        issues.append(ParseIssue(file=path, line=None, reason=(
            f"archive cut or unreadable after {taken} member(s): {exc}")))
        return
    if budget.exhausted or budget.left <= 0:
        issues.append(ParseIssue(file=path, line=None, reason=(
            f"stopped after {max_total_bytes} decompressed bytes (the cap per archive), "
            f"in member {taken}; the rest was not read")))


_Opener = Any  # a callable returning a context manager over the member's bytes


def _tar_members(path: str) -> Iterator[tuple[str, _Opener]]:
    with tarfile.open(name=path, mode="r|*") as tar:
        for info in tar:
            cast(Any, tar).members = []  # stream mode: keep no list of what was read
            if not info.isreg():
                kind = ("link" if info.issym() or info.islnk() else
                        "folder" if info.isdir() else "special file")
                logger.debug("%s: %s %r not read", path, kind, info.name)
                continue
            handle = tar.extractfile(info)
            if handle is None:
                continue
            yield info.name, lambda handle=handle: contextlib.closing(handle)


def _zip_members(path: str) -> Iterator[tuple[str, _Opener]]:
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            file_type = stat.S_IFMT(info.external_attr >> 16)  # 0: not recorded
            if info.is_dir() or (file_type and file_type != stat.S_IFREG):
                logger.debug("%s: %r is not a regular file; not read", path, info.filename)
                continue
            yield info.filename, lambda info=info: archive.open(info)


ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar",
                    ".zip")
"""Endings taken off an archive's name where a node is named after its file."""


def strip_archive_suffix(name: str) -> str:
    """Return ``name`` without an archive ending.

    Examples:
        >>> strip_archive_suffix("gpu-017.tar.gz")
        'gpu-017'
        >>> strip_archive_suffix("nvidia-bug-report.log.gz")
        'nvidia-bug-report.log.gz'
    """
    lowered = name.lower()
    for suffix in ARCHIVE_SUFFIXES:
        if lowered.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name


_NOT_AN_ARTIFACT = ("empty file", "binary file", "no known artifact kind")
"""Reasons that, for one member of a bundle, only mean it is not an artifact: a bundle
holds configuration, binaries and empty files beside the logs. They are logged, and the
archive gets one issue only when none of its members was recognised."""


def read_archive(
    path: str,
    ctx: ParseContext,
    parsers: Sequence[ArtifactParser],
    result: ArtifactResult,
    *,
    max_members: int = MAX_MEMBERS,
    max_total_bytes: int = MAX_TOTAL_BYTES,
) -> Iterator[Record]:
    """Stream the records of every member of the archive at ``path``.

    As :func:`~collectors.artifact.read_artifact` does for one file, each member is read
    on its own (its sections detected afresh, its lines numbered from
    1) under ``ctx`` with ``file`` set to ``archive:member``, so evidence and issues name
    ``archive:member:line``. ``result`` sums the members' parsed lines, kinds and issues,
    and holds the archive's own (unsafe names, caps, a cut archive).
    """
    read = recognised = 0
    for member in members(path, result.issues, max_members=max_members,
                          max_total_bytes=max_total_bytes):
        one = ArtifactResult()
        member_ctx = dataclasses.replace(ctx, file=member.name)
        yield from read_artifact(member.name, member_ctx, parsers, one, stream=member.stream)
        read += 1
        result.parsed_lines += one.parsed_lines
        result.kinds.extend(one.kinds)
        if one.parsed_lines:
            recognised += 1
            result.add_issues(one.issues)
            continue
        skipped = [i for i in one.issues if i.reason.startswith(_NOT_AN_ARTIFACT)]
        for issue in skipped:
            logger.info("%s: not an artifact (%s)", issue.file, issue.reason)
        result.add_issues(i for i in one.issues if i not in skipped)
    if not recognised:
        result.issues.append(ParseIssue(file=path, line=None, reason=(
            f"no known artifact kind in any of the {read} member(s) read")))

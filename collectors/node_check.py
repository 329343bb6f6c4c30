"""One-shot reads of a node's state for ``gpuhealth check`` (a readiness gate, NHC-style).

``gather`` writes what the node's own tools say now into a folder, one file per source,
for :func:`gpuhealth.diagnose.diagnose` to judge as it judges pasted artifacts:

- ``nvidia-smi -q -x``: every GPU's state (fallen off the bus, ``Unknown Error``,
  uncorrectable ECC, row-remap failure and pending, recovery action, retired pages);
- the kernel log since the boot (``journalctl -k -b -o short-iso``, else ``dmesg -T``,
  also when journalctl answers ``-- No entries --``): Xid and SXid lines, AER errors,
  NVRM messages.

A tool that is missing, fails or does not answer within its timeout is reported as a
:class:`Gap` and read as nothing: an unreadable source never becomes a fault (the caller
decides what a gap means, and a node is never drained for one).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Gap:
    """A source that could not be read: ``what`` and why."""

    what: str
    why: str


@dataclass(frozen=True, slots=True)
class Source:
    """One command whose output is one artifact file."""

    file: str
    argv: tuple[str, ...]


SOURCES: tuple[tuple[Source, ...], ...] = (
    (Source("nvidia-smi-q.xml", ("nvidia-smi", "-q", "-x")),),
    (Source("kernel.log", ("journalctl", "-k", "-b", "--no-pager", "-o", "short-iso")),
     Source("kernel.log", ("dmesg", "-T"))),
)
"""Each entry: the commands tried in order until one answers."""


def only_journal_notes(output: bytes) -> bool:
    r"""Whether ``output`` holds no log lines, only journalctl's ``-- ... --`` notes.

    ``journalctl`` prints ``-- No entries --`` (and, in older versions, ``-- Logs begin
    at ... --``) and exits 0 when it has nothing to show.

    Examples:
        >>> only_journal_notes(b"-- No entries --\n")
        True
        >>> only_journal_notes(b"-- Logs begin at Mon --\nDec 02 kernel: NVRM: Xid 79\n")
        False
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return all(line.startswith(b"-- ") and line.endswith(b" --") for line in lines)


def gather(folder: Path, *, timeout_seconds: float = 20.0,
           sources: Sequence[Sequence[Source]] = SOURCES) -> tuple[list[Path], list[Gap]]:
    """Run each source's commands (the first that answers) into ``folder``.

    Args:
        folder: Where the outputs go (one file per source).
        timeout_seconds: Longest wait for one command, seconds (``nvidia-smi`` on a node
            with a hung GPU can hang; slurmd kills a HealthCheckProgram after 60 s).
        sources: The sources, :data:`SOURCES` by default.

    Returns:
        The files written, and the sources that could not be read.
    """
    files: list[Path] = []
    gaps: list[Gap] = []
    for alternatives in sources:
        why = ""
        for source in alternatives:
            binary = shutil.which(source.argv[0])
            if binary is None:
                why = why or f"{source.argv[0]} not installed"
                continue
            try:
                done = subprocess.run([binary, *source.argv[1:]], capture_output=True,
                                      timeout=timeout_seconds, check=False)
            except subprocess.TimeoutExpired:
                why = f"{' '.join(source.argv)} did not answer within {timeout_seconds:.0f} s"
                continue
            except OSError as exc:
                why = f"{' '.join(source.argv)}: {exc.strerror}"
                continue
            if done.returncode != 0 or not done.stdout.strip():
                err = done.stderr.decode(errors="replace").strip().splitlines()
                why = (f"{' '.join(source.argv)} exited {done.returncode}"
                       + (f": {err[-1][:200]}" if err else ""))
                continue
            if only_journal_notes(done.stdout):
                # journalctl exits 0 with "-- No entries --" when the journal holds nothing
                # of this boot (a volatile journal, a container): try the next command.
                why = f"{' '.join(source.argv)} printed no entries"
                continue
            path = folder / source.file
            path.write_bytes(done.stdout)
            files.append(path)
            why = ""
            break
        if why:
            gaps.append(Gap(what=alternatives[0].file, why=why))
    return files, gaps

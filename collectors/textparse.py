"""Pieces shared by the artifact parsers: evidence and issues for input lines, a session base.

Every parser cites the line a record rests on as :class:`Evidence` and reports
what it could not read as a :class:`ParseIssue` naming the file and line.
"""

from __future__ import annotations

from collectors.artifact import Line, ParseContext, ParseIssue
from core.records import Evidence, Record


def line_evidence(ctx: ParseContext, line: Line) -> Evidence:
    """Return the evidence of one input line."""
    return Evidence(file=ctx.file, line=line.number, text=line.text)


class Session:
    """Common state of a parser session: the context and the issues found so far.

    Subclasses implement ``feed``; ``close`` returns nothing unless they hold
    records back.
    """

    def __init__(self, ctx: ParseContext) -> None:
        self.ctx = ctx
        self.issues: list[ParseIssue] = []

    def issue(self, line: int | None, reason: str) -> None:
        """Record that ``line`` (1-based, or ``None`` for the section) could not be parsed."""
        self.issues.append(ParseIssue(file=self.ctx.file, line=line, reason=reason))

    def close(self) -> list[Record]:
        """Nothing is held back."""
        return []

"""Tables of the reports, fitted to the terminal they are shown in, or plain in a log.

A rank's stdout is a pipe under ``mpiexec``, so a rank cannot ask its stdout how wide
the terminal is. The local launcher, whose stdout is the user's, passes the width down
in ``STREAMRING_TERMINAL_COLUMNS`` (``shutil.get_terminal_size``: the terminal's width,
or ``COLUMNS`` when set); without it, a process whose stdout is a terminal asks the
terminal. Then a table is drawn with rich, never wider than the terminal: headers wrap
at spaces, numbers never do, and columns that do not fit go to a second table that
repeats the first (key) column. Otherwise (a file, a pipe, a CI log) the table is printed
in a plain fixed-width form: one header line of names without spaces and one line per
row, never wrapped, easy to read and to ``grep``/``awk``.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from dataclasses import dataclass
from typing import Union

from rich.console import Console
from rich.table import Table
from rich.text import Text

TERMINAL_COLUMNS_ENV = "STREAMRING_TERMINAL_COLUMNS"
MIN_COLUMNS = 20  # narrower than this is not a terminal anyone reads a table in: plain form

Cell = Union[str, Text]


def terminal_columns(stream=None) -> int | None:
    """Columns of the terminal the output is shown in, or ``None`` when it goes to a log (file or pipe)."""
    stream = sys.stdout if stream is None else stream
    env = os.environ.get(TERMINAL_COLUMNS_ENV, "").strip()
    if env:
        try:
            return max(int(env), MIN_COLUMNS)
        except ValueError:
            pass
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return shutil.get_terminal_size().columns if tty else None


@dataclass
class Column:
    """One column: ``header`` in a terminal, ``key`` (no spaces) in the plain form."""

    header: str
    key: str = ""
    justify: str = "right"
    wrap: bool = False  # free text that may wrap in a terminal (numbers and codes never do)

    def __post_init__(self):
        if not self.key:
            self.key = self.header.replace(" ", "_")


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


class Report:
    """Where rank 0 (or a local command) prints: a fitted rich table or the plain form.

    Args:
        file: the stream (default ``sys.stdout``).
        width: terminal columns; default :func:`terminal_columns`; ``None`` = plain form.
    """

    _AUTO = object()

    def __init__(self, file=None, width=_AUTO):
        self.file = sys.stdout if file is None else file
        self.width = terminal_columns(self.file) if width is Report._AUTO else width
        if self.width is not None and self.width < MIN_COLUMNS:
            self.width = None
        self.console = (Console(file=self.file, width=self.width, highlight=False, force_terminal=True)
                        if self.width is not None else None)

    @property
    def plain(self) -> bool:
        return self.console is None

    def line(self, text: Cell) -> None:
        """A line of text (a verdict, a note); wrapped at spaces in a terminal, as is in a log."""
        if self.console is not None:
            self.console.print(text if isinstance(text, Text) else Text(text))
        else:
            print(_plain(text), file=self.file)
        self.file.flush()

    def table(self, title: str, columns: list[Column], rows: list[list[Cell]]) -> None:
        """Print ``title`` then the table (the first column is the key, repeated when the table is split)."""
        for row in rows:
            if len(row) != len(columns):
                raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns")
        if self.console is None:
            self._plain_table(title, columns, rows)
            return
        groups = self._groups(columns, rows)
        if groups is None:  # not even the key and one column fit: the plain form is still readable
            self._plain_table(title, columns, rows)
            return
        self.console.print(Text(title, style="bold"))
        for cols in groups:
            self.console.print(self._rich_table(columns, rows, cols))
        self.file.flush()

    # -- plain form --------------------------------------------------------------------------
    def _plain_table(self, title: str, columns: list[Column], rows: list[list[Cell]]) -> None:
        cells = [[_plain(c) for c in row] for row in rows]
        widths = [max([len(col.key)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]

        def fmt(values):
            return "  ".join(v.ljust(w) if col.justify == "left" else v.rjust(w)
                             for v, w, col in zip(values, widths, columns)).rstrip()

        print(title, file=self.file)
        print(fmt([c.key for c in columns]), file=self.file)
        for r in cells:
            print(fmt(r), file=self.file)
        self.file.flush()

    # -- terminal form -------------------------------------------------------------------------
    @staticmethod
    def _widths(columns, rows, i) -> tuple[int, int]:
        """(narrowest, preferred) content width of column ``i``: equal unless it is a free-text column."""
        col = columns[i]
        cells = max((len(_plain(r[i])) for r in rows), default=0)
        word = max((len(w) for w in col.header.split()), default=0)
        if not col.wrap:
            return max(cells, word), max(cells, word)
        # free text: as narrow as its longest word (long words fold at 16), at most 40 columns when there is room
        longest_word = max((len(w) for r in rows for w in _plain(r[i]).split()), default=0)
        narrow = max(word, min(longest_word, 16))
        return narrow, max(narrow, min(cells, 40))

    def _rich_table(self, columns, rows, cols) -> Table:
        t = Table(highlight=False)
        for i in cols:
            col = columns[i]
            narrow, preferred = self._widths(columns, rows, i)
            header = "\n".join(textwrap.wrap(col.header, width=narrow, break_long_words=False)) or col.header
            if col.wrap:
                t.add_column(header, justify=col.justify, overflow="fold", min_width=narrow, max_width=preferred)
            else:
                t.add_column(header, justify=col.justify, no_wrap=True, width=narrow)
        for r in rows:
            t.add_row(*[r[i] if isinstance(r[i], Text) else Text(str(r[i])) for i in cols])
        return t

    def _fits(self, columns, rows, cols) -> bool:
        # The default box: every column is its content, a space either side and a rule on its
        # left; one more rule closes the table.
        return sum(self._widths(columns, rows, i)[0] + 3 for i in cols) + 1 <= self.width

    def _groups(self, columns, rows) -> list[list[int]] | None:
        """Columns per table: the key column first in each, as many as fit; ``None`` if a pair does not fit."""
        if not columns or not self._fits(columns, rows, [0]):
            return None
        groups, current = [], [0]
        for i in range(1, len(columns)):
            if self._fits(columns, rows, current + [i]):
                current.append(i)
                continue
            if len(current) == 1 or not self._fits(columns, rows, [0, i]):
                return None
            groups.append(current)
            current = [0, i]
        groups.append(current)
        return groups

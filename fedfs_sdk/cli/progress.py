"""Progress display of the CLI commands (never used by library code).

On a terminal: a tqdm bar on stderr. When stderr is not a terminal (a log file, a pipe, CI)
a bar would write a ``\\r`` frame per update — tens of KB of noise in a log — so instead one
plain line is written each time another 10 % is done (or, with no known total, at most
every 30 s), and one when the task ends.
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterator, TextIO

LINE_STEP = 0.10
"""A line per this fraction of the total (non-terminal output)."""
LINE_INTERVAL_S = 30.0
"""At most one line per this many seconds when the total is unknown (non-terminal output)."""


class LineProgress:
    """The subset of tqdm's interface the CLI uses (``n``, ``total``, ``update``,
    ``set_postfix``, ``set_postfix_str``, ``close``), writing whole lines."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", file: TextIO | None = None) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.file = file if file is not None else sys.stderr
        self.n = 0
        self._postfix = ""
        self._t0 = self._last_t = time.monotonic()
        self._last_step = 0           # last 10 % step reported
        self._reported_n = 0
        self._closed = False

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if self.total:
            step = int(min(self.n, self.total) / self.total / LINE_STEP + 1e-9)
            if step > self._last_step:
                self._last_step = step
                self._line(now)
        elif now - self._last_t >= LINE_INTERVAL_S:
            self._line(now)

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = dict(ordered_dict or {}, **kwargs)
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = str(s)

    def refresh(self) -> None:
        pass

    def _line(self, now: float, final: bool = False) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        post = f" [{self._postfix}]" if self._postfix else ""
        done = " done" if final else ""
        self.file.write(f"{self.desc}:{done} {count} {self.unit}{pct} in {now - self._t0:.1f} s{post}\n")
        self.file.flush()
        self._last_t, self._reported_n = now, self.n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.n and self.n != self._reported_n:
            self._line(time.monotonic(), final=True)


class _Silent:
    n, total = 0, None

    def update(self, k: int = 1) -> None:
        self.n += k

    def set_postfix(self, *a: Any, **k: Any) -> None:
        pass

    def set_postfix_str(self, *a: Any, **k: Any) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def progress_bar(desc: str, total: int | None = None, unit: str = "it", disable: bool = False,
                 file: TextIO | None = None) -> Iterator[Any]:
    """A progress display for ``desc``: nothing if ``disable``; a tqdm bar if ``file``
    (default stderr) is a terminal; else :class:`LineProgress`."""
    file = file if file is not None else sys.stderr
    if disable:
        bar: Any = _Silent()
    elif _isatty(file):
        from tqdm import tqdm
        bar = tqdm(total=total, desc=desc, unit=unit, file=file, dynamic_ncols=True, leave=False)
    else:
        bar = LineProgress(desc, total, unit, file)
    try:
        yield bar
    finally:
        bar.close()


def _isatty(f: TextIO) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


__all__ = ["progress_bar", "LineProgress"]

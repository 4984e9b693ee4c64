"""What a person sees while `stream run` works: a progress bar per stream, a summary table at the end.

rich is imported where it is used (about 50 ms of a 2-core machine's start-up): without bars, not before the
summary, after the streams have ended.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from stream.core.stats import StreamStats

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID
    from rich.table import Table


class ProgressBars:
    """One bar per stream; updated from the loop thread only (the Runner's progress callback)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> ProgressBars:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[fps]:>6.1f} fps"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, stream: str, frames: int, expected: int | None) -> None:
        if self._progress is None:
            return
        task = self._tasks.get(stream)
        if task is None:
            task = self._tasks[stream] = self._progress.add_task(stream, total=expected, fps=0.0)
        elapsed = self._progress.tasks[task].elapsed or 0.0
        self._progress.update(task, completed=frames, total=expected, fps=frames / elapsed if elapsed > 0 else 0.0)


def progress_enabled(setting: str) -> bool:
    return setting == "on" or (setting == "auto" and sys.stderr.isatty())


def summary_table(stats: dict[str, StreamStats], device: str) -> Table:
    from rich.console import JustifyMethod
    from rich.table import Table

    table = Table(title=f"stream run ({device})", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("stream", "left"),
        ("state", "left"),
        ("frames", "right"),
        ("fps", "right"),
        ("detections", "right"),
        ("error", "left"),
    )
    for col, just in columns:
        table.add_column(col, justify=just)
    for st in stats.values():
        table.add_row(st.id, st.state, str(st.frames), f"{st.fps:.1f}", str(st.detections), (st.error or "")[:120])
    return table


def print_summary(stats: dict[str, StreamStats], device: str) -> None:
    from rich.console import Console

    Console(stderr=True, width=160).print(summary_table(stats, device))

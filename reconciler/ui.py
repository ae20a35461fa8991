"""Terminal output: progress while the job runs (stderr) and the summary table at the end."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from reconciler.mark import CATEGORIES, MARKED_CATEGORIES


def human_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class NullUi:
    """No output (tests, library use)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def note(self, text: str) -> None:
        pass

    def count(self, n: int) -> None:
        pass


class RichUi(NullUi):
    """A line per phase with a spinner, elapsed time and the running Spark stage's tasks."""

    def __init__(self, spark: Any = None) -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TextColumn("{task.fields[detail]}", style="dim"),
                                 TimeElapsedColumn(), console=self.console, transient=False)
        self.spark = spark
        self._task: Any = None
        self._stop = threading.Event()
        self._counted = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.progress.start()
        task = self.progress.add_task(name, total=None, detail="")
        self._task = task
        self._counted = 0
        self._stop.clear()
        poller = threading.Thread(target=self._poll, daemon=True)
        poller.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._stop.set()
            poller.join(timeout=2)
            self.progress.update(task, total=1, completed=1,
                                 description=("[green]✓[/] " if ok else "[red]✗[/] ") + name)
            self.progress.stop()
            self._task = None

    def note(self, text: str) -> None:
        if self._task is not None:
            self.progress.update(self._task, detail=text)

    def count(self, n: int) -> None:
        self._counted = n
        self.note(f"{n:,} records")

    def _poll(self) -> None:
        if self.spark is None:
            return
        tracker = self.spark.sparkContext.statusTracker()
        while not self._stop.wait(0.5):
            try:
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
                stages = [s for s in stages if s is not None]
                if stages:
                    done = sum(s.numCompletedTasks for s in stages)
                    total = sum(s.numTasks for s in stages)
                    self.note(f"spark tasks {done}/{total}")
            except Exception:  # the poller is cosmetic
                time.sleep(0.5)


def summary_table(summary: dict[str, Any]) -> Any:
    """A rich renderable of a run summary."""
    from rich.table import Table

    ok = summary.get("success")
    title = (f"reconcile {summary.get('repository')} · run {summary.get('run_id')} · "
             f"{summary.get('mode')}{' (dry run)' if summary.get('dry_run') else ''} · "
             + ("[green]mark ok[/]" if ok else "[red]mark FAILED[/]"))
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    table.add_column("objects", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("", style="dim")
    mark = summary.get("mark") or {}
    cats = mark.get("categories") or {}
    for c in CATEGORIES:
        v = cats.get(c) or {"count": 0, "bytes": 0}
        table.add_row(c, f"{v['count']:,}", human_bytes(v["bytes"]),
                      "marked" if c in MARKED_CATEGORIES else "kept")
    if mark:
        table.add_row("[bold]listed[/]", f"{mark.get('listed', 0):,}",
                      human_bytes(mark.get("listed_bytes", 0)), "", end_section=False)
        table.add_row("[bold]marked[/]", f"{mark.get('marked', 0):,}",
                      human_bytes(mark.get("marked_bytes", 0)), "", end_section=True)
    sweep = summary.get("sweep") or {}
    if sweep:
        table.add_row("sweep", sweep.get("status", ""), "",
                      sweep.get("error") or sweep.get("reason") or "")
        for k in ("confirmed", "failed", "skipped_live", "skipped_changed", "skipped_retained",
                  "refused"):
            if k in sweep:
                extra = human_bytes(sweep.get("confirmed_bytes", 0)) if k == "confirmed" else ""
                table.add_row(f"  {k}", f"{sweep[k]:,}", extra, "")
    cross = summary.get("crosscheck") or {}
    for name, v in cross.items():
        if isinstance(v, dict) and "count" in v:
            table.add_row(f"cross-check: {name}", f"{v['count']:,}", "", "")
    closed = summary.get("fail_closed") or {}
    if closed:
        table.add_row("[yellow]fail-closed[/]", "", "", str(closed.get("note", "")))
    if summary.get("error"):
        table.add_row("[red]error[/]", "", "", str(summary["error"]))
    return table

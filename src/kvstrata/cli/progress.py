"""cli/progress.py: ``shard_bar``, the progress bar of the operator commands that walk a disk tier
(``kvstrata check``, ``gc``, ``stats``): shard folders done of the tier's 256, blocks so far, time
elapsed, and a spinner for work that has no total (``gc``'s own).

It goes to stderr, and only when stderr is a terminal: a script reading stdout (``--json``) or a
log file never sees it. A disabled bar is the same object doing nothing, so callers never branch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from kvstrata.tiers.folder import SHARDS

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

SHARD_FOLDERS = len(SHARDS)


class ShardBar:
    """One bar, in stages (``stage``, each a line of its own): a description and, with
    ``shards``, a count of the 256 shard folders; ``update`` moves it. rich draws it from its own
    thread a few times a second, so an update only records the figures."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress  # None: disabled
        self._task: TaskID | None = None

    def stage(self, description: str, shards: bool = True) -> None:
        """Start a stage: counting shard folders (``shards``), or a spinner with no total."""
        if self._progress is None:
            return
        self.finish()
        self._task = self._progress.add_task(description, total=SHARD_FOLDERS if shards else None, detail="")

    def finish(self) -> None:
        """The current stage ends; its line stays with its last figures (a stage without a total
        is shown full; a count of shard folders as far as it got: ``stats --wait`` may stop early)."""
        if self._progress is not None and self._task is not None:
            if self._progress.tasks[-1].total is None:
                self._progress.update(self._task, total=1, completed=1)
            self._task = None

    def update(self, shards: int, items: int, unit: str = "blocks") -> None:
        """``shards`` shard folders done, ``items`` ``unit`` so far (this stage)."""
        if self._progress is None or self._task is None:
            return
        detail = f"{shards}/{SHARD_FOLDERS} shard folders, {items:,} {unit}"
        self._progress.update(self._task, completed=min(shards, SHARD_FOLDERS), detail=detail)


@contextmanager
def shard_bar(enabled: bool) -> Iterator[ShardBar]:
    """A ``ShardBar`` shown on stderr while the block runs, if ``enabled`` and stderr is a
    terminal; otherwise one that does nothing. The last figures stay on screen afterwards."""
    if not enabled:
        yield ShardBar(None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield ShardBar(None)
        return
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console)
    bar = ShardBar(progress)
    with progress:
        try:
            yield bar
        finally:
            bar.finish()

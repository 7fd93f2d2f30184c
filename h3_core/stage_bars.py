"""Progress bars for the engine's (stage, done, total) callback: the `h3` command's, and a script's."""

from __future__ import annotations

import sys


class StageBars:
    """A pipeline progress callback, (stage, done, total): one progress bar on stderr per stage, the last
    stage's closed when the next begins. Written to a file or a pipe (a log), a bar is redrawn every 30 s
    instead of ten times a second, and each stage's last state stays as a line of its own (on a terminal the
    next stage's bar takes its place)."""

    def __init__(self, quiet: bool = False):
        self.bars = {}
        self.quiet = quiet

    def __enter__(self) -> "StageBars":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is None:
            self.close()
            terminal = sys.stderr.isatty()
            bar = self.bars[stage] = tqdm(total=total, desc=stage, file=sys.stderr, leave=not terminal,
                                          mininterval=0.1 if terminal else 30.0, disable=self.quiet)
        if total != bar.total:
            bar.total = total
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()  # a stage met again (the DiT read anew after a worker failed) gets a bar of its own

"""Progress of long work, on a terminal and in a log file alike.

    progress = Progress()                  # rich on a terminal, plain lines otherwise
    progress.stage("Table 1")              # 17:02:11 Table 1
    for i, name in enumerate(runs, 1):
        progress.run(i, len(runs), name)   # 17:02:40 run 3/17 adamw (ETA 17:06:10, 3:30 left)
        bar = progress.steps(steps, name)  # per-step bar (terminal) or a line every ~10%
        for step in ...: bar(step, loss)
        bar.close()
    progress.close()

On a terminal (``stream.isatty()``) a rich status line shows the current stage and run and
a bar shows the steps; otherwise every stage, run and tenth of a run prints one
``HH:MM:SS message`` line, flushed at once, so a log file, CI or ``nohup`` sees the work move.
The ETA of a run assumes the remaining runs take as long as a typical finished run of the
same stage: the lower median of their times, so that one run carrying a one-off cost (the
first run's imports, one model of many that needs a numeric check) does not set the estimate
for the rest, as a mean did (``attnid report --all`` once said 15 min left of a 1-min job). A
stage whose runs are not alike (``stage(name, alike=False)``) shows no ETA at all.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "StepBar"]


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StepBar:
    """Steps of one run: ``bar(step, loss)``; ``bar.close()`` at the end. Plain mode prints
    a line at every tenth of the run (with loss and ETA); rich mode draws a transient bar."""

    def __init__(self, owner: Progress, total: int, label: str, start: int = 0) -> None:
        self.owner, self.total, self.label, self.start = owner, max(1, total), label, start
        self.t0 = owner.clock()
        self.next_tenth = 1
        self._rich = None
        if owner.rich:
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn(label), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"),
                                      TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(),
                                      transient=True, console=owner.console)
            self._task = self._rich.add_task(label, total=total, completed=start, loss="-")
            owner._pause_status()  # rich shows one live display at a time
            self._rich.start()

    def __call__(self, step: int, loss: float) -> None:
        if self._rich is not None:
            self._rich.update(self._task, completed=step, loss=f"{loss:.3f}")
            return
        done = (step - self.start) / max(1, self.total - self.start)
        if done * 10 >= self.next_tenth or step == self.total:
            self.next_tenth = int(done * 10) + 1
            elapsed = self.owner.clock() - self.t0
            left = elapsed * (1 - done) / done if done > 0 else 0.0
            self.owner.line(f"{self.label}: step {step}/{self.total}, loss {loss:.3f}, "
                            f"{_clock_text(left)} left")

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
            self.owner._resume_status()


class Progress:
    """Stages and runs of a long command, shown on ``stream`` (stderr by default).

    ``rich=None`` picks rich when the stream is a terminal. ``enabled=False`` shows nothing.
    ``clock`` (seconds) is injectable for tests.
    """

    def __init__(self, stream: TextIO | None = None, *, rich: bool | None = None, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.rich = enabled and (rich if rich is not None else _isatty(self.stream))
        self.clock = clock
        self.console = None
        self._status = None
        self._run_started: float | None = None
        self._run_seconds: list[float] = []
        self._alike = True
        if self.rich:
            from rich.console import Console

            self.console = Console(file=self.stream)

    def line(self, message: str) -> None:
        """One plain ``HH:MM:SS message`` line (or a rich log line on a terminal)."""
        if not self.enabled:
            return
        if self.console is not None:
            self.console.print(f"{time.strftime('%H:%M:%S')} {message}", highlight=False)
            return
        self.stream.write(f"{time.strftime('%H:%M:%S')} {message}\n")
        self.stream.flush()

    def stage(self, name: str, *, alike: bool = True) -> None:
        """A new stage of the work: closes the timing of the current run, and the ETA of the
        stage's runs counts only them (a stage's runs are alike; another stage's are not).
        ``alike=False``: the stage's runs differ in cost, and no ETA is shown."""
        self._end_run()
        self._run_seconds = []
        self._alike = alike
        self._show(name)

    def run(self, i: int, n: int, name: str) -> None:
        """Run ``i`` of ``n`` (1-based) starts; shows the ETA of all ``n`` from the runs so far."""
        self._end_run()
        self._run_started = self.clock()
        msg = f"run {i}/{n} {name}"
        if self._run_seconds and self._alike:
            left = statistics.median_low(self._run_seconds) * (n - i + 1)
            eta = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
            msg += f" (ETA {eta}, {_clock_text(left)} left)"
        self._show(msg)

    def steps(self, total: int, label: str = "train", start: int = 0) -> Callable[[int, float], None]:
        """A per-step bar for one run (a no-op when disabled); call ``.close()`` when done."""
        if not self.enabled:
            return _NoBar()
        return StepBar(self, total, label, start)

    def close(self) -> None:
        self._end_run()
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end_run(self) -> None:
        if self._run_started is not None:
            self._run_seconds.append(self.clock() - self._run_started)
            self._run_started = None

    def _pause_status(self) -> None:
        if self._status is not None:
            self._status.stop()

    def _resume_status(self) -> None:
        if self._status is not None:
            self._status.start()

    def _show(self, message: str) -> None:
        if not self.enabled:
            return
        if self.console is None:
            self.line(message)
            return
        if self._status is None:
            self._status = self.console.status(message)
            self._status.start()
        else:
            self._status.update(message)
        self.console.print(f"{time.strftime('%H:%M:%S')} {message}", highlight=False)


class _NoBar:
    def __call__(self, step: int, loss: float) -> None:
        pass

    def close(self) -> None:
        pass


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

"""What the user watches on the driver: a rich bar on a terminal, plain lines in a Slurm .out file.
On a terminal the start has a line of its own too, which says what it waits for, until the first step."""

from __future__ import annotations

import sys
import time
from typing import Any

from raytrain_ddp.driver.core.startup import RUN_STAGES, waiting_line
from raytrain_ddp.run_records import RunState

PLAIN_EVERY_S = 10.0
"""Plain mode prints a step line at most this often, so .out files stay readable."""


def epoch_line(row: dict[str, Any], epochs: int) -> str:
    return (
        f"epoch {row['epoch']}/{epochs}  "
        f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.3f}  "
        f"val loss {row['val_loss']:.4f} acc {row['val_acc']:.3f}  "
        f"{row['throughput']:.1f} samples/s  {row['epoch_time_s']:.1f} s"
        + (f"  skipped {row['skipped_samples']} unreadable" if row.get("skipped_samples") else "")
        # After a resize the world, and without --global-batch-size the global batch, changed: say so.
        + (f"  {row['world_size']} worker{'s' if row['world_size'] != 1 else ''}, global batch "
           f"{row.get('global_batch')} (resized {row['resizes']}x)"
           if row.get("resizes") else "")
    )


class Display:
    """Turns successive polls of the MetricsSink into output. mode: rich, plain or none.

    In rich mode, from the command's start until the first step, a line that updates says which
    stage the start is in: `begin` is when the command's process began, `started` when its run()
    was called (both time.time()), and `marks` the driver's start-up marks (startup.py), which its
    plan fills in as it goes; the sink's news adds rank 0's.
    """

    def __init__(self, mode: str, epochs: int, begin: float | None = None, started: float | None = None,
                 marks: dict[str, float] | None = None):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode, self.epochs = mode, epochs
        self.shown: dict[int, dict[str, Any]] = {}  # the row last printed for each epoch
        self.last_plain = 0.0
        self.plain_step: tuple[int, int] | None = None
        """(epoch, step) of the last plain step line: a stalled run's step is not printed again."""
        self.bar = self.task = self.task_epoch = None
        self.begin, self.marks = begin or time.time(), marks if marks is not None else {}
        self.started_at = started or self.begin
        self.rank_marks: dict[str, float] = {}
        self.started = False
        """The first step came (or the run ended first): the start's line is gone."""
        if mode == "rich":
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            display = self

            class StartAndBar(Progress):
                """Rich's bar, below the start's line while there is one: one live area, so neither
                draws over the other (rich allows one at a time)."""

                def get_renderables(self):  # type: ignore[no-untyped-def]
                    if not display.started:
                        marks = {"python": display.started_at, **display.marks, **display.rank_marks}
                        yield waiting_line(display.begin, marks, RUN_STAGES, time.time())
                    yield from super().get_renderables()

            self.bar = StartAndBar(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("step {task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.bar.start()

    def print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line)
        elif self.mode != "none":
            print(line, flush=True)

    def update(self, state: RunState) -> None:
        self.rank_marks = state.startup or state.reached  # rank 0's, as it takes them
        self.started = self.started or state.step is not None or bool(state.rows)
        # A row comes again unchanged after a resume (from the checkpoint), and anew for an epoch that
        # a restarted worker group redid: print each row once, and a redone epoch's again.
        for row in state.rows:
            if self.shown.get(row["epoch"]) == row:
                continue
            self.print(epoch_line(row, self.epochs))
            self.shown[row["epoch"]] = row
            if self.task is not None:
                self.bar.remove_task(self.task)
                self.task = None
        step = state.step
        if step is None or step.epoch in {row["epoch"] for row in state.rows}:
            return
        total = state.steps_per_epoch
        if self.bar is not None:
            fields = {"loss": f"{step.loss:.4f}", "rate": f"{step.samples_per_s:.0f}"}
            if self.task is not None and self.task_epoch != step.epoch:
                self.bar.remove_task(self.task)  # a restarted worker group went back to an earlier epoch
                self.task = None
            if self.task is None:
                self.task = self.bar.add_task(f"epoch {step.epoch}/{self.epochs}", total=total, **fields)
                self.task_epoch = step.epoch
            self.bar.update(self.task, completed=step.step, **fields)
        elif (self.mode == "plain" and time.monotonic() - self.last_plain >= PLAIN_EVERY_S
              and (step.epoch, step.step) != self.plain_step):
            self.last_plain, self.plain_step = time.monotonic(), (step.epoch, step.step)
            self.print(
                f"epoch {step.epoch}/{self.epochs} step {step.step}/{total}  "
                f"loss {step.loss:.4f}  {step.samples_per_s:.1f} samples/s"
            )

    def close(self) -> None:
        """Stop the live area (its lines go); what is printed after goes out as plain lines."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

"""Rank 0's line to the driver: a small actor on the driver's node that rank 0 tells what happens,
and that the driver polls.

Ray Train V2 keeps no metrics reported without a checkpoint, and the driver is the one process sure
to see the user's `--storage-path`, so rank 0 sends its rows here; the driver writes the files.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from raytrain_ddp.doctor.ranks import ranks_from
from raytrain_ddp.run_records import GroupStart, Resize, RunState, Step


class Sink:
    """Holds what rank 0 last said (a RunState), and whether the driver asks to stop; MetricsSink is
    this as a Ray actor on the driver's node.

    Rank 0 calls it fire-and-forget, except for `start` and one `stop_requested` every so often.
    """

    def __init__(self) -> None:
        self.stop_asked = False
        self.state = RunState()
        self.rows: dict[int, dict[str, Any]] = {}
        self.beat: float | None = None
        """When (this actor's clock) rank 0 last said a step finished, validated a batch, or left a
        checkpoint, or its worker group started; None before a group starts, and while rank 0 writes
        a checkpoint."""
        self.beat_gaps: list[float] = []
        """The latest seconds between beats: the stall watch's measure of a slow step (doctor/stall_watch.py)."""
        self.stall_ended = False
        """The stall watch ended the running group: the next group's restart event says so."""

    def update(self, **fields: Any) -> None:
        self.state = dataclasses.replace(self.state, **fields)

    def reached(self, stage: str, at: float) -> None:
        """Rank 0 took start-up mark `stage` (startup.py) at `at`: the start's live line says so.
        The first group's only, as the start-up line counts."""
        if self.state.startup is None:
            self.update(reached={**self.state.reached, stage: at})

    def arrived(self, ranks: list[dict[str, Any]]) -> None:
        """Every rank of a worker group met (rank 0, before the health check, the data and the model):
        the stall watch counts from here, so a rank that hangs in its start-up is named as one that
        hangs in a step is, not after the collective's 30-minute timeout. `start` counts again."""
        self.beat = time.time()
        self.update(ranks=tuple(ranks_from(ranks)), step=None, phase="first step")

    def start(self, group: GroupStart) -> list[dict[str, Any]]:
        """A worker group started: who it is, where it resumed, the resizes its checkpoint holds, and
        rank 0's start-up marks. Returns the run's resizes (Resize.to_json each), which rank 0 adopts
        and saves in its checkpoints.

        Only this actor sees every worker group of this driver: a restart that found no registered
        checkpoint (a node lost while the first was being written) has nothing in its checkpoint to
        say so, yet it is a restart. So every group after the first is one event here, from the
        previous group's size to this one's; a resize the group found itself (its checkpoint's world
        size differs) is that same event.
        """
        found = [Resize.from_json(event) for event in group.resizes]
        previous = self.state.world_size
        # The epoch the group starts at: rows from there on were reported by a group that died before
        # its checkpoint was registered; they will be redone and reported again.
        epoch, position = (group.resumed_at or (1, 0))[:2]
        self.rows = {e: row for e, row in self.rows.items() if e < epoch}
        # The stall watch counts from here: this group's first step, where the loaders start and
        # torch.compile and cuDNN warm up, is a phase of its own (it says "first step", and its length
        # is no measure of a step).
        self.beat = time.time()
        stalled, self.stall_ended = self.stall_ended, False
        if previous is None:
            resizes = found
        else:
            # Every checkpoint of this driver's groups holds a list this actor returned; an event it
            # has not seen is the group's own for this start, from its checkpoint's world size, which
            # need not be the size of the group just before.
            known = list(self.state.resizes)
            seen = {event.at for event in known}
            own = [event for event in found if event.at not in seen]
            at = own[-1].at if own else time.time()
            resizes = [*known, Resize(at, epoch, position, previous, group.world_size, stall=stalled)]
        # A restarted worker group keeps the first group's start-up marks and first_step_unix.
        self.update(world_size=group.world_size, backend=group.backend, ranks=tuple(group.ranks),
                    steps_per_epoch=group.steps_per_epoch, resumed_at=group.resumed_at, resizes=tuple(resizes),
                    startup=self.state.startup if self.state.startup is not None else group.startup,
                    step=None, phase="first step")
        return [event.to_json() for event in resizes]

    def step(self, epoch: int, step: int, loss: float, at: float, samples_per_s: float) -> None:
        now = time.time()
        if self.state.phase != "first step" and self.beat is not None:
            self.beat_gaps = [*self.beat_gaps[-19:], now - self.beat]
        self.beat = now
        self.update(step=Step(epoch, step, loss, at, samples_per_s),
                    phase=None if self.state.phase == "first step" else self.state.phase,
                    first_step_unix=self.state.first_step_unix or at)  # time to first step, for benchmarks

    def epoch(self, row: dict[str, Any]) -> None:
        # Keyed by epoch: a worker group restarted after a failure reports the epoch again.
        self.rows[row["epoch"]] = row
        self.update(step=None)

    def phase(self, name: str | None) -> None:
        """Rank 0 entered a phase that is no training step, or left it (None). "validation" (the
        epoch's end) beats too, about once a second while rank 0 validates, so the stall watch counts
        its silence; a "checkpoint" is not counted: writing one may take long (a large model, slow
        storage); nor is "finished", the loop's end, after which Ray Train uploads the last checkpoint."""
        self.beat = None if name in ("checkpoint", "finished") else time.time()
        self.update(phase=name)

    def ended_for_stall(self) -> None:
        """The stall watch ended the group for Ray Train to restart: count the silence from now (the
        ended group is silent too), and the restart is a stall's."""
        self.beat, self.stall_ended = time.time(), True

    def quiet(self) -> tuple[float | None, list[float], str | None]:
        """Seconds since rank 0's last beat (None: no group started yet, or inside a checkpoint), the
        latest gaps between its steps, and the phase it is in (None: training steps; "first step",
        "validation", "checkpoint", "finished")."""
        return (None if self.beat is None else time.time() - self.beat), self.beat_gaps, self.state.phase

    def request_stop(self) -> None:
        """The driver got SIGUSR1/SIGTERM: the ranks checkpoint at their next agreed step and stop."""
        self.stop_asked = True

    def stop_requested(self) -> bool:
        return self.stop_asked

    def drain_saved(self, epoch: int, position: int) -> None:
        """Ray announced a node drain (a preemption); the ranks checkpointed and train on."""
        self.update(drain_saved=(epoch, position))

    def rank_parts(self, epoch: int, parts: list[dict[str, float]]) -> None:
        """Every rank's seconds in data, forward, backward and communication this epoch (worker/measure/part_clock.py)."""
        self.update(rank_parts={**self.state.rank_parts, epoch: parts})

    def health(self, nodes: list[dict[str, Any]]) -> None:
        """The pre-flight health check's per-node records (doctor/health.py), before the first step."""
        self.update(health=tuple(nodes))

    def profiled(self, rank: int, line: str) -> None:
        """A rank's --profile line (profiling.py), for the driver to show."""
        self.update(profiles={**self.state.profiles, rank: line})

    def config_error(self, message: str) -> None:
        """A rank raised a ConfigError: the driver's next poll ends the run (stops.RankConfigError). Every
        rank may say it; the first is kept."""
        if self.state.config_error is None:
            self.update(config_error=message)

    def stopped(self, epoch: int, step: int) -> None:
        self.update(stopped_at=(epoch, step))

    def poll(self) -> RunState:
        return dataclasses.replace(self.state, rows=tuple(self.rows[e] for e in sorted(self.rows)))


MetricsSink = ray.remote(num_cpus=0)(Sink)

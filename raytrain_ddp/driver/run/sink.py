"""Rank 0's line to the driver: a small actor on the driver's node that rank 0 tells what happens,
and that the driver polls.

Ray Train V2 keeps no metrics reported without a checkpoint, and the driver is the one process sure
to see the user's `--storage-path`, so rank 0 sends its rows here; the driver writes the files.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from raytrain_ddp.doctor.ranks import ranks_from


class Sink:
    """Holds what rank 0 last said, and whether the driver asks to stop; MetricsSink is this as a
    Ray actor on the driver's node.

    Rank 0 calls it fire-and-forget, except for `start` and one `stop_requested` every so often.
    """

    def __init__(self) -> None:
        self.stop_asked = False
        self.run: dict[str, Any] = {}
        self.last_step: dict[str, Any] | None = None
        self.rows: dict[int, dict[str, Any]] = {}
        self.beat: float | None = None
        """When (this actor's clock) rank 0 last said a step finished, validated a batch, or left a
        checkpoint, or its worker group started; None before a group starts, and while rank 0 writes
        a checkpoint."""
        self.beat_gaps: list[float] = []
        """The latest seconds between beats: the stall watch's measure of a slow step (doctor/stall_watch.py)."""
        self.stall_ended = False
        """The stall watch ended the running group: the next group's restart event says so."""

    def arrived(self, ranks: list[dict[str, Any]]) -> None:
        """Every rank of a worker group met (rank 0, before the health check, the data and the model):
        the stall watch counts from here, so a rank that hangs in its start-up is named as one that
        hangs in a step is, not after the collective's 30-minute timeout. `start` counts again."""
        self.run["ranks"] = ranks_from(ranks)
        self.last_step, self.beat = None, time.time()
        self.run["phase"] = "first step"

    def start(self, **run: Any) -> list[dict[str, Any]]:
        """A worker group started: who it is, where it resumed (`resumed_at`: epoch, position,
        step, or None), the resizes its checkpoint holds, and rank 0's start-up marks (`startup`:
        stage -> time.time()). Returns the run's resizes, which rank 0
        adopts and saves in its checkpoints.

        Only this actor sees every worker group of this driver: a restart that found no registered
        checkpoint (a node lost while the first was being written) has nothing in its checkpoint to
        say so, yet it is a restart. So every group after the first is one event here, from the
        previous group's size to this one's; a resize the group found itself (its checkpoint's world
        size differs) is that same event.
        """
        if "ranks" in run:
            run["ranks"] = ranks_from(run["ranks"])
        found = list(run.pop("resizes", None) or [])
        marks = run.pop("startup", None)
        if marks is not None:  # rank 0's start-up marks (startup.py): the first worker group's, as first_step_unix is
            self.run.setdefault("startup", marks)
        previous = self.run.get("world_size")
        # The epoch the group starts at: rows from there on were reported by a group that died before
        # its checkpoint was registered; they will be redone and reported again.
        epoch, position = (run.get("resumed_at") or [1, 0])[:2]
        self.rows = {e: row for e, row in self.rows.items() if e < epoch}
        # The stall watch counts from here: this group's first step, where the loaders start and
        # torch.compile and cuDNN warm up, is a phase of its own (it says "first step", and its length
        # is no measure of a step).
        self.last_step, self.beat = None, time.time()
        stalled, self.stall_ended = self.stall_ended, False
        self.run["phase"] = "first step"
        if previous is None:
            resizes = found
        else:
            # Every checkpoint of this driver's groups holds a list this actor returned; an event it
            # has not seen is the group's own for this start, from its checkpoint's world size, which
            # need not be the size of the group just before.
            known = self.run.get("resizes", [])
            seen = {event["at"] for event in known}
            own = [event for event in found if event["at"] not in seen]
            event = {**(own[-1] if own else {"at": time.time()}), "epoch": epoch, "position": position,
                     "from": previous, "to": run["world_size"]}
            if stalled:
                event["stall"] = True
            resizes = [*known, event]
        self.run.update(run, resizes=resizes)  # a restarted worker group keeps the first group's first_step_unix
        return resizes

    def step(self, **update: Any) -> None:
        self.last_step = update
        now = time.time()
        if self.run.get("phase") == "first step":
            self.run["phase"] = None
        elif self.beat is not None:
            self.beat_gaps = [*self.beat_gaps[-19:], now - self.beat]
        self.beat = now
        self.run.setdefault("first_step_unix", update["at"])  # time to first step, for benchmarks

    def epoch(self, row: dict[str, Any]) -> None:
        # Keyed by epoch: a worker group restarted after a failure reports the epoch again.
        self.rows[row["epoch"]] = row
        self.last_step = None

    def phase(self, name: str | None) -> None:
        """Rank 0 entered a phase that is no training step, or left it (None). "validation" (the
        epoch's end) beats too, about once a second while rank 0 validates, so the stall watch counts
        its silence; a "checkpoint" is not counted: writing one may take long (a large model, slow storage)."""
        self.beat = None if name == "checkpoint" else time.time()
        self.run["phase"] = name

    def ended_for_stall(self) -> None:
        """The stall watch ended the group for Ray Train to restart: count the silence from now (the
        ended group is silent too), and the restart is a stall's."""
        self.beat, self.stall_ended = time.time(), True

    def quiet(self) -> tuple[float | None, list[float], str | None]:
        """Seconds since rank 0's last beat (None: no group started yet, or inside a checkpoint), the
        latest gaps between its steps, and the phase it is in (None: training steps; "first step",
        "validation", "checkpoint")."""
        return (None if self.beat is None else time.time() - self.beat), self.beat_gaps, self.run.get("phase")

    def request_stop(self) -> None:
        """The driver got SIGUSR1/SIGTERM: the ranks checkpoint at their next agreed step and stop."""
        self.stop_asked = True

    def stop_requested(self) -> bool:
        return self.stop_asked

    def drain_saved(self, epoch: int, position: int) -> None:
        """Ray announced a node drain (a preemption); the ranks checkpointed and train on."""
        self.run["drain_saved"] = [epoch, position]

    def rank_parts(self, epoch: int, parts: list[dict[str, float]]) -> None:
        """Every rank's seconds in data, forward, backward and communication this epoch (worker/measure/part_clock.py)."""
        self.run.setdefault("rank_parts", {})[epoch] = parts

    def health(self, nodes: list[dict[str, Any]]) -> None:
        """The pre-flight health check's per-node records (doctor/health.py), before the first step."""
        self.run["health"] = nodes

    def profiled(self, rank: int, line: str) -> None:
        """A rank's --profile line (profiling.py), for the driver to show."""
        self.run.setdefault("profiles", {})[rank] = line

    def config_error(self, message: str) -> None:
        """A rank raised a ConfigError: the driver's next poll ends the run (stops.RankConfigError). Every
        rank may say it; the first is kept."""
        self.run.setdefault("config_error", message)

    def stopped(self, epoch: int, step: int) -> None:
        self.run["stopped_at"] = [epoch, step]

    def poll(self) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
        return self.run, self.last_step, [self.rows[e] for e in sorted(self.rows)]


MetricsSink = ray.remote(num_cpus=0)(Sink)

"""What rank 0 tells the driver of a `raytrain run`, and what the driver makes of it: the run's files
(metrics, TensorBoard, trackers, workers.json, rank_times.csv), its lines, the stall watch, the
health check's verdict, the blame of a failure, and the grace of a stop."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from raytrain_ddp.checkpoint.files import latest_checkpoint, read_info
from raytrain_ddp.config import ConfigError
from raytrain_ddp.doctor.bad_nodes import blame, record_bad_node, stall_hosts
from raytrain_ddp.doctor.health import NodeHealth, slow_nodes
from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.stall_watch import StallWatch
from raytrain_ddp.doctor.stragglers import RANK_TIMES, not_comparable, stragglers, write_rank_times
from raytrain_ddp.doctor.workers import write_workers
from raytrain_ddp.driver.core.drive import StartupClock
from raytrain_ddp.driver.plan.preflight import RunPlan
from raytrain_ddp.driver.run.progress import Display
from raytrain_ddp.run_files import tensorboard_writer, write_csv, write_parquet
from raytrain_ddp.run_records import RunState
from raytrain_ddp.stops import Interrupted, RankConfigError, Stopped, UnhealthyNode
from raytrain_ddp.storage.behind import WriteBehind
from raytrain_ddp.storage.location import RunPath, first_line
from raytrain_ddp.storage.object_path import ObjectPath

STORE_QUIET_S = 30.0
"""How long an object store may take none of the run's files before the driver says so: a write that
waits longer than a blip, well inside the minute a user should wait to hear why."""
RESUME_HINT = "run the same command again (same --storage-path and --name {name}) to resume"


def kept(run_dir: RunPath, name: str) -> str:
    """What a rerun of a run stopped without a new checkpoint starts from, and how to rerun it: a sentence."""
    rerun = RESUME_HINT.format(name=name).removesuffix(" to resume")
    try:
        checkpoint = latest_checkpoint(run_dir)
        saved = read_info(checkpoint) if checkpoint is not None else None
    except (ConfigError, OSError):  # an unreadable record or store: the rerun says so, not this stop
        return f"The last checkpoint is kept: {rerun} to resume from it"
    if checkpoint is None:
        return f"No checkpoint was saved yet: {rerun} to start again"
    where = f" (epoch {saved['epoch']} after {saved['position']} samples)" if saved else ""
    return f"The last checkpoint, {checkpoint.name}{where}, is kept: {rerun} to resume from it"


def profile_lines(profiles: dict[int, str], world_size: int, shown: dict[int, str]) -> tuple[list[str], dict[int, str]]:
    """--profile's line for each rank, in rank order once every rank's has come (they come a poll
    apart on a busy machine; ci55 showed rank 1's first), each again only if it changed since
    `shown`; and what is shown after."""
    if not profiles or len(profiles) < world_size:
        return [], shown
    return [line for rank, line in sorted(profiles.items()) if line != shown.get(rank)], dict(profiles)


def niced(ranks: list[RankProcess]) -> str | None:
    """The start's one line when ranks run niced, which a cluster we joined may do (Ray's workers
    default to nice 15); None when every rank runs at nice 0 or below."""
    low = [where for where in ranks if where.nice > 0]
    if not low:
        return None
    hosts = sorted({where.host for where in low})
    nice = max(where.nice for where in low)
    return (
        f"{len(low)} of {len(ranks)} ranks (on {', '.join(hosts)}) run at nice {nice}, so any process at nice 0 "
        "on their nodes takes the CPU first: start that cluster's Ray nodes with RAY_worker_niceness=0 in "
        "their environment (cluster/ray_node.sh and the sbatch do)"
    )


class RunNews:
    """Rank 0's news, polled from the sink by the driver core: each poll writes the run's files, says
    what happened (a resume, a drain, a resize, the start-up stages, stragglers) and judges whether
    the run may go on (the health check, a stall, a stop's grace)."""

    def __init__(self, sink: Any, display: Display, plan: RunPlan, trackers: Any, clock: StartupClock,
                 on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.sink, self.display, self.run_dir, self.trackers, self.clock = sink, display, plan.run_dir, trackers, clock
        self.on_rows = on_rows
        self.tensorboard = tensorboard_writer(plan.run_dir) if plan.cfg.tensorboard else None
        self.state = RunState()
        """What rank 0 said by the last poll."""
        self.written = RunState()
        """What the run's files hold: the state last written down whole (write_down)."""
        self.behind = WriteBehind("raytrain-run-files") if isinstance(plan.run_dir, ObjectPath) else None
        """On an object store: the thread the run's files are written on."""
        self.store_quiet = False
        """Whether the store was said to take none of the run's files, and has not taken them since."""
        self.stall = StallWatch(sink, plan.cfg.stall_timeout, plan.run_dir, display.print, plan.restarts)
        self.stalled: BaseException | None = None
        self.blamed = 0
        """The stalls recovered from whose culprits' nodes are recorded bad (blame_recovered)."""
        self.stragglers: set[tuple[int, str]] = set()
        """(rank, part) of the stragglers named so far: each is said once, its epochs are in rank_times.csv."""
        self.crowded = False
        """Whether the ranks were said to share their cores (so no straggler is named): said once."""
        self.profiles_shown: dict[int, str] = {}
        """Each rank's --profile line as last shown (profile_lines)."""
        self.finished_at: float | None = None
        """When the ranks were first seen out of their loop (monotonic); None while they train."""
        self.told_finished = False
        self.name, self.grace, self.health = plan.cfg.name, plan.cfg.stop_grace_s, plan.cfg.health
        self.stopping: str | None = None
        """The signal of the first stop asked for (SIGTERM, SIGUSR1, SIGINT), None before one."""
        self.stop_waited = 0.0
        """Seconds of training steps the ranks have not answered it in (stop_overdue)."""
        self.polled = time.monotonic()

    def stop_asked(self, name: str) -> None:
        """A stop was passed on to the ranks: the grace counts from the first."""
        self.stopping = self.stopping or name

    def poll(self) -> None:
        """One look at rank 0's news: written down, said, then judged."""
        import ray

        if self.stalled is not None:  # the core's last poll, after the stall ended the watch
            raise self.stalled
        state = ray.get(self.sink.poll.remote())
        if state.config_error:  # a rank's, which every retry would raise again
            raise RankConfigError(state.config_error)
        was, self.state = self.state, state
        self.write_down(state, was)
        for line in self.lines(state, was):
            self.display.print(line)
        self.display.update(state)
        try:
            self.judge(state)
        except (Exception, KeyboardInterrupt) as err:  # Stalled, Stopped; Interrupted is a KeyboardInterrupt
            self.stalled = err
            raise

    def write_down(self, state: RunState, was: RunState) -> None:
        """The new epoch rows to the trackers (and a sweep's trial), then the run's files. On an object
        store the files are written behind the poll (storage/behind.py), so a store that stops
        answering holds back the files, never the run's lines, its stall watch or a Ctrl-C; one that
        has taken none of them for STORE_QUIET_S is said once, and again when it takes them."""
        fresh = [row for row in state.rows if row not in was.rows]  # a redone epoch's row is fresh again
        if fresh:
            self.trackers.log_rows(fresh)
            if self.on_rows is not None:
                self.on_rows(list(state.rows))
        if self.behind is None:
            self.write_files(state)
            return
        self.behind.offer(functools.partial(self.write_files, state))
        quiet, error = self.behind.quiet()
        if error is not None and not isinstance(error, OSError):
            raise error  # ours, not the store's
        if quiet >= STORE_QUIET_S and not self.store_quiet:
            self.store_quiet = True
            why = first_line(error) if error is not None else "no answer yet"
            going = "the run's end waits for it" if state.phase == "finished" else "training goes on"
            self.display.print(f"warning: the object store has taken none of the run's files for {quiet:.0f} s "
                               f"({why}); {going}, and they are written to {self.run_dir} once it answers")
        elif quiet == 0 and self.store_quiet:
            self.store_quiet = False
            self.display.print(f"the run's files are written to {self.run_dir} again")

    def write_files(self, state: RunState) -> None:
        """The run's files where they changed since last written: metrics.csv and .parquet, TensorBoard,
        workers.json, rank_times.csv."""
        was = self.written
        if state.rows != was.rows:
            write_csv(self.run_dir / "metrics.csv", list(state.rows))
            write_parquet(self.run_dir / "metrics.parquet", list(state.rows))
            if self.tensorboard is not None:
                for row in [row for row in state.rows if row not in was.rows]:
                    for key, value in row.items():
                        if isinstance(value, (int, float)) and key != "epoch":
                            self.tensorboard.add_scalar(key, value, global_step=row["epoch"])
                self.tensorboard.flush()
        if state.ranks and state.ranks != was.ranks:
            # Which pid on which host is which rank: for the user, `raytrain stack` (and tests that kill one).
            write_workers(self.run_dir, list(state.ranks))
        if state.rank_parts and state.rank_parts != was.rank_parts:
            write_rank_times(self.run_dir, state.rank_parts, state.hosts)
        self.written = state

    def close(self) -> None:
        """The run's files as the last poll left them, whole, before its summary. On an object store that
        has taken none of them for STORE_QUIET_S the driver does not wait (a second Ctrl-C ends it at
        once): that is said, and the summary's own write then ends the run on the store's line."""
        if self.behind is None:
            return
        try:
            if not self.behind.close(give_up_s=STORE_QUIET_S):
                self.display.print(f"warning: the run's files at {self.run_dir} are not brought up to date: the "
                                   f"object store has not answered for {STORE_QUIET_S:.0f} s")
        except OSError as err:
            self.display.print(f"warning: cannot write the run's files to {self.run_dir} ({first_line(err)})")

    def judge(self, state: RunState) -> None:
        """Whether the run may go on: raises to end it (UnhealthyNode, Stalled, Stopped, Interrupted)."""
        now = time.monotonic()
        since, self.polled = now - self.polled, now
        self.exclude_unhealthy(state)
        self.stall.check(list(state.ranks))
        self.blame_recovered(state)
        self.stop_overdue(state, since)

    def exclude_unhealthy(self, state: RunState) -> None:
        """--health exclude: a node the health check named ends the run before its first step (the ranks
        leave their loop), recorded bad for a requeued job to leave out."""
        if self.health != "exclude" or not state.health:
            return  # every poll passes here: judge only what there is to judge
        if slow := slow_nodes([NodeHealth.from_json(node) for node in state.health]):
            raise blame(self.run_dir, UnhealthyNode([s.line() for s in slow]), [(s.node.host, s.line()) for s in slow],
                        state.hosts)

    def blame_recovered(self, state: RunState) -> None:
        """A stall Ray Train restarted the ranks from (--max-failures) still names its culprits' nodes
        bad: the job's next requeue leaves them out."""
        for report in self.stall.stalls[self.blamed:]:
            for host in stall_hosts(report.culprits, state.hosts):
                record_bad_node(self.run_dir, host, f"a stall's culprit: {report.line}")
        self.blamed = len(self.stall.stalls)

    def stop_overdue(self, state: RunState, since: float) -> None:
        """Stop the run anyway when its ranks did not answer a stop within --stop-grace-s: a rank stuck
        for good never reaches the agreed step. The stall report first, then the ranks are ended.
        The grace counts the time in training steps, where the answer is due at the next one. A
        checkpoint is the point of stopping, and a stop that comes at an epoch's end is answered after
        its validation and checkpoint: there only silence counts, validation that did not move."""
        if self.stopping is None or state.stopped_at:
            return
        if state.phase in (None, "first step"):
            self.stop_waited += since
        overdue = self.stop_waited >= self.grace
        if state.phase == "validation" and not overdue:
            import ray

            quiet, _, _ = ray.get(self.sink.quiet.remote())
            overdue = quiet is not None and quiet >= self.grace
        if not overdue:
            return
        label = "Ctrl-C" if self.stopping == "SIGINT" else self.stopping
        late = f"{label} got no answer: the ranks reached no agreed step within --stop-grace-s {self.grace:g} s"
        if state.ranks:
            late = f"{late}, so they were ended without a new checkpoint; {self.stall.report_now(list(state.ranks)).line}"
        message = f"{late}. {kept(self.run_dir, self.name)}"
        raise Interrupted(message, at_once=True) if self.stopping == "SIGINT" else Stopped(message, at_once=True)

    def lines(self, state: RunState, was: RunState) -> list[str]:
        """What changed since the last poll, as lines for the user."""
        lines = []
        if state.resumed_at and state.resumed_at != was.resumed_at:
            epoch, position, at_step = state.resumed_at
            lines.append(f"resumed from the checkpoint at epoch {epoch} step {at_step} (after {position} of its samples)")
        if state.drain_saved and state.drain_saved != was.drain_saved:
            epoch, position = state.drain_saved
            lines.append(f"Ray is draining a node of this run: checkpointed at epoch {epoch} after {position} samples")
        if state.ranks and not was.ranks and (line := niced(list(state.ranks))):
            lines.append(line)  # once: a restarted group runs on the same cluster
        lines += [event.line() for event in state.resizes[len(was.resizes):]]
        if state.startup and state.first_step_unix:
            started = self.clock.ranks_started({**state.startup, "first step": state.first_step_unix})
            lines += [started] if started else []
        if self.health == "warn" and state.health and state.health != was.health:
            lines += [s.line() for s in slow_nodes([NodeHealth.from_json(node) for node in state.health])]
        profiled, self.profiles_shown = profile_lines(state.profiles, state.world_size or 0, self.profiles_shown)
        lines += [line] if (line := self.last_checkpoint_line(state)) else []
        return lines + profiled + self.straggler_lines(state, was)

    def last_checkpoint_line(self, state: RunState) -> str | None:
        """Once, when the ranks left their loop STORE_QUIET_S ago and the run has not ended: what it waits
        for (the stall watch does not count that wait; a store that does not answer makes it long)."""
        if state.phase != "finished":
            self.finished_at = None
            return None
        now = time.monotonic()
        self.finished_at = self.finished_at or now
        if self.told_finished or now - self.finished_at < STORE_QUIET_S:
            return None
        self.told_finished = True
        return (f"the ranks finished training {now - self.finished_at:.0f} s ago; the run ends once Ray Train has "
                f"saved its last checkpoint to {self.run_dir}")

    def straggler_lines(self, state: RunState, was: RunState) -> list[str]:
        """A line for each rank newly slow in a part: the first epoch it was; or once, that one looked
        slow but the ranks' times are not comparable."""
        lines, parts = [], state.rank_parts
        for epoch in sorted(parts.keys() - was.rank_parts.keys()):
            if not self.crowded and (line := not_comparable(epoch, parts[epoch], state.hosts)):
                self.crowded = True
                lines.append(line)
            for slow in stragglers(epoch, parts[epoch], state.hosts):
                if (slow.rank, slow.part) not in self.stragglers:
                    self.stragglers.add((slow.rank, slow.part))
                    lines.append(f"{slow.line()}; every rank's parts -> {self.run_dir / RANK_TIMES}")
        return lines

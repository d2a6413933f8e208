"""`raytrain run`: plan the run, start Ray Train on our worker loop, show its progress, write its files.

The shared parts (preflight, signals, the watch loop, summary.json) are the driver core's
(preflight.py, core.py); what is `run`'s own is here: the trainer, rank 0's news through the sink,
and what the run's files and lines say.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp.checkpoint.compat import compare
from raytrain_ddp.checkpoint.files import latest_checkpoint, read_info
from raytrain_ddp.config import ConfigError, TrainConfig, dumps
from raytrain_ddp.doctor.bad_nodes import blame, crash_hosts, record_bad_node, stall_hosts
from raytrain_ddp.doctor.health import NodeHealth, slow_nodes
from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.workers import write_workers
from raytrain_ddp.doctor.stall_watch import StallWatch
from raytrain_ddp.doctor.stragglers import RANK_TIMES, most_uneven, not_comparable, stragglers, write_rank_times
from raytrain_ddp.driver.plan import preflight, run_lock
from raytrain_ddp.driver.run import tracking
from raytrain_ddp.driver.core.drive import Signals, StartupClock, drive, write_summary
from raytrain_ddp.run_files import tensorboard_writer, write_csv, write_parquet
from raytrain_ddp.driver.plan.preflight import RunPlan
from raytrain_ddp.driver.run.progress import Display
from raytrain_ddp.driver.plan.resources import choose_layout
from raytrain_ddp.driver.session.connect import on_this_node, ray_address, restarts, start_private_ray, trainer_configs
from raytrain_ddp.driver.plan.shipping import ship_code, user_code
from raytrain_ddp.driver.core.startup import RUN_STAGES
from raytrain_ddp.stops import Interrupted, RankConfigError, RayLost, Stalled, Stopped, UnhealthyNode
from raytrain_ddp.driver.plan.trial_step import trial_step

POLL_S = 0.5
"""How often the driver asks rank 0's sink for news and passes on a signal it got."""
RESUME_HINT = "run the same command again (same --storage-path and --name {name}) to resume"


def dry_run(cfg: TrainConfig) -> None:
    """Every check that needs no cluster and a trial of the first step on the CPU (trial_step.py), then
    the resolved config and Ray Train's configs; start nothing."""
    checked = preflight.check_request(cfg, dry=True)
    cfg, run_dir = checked.cfg, checked.run_dir
    preflight.model_state(cfg, checked.model_shapes)  # with --gpu checked against a local GPU only
    if cfg.download or cfg.dataset == "parquet":  # files not there yet; a Parquet reader loads every row
        print(f"--dry-run: no trial step on --dataset {cfg.dataset}"
              f"{' before its --download' if cfg.download else ' (its reader loads every shard whole)'}", file=sys.stderr)
    else:
        print(trial_step(cfg, checked.given), file=sys.stderr)
    print(f"config:\n{dumps(cfg)}")
    if cfg.cpus_per_worker is None or cfg.placement is None:
        print("layout: --cpus-per-worker and --placement are chosen at start from the cluster's nodes (shown as 1, spread)")
    scaling, run_config, torch_config = trainer_configs(dataclasses.replace(cfg, **choose_layout(cfg, [])._asdict()))
    print(f"run directory: {run_dir}")
    print(f"ray address: {ray_address(cfg) or 'a new private local Ray'}")
    print(f"{scaling}\n{run_config}\n{torch_config}")


def run(cfg: TrainConfig, model: Any = None, dataset: Any = None, launched: float | None = None,
        signals: Signals | None = None, on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
        code_paths: list[str] | None = None) -> dict[str, Any]:
    """Train, write metrics.csv and summary.json, and return the summary. `model` and `dataset`
    (the Python API) override cfg's: a name, an import path, or a callable. `launched`: when the
    command began (the CLI's process start), so the start-up stages count its imports; default now.
    Ctrl-C checkpoints, then raises Interrupted (a KeyboardInterrupt); SIGTERM or SIGUSR1
    checkpoints, then raises Stopped. `signals`: where a caller that is not the main thread (a
    sweep's trial) asks for those stops (Signals.ask); `on_rows`: given every epoch's row so far, each
    time a new one comes; `code_paths`: where the workers import the user's --model/--dataset from,
    when the caller placed the code already (a sweep, once for all its trials)."""
    started = time.time()
    # A sweep's trial (on_rows) takes its epochs' rows from the run's own start: it goes the long way.
    if on_rows is None and (trained := already_trained(cfg)) is not None:
        return trained
    start_private_ray(cfg)  # without --address: it starts while the request is checked
    with signals or Signals() as signals:
        plan = preflight.plan(cfg, model, dataset, stop_check=signals.stop_before_start)
        try:
            if code_paths is None:
                code_paths, code_env = user_code(plan.code)
                ship_code(plan.cfg, code_env)
            signals.stop_before_start()
            return train(plan, signals, code_paths, started, launched, on_rows)
        finally:
            run_lock.release(plan.run_dir)  # the Python API's process lives on: another driver may have the name


def already_trained(cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a named run that trained its --epochs to the end, said in one line, when the
    same command runs again (a second look, a job requeued after its end): Ray would start only to
    train nothing. None for anything else, which then resumes or starts the usual way; a change the
    checkpoint refuses (another --model, say) is refused here as it would be there."""
    if not cfg.resume or not cfg.name:
        return None
    cfg, run_dir = preflight.resolve_run(cfg)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        checkpoint = latest_checkpoint(run_dir)
        saved = read_info(checkpoint) if checkpoint is not None else None
    except (OSError, ValueError, ConfigError):
        return None  # no finished run here, or one to look at closer: the preflight does
    if saved is None or saved["position"] or saved["epoch"] - 1 != cfg.epochs or summary["final"]["epoch"] != cfg.epochs:
        return None
    compare(saved, cfg, cfg.name)
    epochs = f"{cfg.epochs} epoch{'s' if cfg.epochs > 1 else ''}"
    print(f"run {cfg.name} already trained its {epochs} ({checkpoint.name}); nothing to train: pass a larger --epochs "
          "to train on, or --no-resume to start over", file=sys.stderr)
    return summary


def train(plan: RunPlan, signals: Signals, code_paths: list[str], started: float, launched: float | None,
          on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Start the trainer and watch it to its end; the summary, or why the run did not finish."""
    # TorchTrainer is DataParallelTrainer with TorchConfig, whose work ours does (ProcessGroupConfig),
    # and its module imports torch: the driver of a run checked without torch never imports it.
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from raytrain_ddp.driver.run.sink import MetricsSink
    from raytrain_ddp.ray_compat import fast
    from raytrain_ddp.worker.entry import train_entry

    cfg = plan.cfg
    display = Display(cfg.progress, cfg.epochs)
    trackers = tracking.start(cfg, plan.run_dir)
    scaling, run_config, process_group = trainer_configs(cfg)
    sink = MetricsSink.options(scheduling_strategy=on_this_node()).remote()
    trainer = fast(DataParallelTrainer)(
        train_entry,
        train_loop_config={"config": cfg.to_dict(), "sink": sink, "given": plan.given, "code_paths": code_paths,
                           "resume_from": resume_from(plan)},
        scaling_config=scaling,
        run_config=run_config,
        backend_config=process_group,
        **ray_data(cfg),
    )
    announce(plan, display)
    news = RunNews(sink, display, plan, trackers, StartupClock(launched, started, plan, RUN_STAGES), on_rows)
    summary = None
    try:
        try:
            error = drive(trainer, signals, news.poll, functools.partial(ask_to_stop, news, display, plan), POLL_S)
        except RayLost as lost:
            raise RayLost(lost.what, kept(plan.run_dir, cfg.name)) from None
        except Stalled as stalled:  # its culprits' nodes, when they stand apart, are bad
            culprits = news.stall.stalls[-1].culprits if news.stall.stalls else []
            found = [(host, f"a stall's culprit: {stalled}") for host in stall_hosts(culprits, hosts(news.info))]
            raise blame(plan.run_dir, stalled, found, hosts(news.info)) from None
        finally:
            display.close()
        if error is not None:
            raise blame(plan.run_dir, error, crash_hosts(error, hosts(news.info)), hosts(news.info))  # a node that killed a rank
        summary = finish(plan, news, started, "SIGINT" in signals.received)
    finally:
        trackers.finish(plan.run_dir / "summary.json", ok=summary is not None)  # a stopped run resumes it later
    return summary


def ray_data(cfg: TrainConfig) -> dict[str, Any]:
    """The trainer's datasets and dataset_config for --loader ray; none otherwise, and then
    ray_ingest (torch) is not imported."""
    if cfg.loader != "ray":
        return {}
    from raytrain_ddp.data.ray_ingest import ray_data_config, ray_datasets

    return {"datasets": ray_datasets(cfg), "dataset_config": ray_data_config(cfg)}


def resume_from(plan: RunPlan) -> str | None:
    """The checkpoint the ranks load while Ray has registered none in this run: the preflight's
    choice, the newest whole one (Ray's own latest wins once there is one). Ray Train V2 refuses
    TorchTrainer(resume_from_checkpoint=...), so the path goes in the loop's config."""
    checkpoint = plan.resume.checkpoint if plan.resume is not None else None
    return str(checkpoint) if checkpoint is not None else None


def announce(plan: RunPlan, display: Display) -> None:
    """The run's first lines: who trains where, and the global batch when micro-batches accumulate."""
    cfg = plan.cfg
    display.print(f"run {cfg.name}: {plan.world} {cfg.resolved_backend} workers -> {plan.run_dir}")
    accum = plan.accum_steps
    if accum > 1:
        display.print(
            f"global batch {cfg.batch_size * cfg.workers * accum} = --batch-size {cfg.batch_size} x "
            f"{cfg.workers} workers x {accum} accumulated micro-batches per optimizer step"
        )


def ask_to_stop(news: RunNews, display: Display, plan: RunPlan, name: str, before: list[str]) -> None:
    """A signal, passed on: the ranks checkpoint at their next agreed step and stop, within
    --stop-grace-s (RunNews.stop_overdue). A second Ctrl-C stops at once, without them."""
    if name == "SIGINT" and "SIGINT" in before:
        raise Interrupted(
            f"stopped at once by a second Ctrl-C, without a new checkpoint; {RESUME_HINT.format(name=plan.cfg.name)} "
            "from the last one",
            at_once=True,
        )
    label = "Ctrl-C" if name == "SIGINT" else name
    again = "; Ctrl-C again stops at once, without it" if name == "SIGINT" else ""
    display.print(f"got {label}: checkpointing at the next agreed step, then stopping{again}")
    news.stop_asked(name)
    news.sink.request_stop.remote()


def finish(plan: RunPlan, news: RunNews, started: float, interrupted: bool) -> dict[str, Any]:
    """The run's summary.json, once fit() returned; or why the run did not finish."""
    cfg, info, rows = plan.cfg, news.info, news.rows
    if info.get("stopped_at"):
        epoch, step = info["stopped_at"]
        message = (
            f"stopped by {'Ctrl-C' if interrupted else 'a signal'} with a checkpoint at epoch {epoch} step {step}; "
            f"{RESUME_HINT.format(name=cfg.name)}"
        )
        raise Interrupted(message) if interrupted else Stopped(message)
    if len(rows) != cfg.epochs:
        raise RuntimeError(f"training ended after {len(rows)} of {cfg.epochs} epochs")
    return write_summary(
        plan, started, news.clock, cfg.to_dict(),
        final=rows[-1],
        world_size=info["world_size"],
        backend=info["backend"],
        nodes=[r.host for r in info["ranks"]],
        node_ips=[r.ip for r in info["ranks"]],
        first_step_unix=info.get("first_step_unix"),
        profile=[line for _, line in sorted(info.get("profiles", {}).items())] or None,  # --profile, by rank
        most_uneven_epoch=most_uneven(info.get("rank_parts", {}), hosts(info)),  # every rank's parts, and stragglers
        resizes=[{**event, "why": resize_reason(event)} for event in info.get("resizes", [])],
        health=info.get("health"),  # the pre-flight check's nodes, GEMM and link figures (doctor/health.py)
        stalls=[dataclasses.asdict(report) for report in news.stall.stalls],  # each one Ray Train restarted from
    )


def hosts(info: dict[str, Any]) -> list[str]:
    return [r.host for r in info.get("ranks", [])]


def kept(run_dir: Path, name: str) -> str:
    """What a rerun of a run stopped without a new checkpoint starts from, and how to rerun it: a sentence."""
    rerun = RESUME_HINT.format(name=name).removesuffix(" to resume")
    try:
        checkpoint = latest_checkpoint(run_dir)
        saved = read_info(checkpoint) if checkpoint is not None else None
    except ConfigError:  # an unreadable record: the rerun says so, not this stop
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


def resize_reason(event: dict[str, Any]) -> str:
    if event.get("stall"):
        return "a worker group restarted after a stall"
    if event["to"] == event["from"]:
        return "a worker group restarted after a failure"
    return "a worker or its node was lost" if event["to"] < event["from"] else "the cluster had room for more workers"


def describe_resize(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(event["at"]))
    if event["to"] == event["from"]:
        where = "the start" if (event["epoch"], event["position"]) == (1, 0) else (
            f"epoch {event['epoch']} after {event['position']} samples")
        return f"restarted: {event['to']} workers at {when}, from {where} ({resize_reason(event)})"
    return (
        f"resized: {event['from']} -> {event['to']} workers at {when}, epoch {event['epoch']} after {event['position']} "
        f"samples ({resize_reason(event)}); the epoch goes on from there, re-sharded"
    )


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
    """Rank 0's news, polled from the sink by the driver core: the display, the metrics files, the
    trackers, and the lines for what happened (a resume, a drain, a resize, the start-up stages)."""

    def __init__(self, sink: Any, display: Display, plan: RunPlan, trackers: Any, clock: StartupClock,
                 on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.sink, self.display, self.run_dir, self.trackers, self.clock = sink, display, plan.run_dir, trackers, clock
        self.on_rows = on_rows
        self.tensorboard = tensorboard_writer(plan.run_dir) if plan.cfg.tensorboard else None
        self.info: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.stall = StallWatch(sink, plan.cfg.stall_timeout, plan.run_dir, display.print, restarts(plan.cfg))
        self.stalled: BaseException | None = None
        self.blamed = 0
        """The stalls recovered from whose culprits' nodes are recorded bad (blame_recovered)."""
        self.stragglers: set[tuple[int, str]] = set()
        """(rank, part) of the stragglers named so far: each is said once, its epochs are in rank_times.csv."""
        self.crowded = False
        """Whether the ranks were said to share their cores (so no straggler is named): said once."""
        self.profiles_shown: dict[int, str] = {}
        """Each rank's --profile line as last shown (profile_lines)."""
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
        import ray

        if self.stalled is not None:  # the core's last poll, after the stall ended the watch
            raise self.stalled
        info, step, rows = ray.get(self.sink.poll.remote())
        if info.get("config_error"):  # a rank's, which every retry would raise again
            raise RankConfigError(info["config_error"])
        if rows != self.rows:
            self.new_rows(rows)
        if info.get("ranks") and info.get("ranks") != self.info.get("ranks"):
            # Which pid on which host is which rank: for the user, `raytrain stack` (and tests that kill one).
            write_workers(self.run_dir, info["ranks"])
        if info.get("rank_parts") and info["rank_parts"] != self.info.get("rank_parts"):
            write_rank_times(self.run_dir, info["rank_parts"], hosts(info))
        for line in self.lines(info):
            self.display.print(line)
        self.info, self.rows = info, rows
        self.display.update(info, step, rows)
        now = time.monotonic()
        since, self.polled = now - self.polled, now
        try:
            self.exclude_unhealthy(info)
            self.stall.check(info.get("ranks", []))
            self.blame_recovered()
            self.stop_overdue(info, since)
        except (Exception, KeyboardInterrupt) as err:  # Stalled, Stopped; Interrupted is a KeyboardInterrupt
            self.stalled = err
            raise

    def exclude_unhealthy(self, info: dict[str, Any]) -> None:
        """--health exclude: a node the health check named ends the run before its first step (the ranks
        leave their loop), recorded bad for a requeued job to leave out."""
        if self.health != "exclude" or not info.get("health"):
            return  # every poll passes here: judge only what there is to judge
        if slow := slow_nodes([NodeHealth.from_json(node) for node in info["health"]]):
            raise blame(self.run_dir, UnhealthyNode([s.line() for s in slow]), [(s.node.host, s.line()) for s in slow],
                        hosts(info))

    def blame_recovered(self) -> None:
        """A stall Ray Train restarted the ranks from (--max-failures) still names its culprits' nodes
        bad: the job's next requeue leaves them out."""
        for report in self.stall.stalls[self.blamed:]:
            for host in stall_hosts(report.culprits, hosts(self.info)):
                record_bad_node(self.run_dir, host, f"a stall's culprit: {report.line}")
        self.blamed = len(self.stall.stalls)

    def stop_overdue(self, info: dict[str, Any], since: float) -> None:
        """Stop the run anyway when its ranks did not answer a stop within --stop-grace-s: a rank stuck
        for good never reaches the agreed step. The stall report first, then the ranks are ended.
        The grace counts the time in training steps, where the answer is due at the next one. A
        checkpoint is the point of stopping, and a stop that comes at an epoch's end is answered after
        its validation and checkpoint: there only silence counts, validation that did not move."""
        if self.stopping is None or info.get("stopped_at"):
            return
        phase = info.get("phase")
        if phase in (None, "first step"):
            self.stop_waited += since
        overdue = self.stop_waited >= self.grace
        if phase == "validation" and not overdue:
            import ray

            quiet, _, _ = ray.get(self.sink.quiet.remote())
            overdue = quiet is not None and quiet >= self.grace
        if not overdue:
            return
        label = "Ctrl-C" if self.stopping == "SIGINT" else self.stopping
        late = f"{label} got no answer: the ranks reached no agreed step within --stop-grace-s {self.grace:g} s"
        if info.get("ranks"):
            late = f"{late}, so they were ended without a new checkpoint; {self.stall.report_now(info['ranks']).line}"
        message = f"{late}. {kept(self.run_dir, self.name)}"
        raise Interrupted(message, at_once=True) if self.stopping == "SIGINT" else Stopped(message, at_once=True)

    def new_rows(self, rows: list[dict[str, Any]]) -> None:
        write_csv(self.run_dir / "metrics.csv", rows)
        write_parquet(self.run_dir / "metrics.parquet", rows)
        fresh = [row for row in rows if row not in self.rows]  # a redone epoch's row is fresh again
        if self.tensorboard is not None:
            for row in fresh:
                for key, value in row.items():
                    if isinstance(value, (int, float)) and key != "epoch":
                        self.tensorboard.add_scalar(key, value, global_step=row["epoch"])
            self.tensorboard.flush()
        self.trackers.log_rows(fresh)
        if self.on_rows is not None and fresh:
            self.on_rows(rows)

    def lines(self, info: dict[str, Any]) -> list[str]:
        """What changed since the last poll, as lines for the user."""
        lines, was = [], self.info
        if info.get("resumed_at") and info["resumed_at"] != was.get("resumed_at"):
            epoch, position, at_step = info["resumed_at"]
            lines.append(f"resumed from the checkpoint at epoch {epoch} step {at_step} (after {position} of its samples)")
        if info.get("drain_saved") and info["drain_saved"] != was.get("drain_saved"):
            epoch, position = info["drain_saved"]
            lines.append(f"Ray is draining a node of this run: checkpointed at epoch {epoch} after {position} samples")
        if info.get("ranks") and not was.get("ranks") and (line := niced(info["ranks"])):
            lines.append(line)  # once: a restarted group runs on the same cluster
        lines += [describe_resize(event) for event in info.get("resizes", [])[len(was.get("resizes", [])) :]]
        if info.get("startup") and info.get("first_step_unix"):
            started = self.clock.ranks_started({**info["startup"], "first step": info["first_step_unix"]})
            lines += [started] if started else []
        if self.health == "warn" and info.get("health") and info["health"] != was.get("health"):
            lines += [s.line() for s in slow_nodes([NodeHealth.from_json(node) for node in info["health"]])]
        profiled, self.profiles_shown = profile_lines(info.get("profiles", {}), info.get("world_size", 0),
                                                      self.profiles_shown)
        return lines + profiled + self.straggler_lines(info)

    def straggler_lines(self, info: dict[str, Any]) -> list[str]:
        """A line for each rank newly slow in a part: the first epoch it was; or once, that one looked
        slow but the ranks' times are not comparable."""
        lines, parts = [], info.get("rank_parts", {})
        for epoch in sorted(parts.keys() - self.info.get("rank_parts", {}).keys()):
            if not self.crowded and (line := not_comparable(epoch, parts[epoch], hosts(info))):
                self.crowded = True
                lines.append(line)
            for slow in stragglers(epoch, parts[epoch], hosts(info)):
                if (slow.rank, slow.part) not in self.stragglers:
                    self.stragglers.add((slow.rank, slow.part))
                    lines.append(f"{slow.line()}; every rank's parts -> {self.run_dir / RANK_TIMES}")
        return lines


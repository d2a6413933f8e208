"""Where a start's seconds go: wall-clock marks, taken on the driver and on rank 0, to named stages,
and the one line that shows them.

Marks are `time.time()`, not a monotonic clock, because they are stitched across processes and nodes
(the cluster's clocks agree to milliseconds under NTP, far below the seconds being measured). This
module is light (no torch, no Ray), so drivers, workers and benchmarks all use it.
"""

from __future__ import annotations

import os
import time

RUN_STAGES = ("python", "checks", "connect", "placement", "workers", "imports", "process group", "health", "data",
              "model", "first step")
"""`raytrain run`'s stages, each ending at its mark: the interpreter and our imports, the request's
checks (model, data files, resume), connecting to Ray, preflight and layout; then Ray Train's start
until rank 0 enters our code (controller, worker group, its process group), importing the loop
(torch), every rank meeting in the first collective, the health check (--health; none when off), the
data loaders, the model (built, wrapped, restored), and the first step."""
LAUNCH_STAGES = ("python", "checks", "connect", "placement", "workers", "rendezvous", "script start")
"""`raytrain launch`'s, up to the script's start: the same driver stages, Ray Train's start until rank
0's agent runs, the ranks meeting in the hub (a fresh rendezvous port), and the script's process
spawned."""

WAITING_FOR = {
    "python": "Python and raytrain's imports",
    "checks": "checking the request",
    "connect": "joining Ray",
    "placement": "fitting the request to the cluster",
    "workers": "Ray Train starting the workers",
    "imports": "rank 0 importing the loop",
    "process group": "the ranks meeting",
    "health": "the health check",
    "data": "building the data loaders",
    "model": "building the model",
    "first step": "the first step",
    "rendezvous": "the ranks meeting in the hub",
    "script start": "the script starting",
}
"""What a start waits for in each stage, as the start's live line says it."""


def process_started() -> float:
    """When this process began, as time.time(), so a command's start-up counts the interpreter and its
    imports too; now where /proc cannot say (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def stages(begin: float, marks: dict[str, float], order: tuple[str, ...]) -> dict[str, float]:
    """Seconds per stage, in `order`: each from the previous mark present (the first from `begin`) to
    its own. A stage without a mark is left out. Never negative: a node's clock a few ms behind the
    driver's must not show as time gained."""
    out, last = {}, begin
    for name in order:
        if name in marks:
            out[name] = round(max(marks[name] - last, 0.0), 3)
            last = max(last, marks[name])
    return out


def waiting_line(begin: float, marks: dict[str, float], order: tuple[str, ...], now: float) -> str:
    """A start's live line at `now`: its seconds so far, and the stage it is in with that stage's
    seconds. The stage is the one after the latest mark taken, so a stage that never comes (health,
    when off) is passed over, not waited on."""
    done = [i for i, name in enumerate(order) if name in marks]
    stage = order[min(done[-1] + 1, len(order) - 1)] if done else order[0]
    since = max((marks[order[i]] for i in done), default=begin)
    return (f"starting {max(now - begin, 0.0):.0f} s: {WAITING_FOR.get(stage, stage)} "
            f"({stage}, {max(now - since, 0.0):.0f} s)")


def stages_line(seconds: dict[str, float], until: str = "") -> str:
    """`start-up 11.2 s: connect 0.8, placement 0.3, ...` (`until`: e.g. " to the script's start")."""
    parts = ", ".join(f"{name} {s:.1f}" for name, s in seconds.items())
    return f"start-up {sum(seconds.values()):.1f} s{until}: {parts}"


def summary(seconds: dict[str, float]) -> dict[str, object]:
    """What summary.json holds: the total and each stage, in seconds."""
    return {"total_s": round(sum(seconds.values()), 3), "stages": seconds}

"""What a sweep shows and writes once its trials are done: the table, results.csv, summary.json with the
command that reruns the best trial, the idle share of the allocation, and two plots (curves.png, parallel.png).

Pure: it reads the trial records the sweep driver builds and writes files; it starts nothing.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_ddp.config import as_flag, flag_spellings
from raytrain_ddp.run_files import write_atomic, write_json, write_png
from raytrain_ddp.storage.location import RunPath

STATUSES = ("finished", "stopped early", "failed", "stopped", "pending")
"""A trial's status: ran all its epochs; cut by ASHA; failed; interrupted (a resume continues it); not begun."""


@dataclass(frozen=True)
class TrialRecord:
    trial: str
    """The trial's run name and directory under P/NAME/trials/, e.g. t03."""
    params: dict[str, Any]
    """The sampled TrainConfig fields, e.g. {"lr": 0.003, "batch_size": 64}."""
    status: str
    """One of STATUSES."""
    rows: list[dict[str, Any]]
    """Its metrics.csv rows in epoch order (values may be strings, as read_csv gives them); may be empty."""
    workers: int
    """Its gang size."""
    started: float | None
    """Unix time its run began; None if it never started."""
    ended: float | None
    error: str | None = None
    """One line, for a failed trial."""
    checkpoint: str | None = None
    """Its newest checkpoint directory."""


def say(line: str) -> None:
    """The sweep's own lines, on stderr, so a redirected stdout keeps the table."""
    print(line, file=sys.stderr)


def fmt(params: dict[str, Any]) -> str:
    """A trial's parameters in one short phrase: lr=0.0031, batch_size=64."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def metric_values(record: TrialRecord, metric: str) -> list[tuple[int, float]]:
    """(epoch, value) for each row that has a finite value of `metric`; rows without an epoch count from 1."""
    points = []
    for i, row in enumerate(record.rows):
        value = _number(row.get(metric))
        if value is not None:
            epoch = _number(row.get("epoch"))
            points.append((int(epoch) if epoch is not None else i + 1, value))
    return points


def best_value(record: TrialRecord, metric: str, mode: str) -> float | None:
    """The trial's best `metric` over its epochs (mode "max" or "min"); None if it has none."""
    values = [value for _, value in metric_values(record, metric)]
    if not values:
        return None
    return max(values) if _check_mode(mode) == "max" else min(values)


def best_trial(records: Sequence[TrialRecord], metric: str, mode: str) -> TrialRecord | None:
    """The trial with the best value; on a tie the earlier one in `records` (trial order)."""
    best, best_val = None, None
    for record in records:
        value = best_value(record, metric, mode)
        if value is not None and (best_val is None or (value > best_val if mode == "max" else value < best_val)):
            best, best_val = record, value
    return best


def table(records: Sequence[TrialRecord], metric: str, mode: str) -> str:
    """Every trial as an aligned row (the best marked *), then a line naming the best trial."""
    names = param_names(records)
    best = best_trial(records, metric, mode)
    header = ["", "trial", *names, "status", "epochs done", f"best {metric}"]
    rows = []
    for r in records:
        value = best_value(r, metric, mode)
        rows.append(["*" if r is best else "", r.trial, *(_short(r.params.get(n, "")) for n in names), r.status,
                     str(len(r.rows)), "-" if value is None else _short(value, digits=4)])
    cells = [[row[i] for row in rows if row[i] not in ("", "-")] for i in range(len(header))]
    numeric = {i for i, column in enumerate(cells) if i > 1 and all(_number(c) is not None for c in column)}
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in
                       enumerate(zip(line, widths))).rstrip() for line in [header, *rows]]
    return "\n".join(lines) + "\n" + best_line(records, metric, mode) + "\n"


def best_line(records: Sequence[TrialRecord], metric: str, mode: str) -> str:
    """`best: t03 val_acc 0.912 (lr=0.0031, batch_size=64)`, or why there is none."""
    best = best_trial(records, metric, mode)
    if best is None:
        return f"best: none (no trial has reported {metric} yet)"
    params = ", ".join(f"{k}={_short(v)}" for k, v in best.params.items())
    return f"best: {best.trial} {metric} {_short(best_value(best, metric, mode), digits=4)} ({params})"


def write_results_csv(path: RunPath, records: Sequence[TrialRecord], metric: str, mode: str) -> None:
    """results.csv: one row per trial, its params at full precision (so a row can be rerun as it ran)."""
    names = param_names(records)
    fixed = ["status", "epochs_done", f"best_{metric}", "started", "ended", "worker_s", "error", "checkpoint"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["trial", *names, *fixed])
    for r in records:
        value = best_value(r, metric, mode)
        held = r.workers * (r.ended - r.started) if r.started is not None and r.ended is not None else None
        writer.writerow([r.trial, *(r.params.get(n, "") for n in names), r.status, len(r.rows),
                         "" if value is None else value, _blank(r.started), _blank(r.ended),
                         "" if held is None else round(held, 3), r.error or "", r.checkpoint or ""])
    write_atomic(path, out.getvalue())


def reproduce_command(run_args: list[str], params: dict[str, Any], name: str) -> str:
    """The `raytrain run ...` that reruns a trial: the sweep's run flags, each param in place of the same flag
    there (or appended), then --name NAME. A None param drops its flag, leaving the config file's or default."""
    spellings = flag_spellings()
    takes_value = {flag for flag, (_, value) in spellings.items() if value is None} | {"--config"}
    out: list[str] = []
    placed: set[str] = set()
    i = 0
    while i < len(run_args):
        token = run_args[i]
        flag, attached = _split(token, takes_value)
        width = 2 if flag in takes_value and attached is None and i + 1 < len(run_args) else 1
        field = spellings[flag][0] if flag in spellings else None
        if field == "name":
            pass  # ours goes last
        elif field in params:
            if field not in placed:  # the first mention takes the new value, later ones would override it
                out += as_flag(field, params[field])
                placed.add(field)
        else:
            out += run_args[i:i + width]
        i += width
    for field, value in params.items():
        if field not in placed:
            out += as_flag(field, value)
    return shlex.join(["raytrain", "run", *out, "--name", name])


def write_summary(
    path: RunPath, records: Sequence[TrialRecord], metric: str, mode: str, run_args: list[str], facts: dict[str, Any]
) -> dict[str, Any]:
    """summary.json beside trials/: the best trial (its params, value, checkpoint, config, the command that
    reruns it as a run of its own) or None, counts by status, then `facts` from the driver. Returns it."""
    best = best_trial(records, metric, mode)
    best_info = None
    if best is not None:
        run_dir = path.parent / "trials" / best.trial
        best_info = {
            "trial": best.trial,
            "params": best.params,
            "value": best_value(best, metric, mode),
            "checkpoint": best.checkpoint,
            "run_dir": str(run_dir),
            "command": reproduce_command(run_args, best.params, f"{path.parent.name}-{best.trial}"),
        }
        config = _read_config(run_dir / "summary.json")
        if config is not None:
            best_info["config"] = config
    counts = {status: sum(r.status == status for r in records) for status in STATUSES}
    summary = {"metric": metric, "mode": mode, "best": best_info, "trials": counts | {"total": len(records)}, **facts}
    write_json(path, summary)
    return summary


def idle_share(slots: int, began: float, ended: float, records: Sequence[TrialRecord]) -> float:
    """The share of the allocation's worker-seconds (slots x (ended - began)) that no trial held. Only the part
    of each trial inside [began, ended] counts (a resumed sweep's earlier trials fall outside); a trial still
    without an end holds its workers to `ended`."""
    span = ended - began
    if slots <= 0 or span <= 0:
        return 0.0
    held = 0.0
    for r in records:
        if r.started is None:
            continue
        stop = r.ended if r.ended is not None else ended
        held += r.workers * max(0.0, min(stop, ended) - max(r.started, began))
    return min(1.0, max(0.0, 1.0 - held / (slots * span)))


def plot_curves(path: RunPath, records: Sequence[TrialRecord], metric: str, mode: str, rungs: list[int]) -> None:
    """PNG: `metric` per epoch, a line per trial, an x where ASHA stopped one, dashed lines at the rungs,
    the best trial thicker."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 5.5))
    best = best_trial(records, metric, mode)
    colors = plt.get_cmap("tab10" if len(records) <= 10 else "tab20").colors  # tab10 alone repeats past 10 trials
    drawn = 0
    for r in records:
        points = metric_values(r, metric)
        if not points:
            continue
        epochs, values = zip(*points)
        color = "black" if r is best else colors[drawn % len(colors)]  # a pale tab20 colour would hide the best
        ax.plot(epochs, values, marker=".", color=color, lw=3 if r is best else 1.3,
                ls=":" if r.status == "failed" else "-", label=_label(r, best), zorder=3 if r is best else 2)
        if r.status == "stopped early":
            ax.plot(epochs[-1], values[-1], "x", color=color, ms=11, mew=2.5, zorder=4)
        drawn += 1
    for i, rung in enumerate(rungs):
        ax.axvline(rung, ls="--", color="grey", lw=1, label="ASHA rung" if i == 0 else None, zorder=1)
    if any(r.status == "stopped early" for r in records):
        ax.plot([], [], "x", color="black", ms=9, mew=2, label="stopped early")
    if drawn:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), ncol=1 if drawn <= 18 else 2)
    else:
        ax.text(0.5, 0.5, f"no trial has reported {metric} yet", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="epoch", ylabel=metric, title=f"{metric} per epoch, {_trials(len(records))} ({mode} is best)")
    ax.grid(alpha=0.3)
    write_png(path, fig, dpi=110, bbox_inches="tight")


def plot_parallel(path: RunPath, records: Sequence[TrialRecord], metric: str, mode: str) -> None:
    """PNG: parallel coordinates, an axis per param plus the metric's, a line per trial with a value, coloured
    by it. Each axis spans its own values: log where they span 2 decades or more, categories evenly."""
    plt = _pyplot()
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    scored = [(r, v) for r in records if (v := best_value(r, metric, mode)) is not None]
    names = param_names(records)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * (len(names) + 1) + 2), 5.5))
    if not scored:
        ax.text(0.5, 0.5, f"no trial has reported {metric} yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        write_png(path, fig, dpi=110, bbox_inches="tight")
        return
    columns = [[r.params.get(n) for r, _ in scored] for n in names] + [[v for _, v in scored]]
    axes = [_axis(values) for values in columns]
    lo, hi = min(v for _, v in scored), max(v for _, v in scored)
    pad = 0 if hi > lo else abs(lo) * 0.01 or 0.01  # one value: a colorbar around it, not of zero width
    norm = Normalize(lo - pad, hi + pad)
    cmap = plt.get_cmap("viridis" if mode == "max" else "viridis_r")  # the best is always the bright end
    best = best_trial(records, metric, mode)
    order = sorted(range(len(scored)), key=lambda i: scored[i][0] is best)  # the best drawn last, on top
    for i in order:
        r, value = scored[i]
        ys = [place(column[i]) for (place, _), column in zip(axes, columns)]
        ax.plot(range(len(axes)), ys, color=cmap(norm(value)), lw=3.5 if r is best else 1.5, alpha=0.9,
                marker="o", ms=4, zorder=3 if r is best else 2)
    for x, (_, ticks) in enumerate(axes):
        ax.axvline(x, color="black", lw=1, zorder=1)
        for y, text in ticks:
            ax.text(x + 0.03, y, text, fontsize=8, va="center", ha="left",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7}, zorder=5)
    labels = [f"{n} (log)" if _is_log(c) else n for n, c in zip([*names, f"best {metric}"], columns)]
    ax.set_xticks(range(len(axes)), labels)
    ax.set_xlim(-0.15, len(axes) - 0.4)
    ax.set_ylim(-0.06, 1.06)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"best {metric}", pad=0.02)
    ax.set_title(f"{_trials(len(scored))}: parameters against best {metric} (thick: the best, {best.trial})")
    write_png(path, fig, dpi=110, bbox_inches="tight")


def param_names(records: Sequence[TrialRecord]) -> list[str]:
    """Every swept field, in the order the trials first name them."""
    return list(dict.fromkeys(name for r in records for name in r.params))


def _axis(values: list[Any]) -> tuple[Any, list[tuple[float, str]]]:
    """A parallel-coordinates axis: value -> height in [0, 1], and its (height, label) ticks."""
    present = [v for v in values if v is not None]
    if present and all(_is_number(v) for v in present):
        lo, hi = min(present), max(present)
        log = _is_log(values)
        span = math.log(hi / lo) if log else hi - lo

        def place(v: Any) -> float:
            if v is None:
                return math.nan
            return (math.log(v / lo) if log else v - lo) / span if span else 0.5

        steps = (0, 0.25, 0.5, 0.75, 1)
        evenly = [lo * math.exp(span * f) for f in steps] if log else [lo + span * f for f in steps]
        each = sorted(set(present))
        apart = all(place(b) - place(a) >= 0.06 for a, b in zip(each, each[1:]))  # labels that would not overlap
        ticks = each if len(each) <= 5 and apart else evenly
        return place, [(place(t), _short(t)) for t in ticks]
    categories = sorted(set(map(str, present)))
    spots = {c: (i / (len(categories) - 1) if len(categories) > 1 else 0.5) for i, c in enumerate(categories)}
    return (lambda v: math.nan if v is None else spots[str(v)]), [(y, c) for c, y in spots.items()]


def _is_log(values: list[Any]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(_is_number(v) and v > 0 for v in present) and max(present) / min(present) >= 100


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> float | None:
    """A metrics.csv cell as a finite float, or None (empty, missing, nan)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _short(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _trials(n: int) -> str:
    return f"{n} trial" + ("" if n == 1 else "s")


def _blank(value: float | None) -> Any:
    return "" if value is None else round(value, 3)


def _label(record: TrialRecord, best: TrialRecord | None) -> str:
    params = " ".join(f"{k}={_short(v)}" for k, v in record.params.items())
    marks = [record.status] if record.status != "finished" else []
    marks += ["best"] if record is best else []
    return f"{record.trial} {params}" + (f" ({', '.join(marks)})" if marks else "")


def _check_mode(mode: str) -> str:
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be max or min (got {mode!r})")
    return mode


def _split(token: str, takes_value: set[str]) -> tuple[str, str | None]:
    """A command-line token as (flag, value given with it): --lr=0.1, -w2, or a flag alone."""
    if token.startswith("--") and "=" in token:
        flag, value = token.split("=", 1)
        return flag, value
    if not token.startswith("--") and token[:2] in takes_value and len(token) > 2:  # a short option, joined: -w2
        return token[:2], token[2:]
    return token, None


def _read_config(path: RunPath) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    return plt

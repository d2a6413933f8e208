"""`raytrain verify RUN_DIR`: is this finished run whole and sane? One pass/fail line per check."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from raytrain_ddp.config import ConfigError
from raytrain_ddp.run_files import CSV_COLUMNS, read_csv


def checks(run_dir: Path) -> list[tuple[str, Callable[[], str | None]]]:
    """(name, check) pairs; a check returns None when it passes, else what is wrong."""
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.csv"
    loaded: dict = {}

    def files() -> str | None:
        missing = [p.name for p in (summary_path, metrics_path) if not p.is_file()]
        if missing:
            return f"missing {', '.join(missing)} (did the run finish?)"
        loaded["summary"] = json.loads(summary_path.read_text())
        loaded["rows"] = read_csv(metrics_path)
        absent = set(CSV_COLUMNS) - set(loaded["rows"][0] if loaded["rows"] else CSV_COLUMNS)
        return f"metrics.csv lacks columns {sorted(absent)}" if absent else None

    def epochs() -> str | None:
        wanted = loaded["summary"]["config"]["epochs"]
        got = [int(r["epoch"]) for r in loaded["rows"]]
        if got != list(range(1, wanted + 1)):
            return f"asked for {wanted} epochs, metrics.csv has epochs {got}"
        return None

    def world() -> str | None:
        summary = loaded["summary"]
        wanted = summary["config"]["workers"]
        sizes = {int(r["world_size"]) for r in loaded["rows"]}
        if summary["world_size"] != wanted or sizes != {wanted} or len(summary["nodes"]) != wanted:
            return (
                f"asked for {wanted} workers; summary says {summary['world_size']} on "
                f"{len(summary['nodes'])} ranks, metrics.csv says {sorted(sizes)}"
            )
        return None

    def finite() -> str | None:
        bad = [
            f"epoch {r['epoch']} {key}={r[key]}"
            for r in loaded["rows"]
            for key in ("train_loss", "val_loss")
            if not math.isfinite(float(r[key]))
        ]
        return f"non-finite loss: {', '.join(bad)}" if bad else None

    def fell() -> str | None:
        losses = [float(r["train_loss"]) for r in loaded["rows"]]
        # With one epoch there is no trend: compare with guessing, ln(classes).
        chance = math.log(loaded["summary"]["config"]["num_classes"])
        if len(losses) > 1 and not losses[-1] < losses[0]:
            return f"train loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}"
        if losses[-1] >= chance:
            return f"train loss {losses[-1]:.4f} is no better than guessing ({chance:.4f})"
        return None

    return [
        ("files present", files),
        ("all epochs completed", epochs),
        ("world size as asked", world),
        ("loss finite", finite),
        ("loss fell", fell),
    ]


def verify(run_dir: Path) -> bool:
    """Print a line per check; True when all pass. Without readable files the rest are skipped. A
    `raytrain launch` run (its summary.json holds the script's command) is refused: its results
    are the script's, in files of its own."""
    try:
        launched = "command" in json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        launched = False
    if launched:
        raise ConfigError(f"{run_dir} is a `raytrain launch` run, whose results are its script's: verify checks "
                          "the files of a `raytrain run`")
    readable = True
    failed = False
    for name, check in checks(run_dir):
        if not readable:
            print(f"SKIP  {name}")
            continue
        try:
            problem = check()
        except (KeyError, ValueError, IndexError, TypeError) as err:  # JSONDecodeError is a ValueError
            problem = f"unreadable run files ({type(err).__name__}: {err})"
        print(f"PASS  {name}" if problem is None else f"FAIL  {name}: {problem}")
        failed = failed or problem is not None
        readable = not (failed and name == "files present")
    return not failed

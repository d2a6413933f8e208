"""Errors to one line: what a user reads when a run fails, instead of a page of Ray internals."""

from __future__ import annotations

import re

EXIT_FAILED = 1
"""Training failed, or a launched script failed without an exit status of its own."""
EXIT_BAD_INPUT = 2
"""A bad request, refused in one line before any worker starts."""
EXIT_BAD_NODE = 3
"""A node was found bad (the run's bad_nodes.json names it): slurm/ray_cluster.sbatch requeues the job without it."""
EXIT_STOPPED = 75
"""EX_TEMPFAIL: stopped by SIGTERM or SIGUSR1 after a checkpoint; the same command resumes (Slurm requeues)."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports Ctrl-C; also a Ray job stopped by `raytrain stop`."""

OOM_MARKERS = ("OutOfMemoryError", "running low on memory")
"""How Ray's memory monitor says it killed a worker to save the node."""


def one_line(err: BaseException) -> str:
    """The last meaningful line of an error: for a remote failure, the worker's own exception."""
    failures = getattr(err, "worker_failures", None)
    if failures:
        rank, cause = min(failures.items())
        return f"training failed on rank {rank}: {one_line(cause)}"
    text = f"{type(err).__name__}: {err}"
    if bad_label := re.search(r"IndexError: (Target -?\d+ is out of bounds)", text):  # cross_entropy's, on CPU
        return (f"a sample's label is not below --num-classes (torch: {bad_label[1]}); pass --num-classes "
                "above the largest label, or fix the labels")
    if store := re.search(r"(When [^\n]*?AWS Error [A-Z_]+ during \w+ operation[^\n]*)", text):  # pyarrow's S3 errors
        return (f"the object store failed the run's files: {store[1][:300]}; the checkpoints registered there "
                "are kept: run the same command again to resume once it answers")
    if "CUDA out of memory" in text:
        return "a worker ran out of GPU memory: lower --batch-size, or keep --amp on"
    if any(marker in text for marker in OOM_MARKERS):
        return (
            "Ray killed a worker because its node ran out of memory (host RAM): lower --batch-size "
            "or --data-workers, or use fewer workers per node (--cpus-per-worker)"
        )
    cause = getattr(err, "controller_failure", None) or getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        return one_line(cause)
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__

"""Ray Train's run snapshot (checkpoint_manager_snapshot.json) as the installed Ray writes it: which
release it says wrote it. Ray has no public word on that file, so its model is read here."""

from __future__ import annotations


def snapshot_ray_version() -> str | None:
    """The `ray_version` the installed Ray writes into its run snapshot: its own version where its
    snapshot carries one (2.60 does), None where it carries none (2.52 does not)."""
    import ray

    try:
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState
    except ImportError:  # moved or gone: take the version, so a snapshot without one is set aside, never misread
        return ray.__version__
    model = _CheckpointManagerState
    fields = getattr(model, "model_fields", None) or getattr(model, "__fields__", {})  # pydantic 2, or 1
    return ray.__version__ if "ray_version" in fields else None

"""A wall against host syncs inside a training step, for tests: on a GPU a sync makes the CPU wait for
every kernel queued so far, so it can no longer run ahead of the GPU, and the step runs slower than
the loop a user writes by hand.

The wall stands during a training pass. Its syncs are at the points the loop names with
`allowed()`: the ranks' agreement (control.py), rank 0's progress update and a checkpoint; under
fp16, also the loss scaler's overflow check in each optimizer step (torch's GradScaler reads it back;
bf16 needs none). The epoch's end (validation, its checkpoint) comes after the pass.
Anywhere else, with RAYTRAIN_CHECK_HOST_SYNC=1 in the ranks' environment, a sync raises:
- on a GPU, through torch.cuda.set_sync_debug_mode("error"): every sync torch makes (`.item()`, a
  blocking copy, a synchronize);
- on a CPU, which has no syncs to catch, the calls that would be one on a GPU: a tensor read back to
  Python (`.item()`, `float(t)`, `bool(t)`), and a tensor made from Python data for a device
  (`torch.tensor(x, device=...)`, a blocking copy from pageable memory).
Unset, both functions cost a flag test. With RAYTRAIN_CHECK_HOST_SYNC=count (`raytrain bench overhead
--gpu`), nothing raises: every sync on a GPU, named or not, is counted (`syncs()`), through torch's
"warn" mode.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CHECK_ENV = "RAYTRAIN_CHECK_HOST_SYNC"
"""1 in the ranks' environment: a host sync outside the named points raises (tests/test_host_sync.py);
`count`: a GPU's syncs are counted instead (benchmarks)."""
COUNT_FILE = "host_syncs.json"
"""Under `count`, rank 0's syncs in its training passes, in the run's directory: {"syncs": N}."""
SYNC_WARNING = "called a synchronizing CUDA operation"
"""What torch says of each sync under set_sync_debug_mode("warn")."""


class HostSyncError(RuntimeError):
    """A host sync inside a training step."""


_wall: dict[str, Any] = {"up": False, "cuda": False, "lifted": 0, "syncs": None}
"""Whether the wall stands, on which device, how deep the named points that lift it are nested, and
the syncs counted so far under `count`."""


@contextlib.contextmanager
def wall(device: torch.device) -> Iterator[None]:
    """Around a training pass: host syncs raise outside `allowed()`, when CHECK_ENV asks for it; or,
    under `count` on a GPU, are added to `syncs()`."""
    if os.environ.get(CHECK_ENV) == "count" and device.type == "cuda":
        with counted() as seen:
            yield
        _wall["syncs"] = (_wall["syncs"] or 0) + seen[0]
        return
    if os.environ.get(CHECK_ENV) != "1":
        yield
        return
    _wall.update(up=True, cuda=device.type == "cuda", lifted=0)
    try:
        if _wall["cuda"]:
            torch.cuda.set_sync_debug_mode("error")
            yield
        else:
            with _NoDeviceScalars(), _NoReadBack():
                yield
    finally:
        if _wall["cuda"]:
            torch.cuda.set_sync_debug_mode("default")
        _wall["up"] = False


def syncs() -> int | None:
    """The host syncs of this process's passes (`wall`) under CHECK_ENV=count on a GPU, named points
    included (the agreement, the progress update, a checkpoint the pass makes); else None."""
    return _wall["syncs"]


@contextlib.contextmanager
def counted() -> Iterator[list[int]]:
    """[the syncs torch made on the GPU within the block], for a benchmark: torch warns of each one, and
    those warnings are counted, not shown. Other warnings show as before."""
    seen = [0]
    with warnings.catch_warnings():  # puts showwarning and the filters back
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        show = warnings.showwarning

        def count(message, *args, **kwargs):
            if SYNC_WARNING in str(message):
                seen[0] += 1
            else:
                show(message, *args, **kwargs)

        warnings.showwarning = count
        cuda = torch.cuda.is_available()  # a CPU has no syncs to count
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def allowed(when: bool = True) -> Iterator[None]:
    """A named sync point (or host work that is not the step's, the loader): the wall, if it stands,
    is lifted for the block, `when` it is one."""
    if not (_wall["up"] and when):
        yield
        return
    _wall["lifted"] += 1
    if _wall["cuda"]:
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        _wall["lifted"] -= 1
        if _wall["cuda"] and _wall["lifted"] == 0:
            torch.cuda.set_sync_debug_mode("error")


def _refuse(what: str, frame: traceback.FrameSummary) -> None:
    raise HostSyncError(f"a host sync inside a training step at {frame.filename}:{frame.lineno} ({frame.line}): "
                        f"{what}; move it to a named sync point (worker/host_sync.py)")


TORCH_DIR = os.path.dirname(torch.__file__)
PASSAGE = tuple(os.path.join(TORCH_DIR, *path) for path in (("_compile.py",), ("_dynamo", "eval_frame.py"),
                                                              ("utils", "_python_dispatch.py"), ("overrides.py",)))
"""torch's frames between a call and a Python mode's handler."""


def _caller() -> traceback.FrameSummary:
    """The frame that made the call a mode sees: the innermost one outside this module and torch's passage to it."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and not frame.filename.startswith(PASSAGE):
            return frame
    raise AssertionError("a mode's handler with no caller")


class _NoDeviceScalars(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None and not _wall["lifted"]:
            _refuse(f"{func.__name__}(..., device={kwargs['device']}) copies Python data to the device", _caller())
        return func(*args, **kwargs)


class _NoReadBack(TorchDispatchMode):
    """On a CPU every tensor is the host's: only a read made from outside torch (ours, the user's) is
    taken for one of the device's. torch's own reads, such as DDP's reducer's from host-side flags,
    are left to the GPU test, where the device tells them apart."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not _wall["lifted"]:
            frame = _caller()
            if not frame.filename.startswith(TORCH_DIR):
                _refuse("a tensor read back to Python (.item(), float(), int() or bool() of a tensor)", frame)
        return func(*args, **(kwargs or {}))

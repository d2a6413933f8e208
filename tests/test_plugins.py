"""The user's own model and dataset by import path: bad paths fail in one line, good ones train."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, raytrain
from test_cli import assert_refused

from raytrain_ddp.run_files import read_csv

USER_CODE = Path(__file__).parent / "scripts" / "user_code.py"
FLAT = ["--model", "user_code:SkipsOnOdd", "--dataset", "user_code:vectors", "--num-classes", "4"]


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A directory holding the user's module, which nothing installed can import."""
    shutil.copy(USER_CODE, tmp_path / "user_code.py")
    (tmp_path / "broken.py").write_text("import torch\nmodel = undefined_name\n")
    (tmp_path / "needs_dep.py").write_text("import a_package_nobody_installed\n")
    (tmp_path / "wrong.py").write_text(WRONG)
    return tmp_path


WRONG = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def wide(num_classes, in_channels):
    return nn.Linear(in_channels, num_classes + 1)


def labels_12(split, data_dir, image_size):
    return TensorDataset(torch.randn(8, 20), torch.full((8,), 12))
"""
"""Parts that import and build, and would fail a rank at its first step."""


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--model", "no_such_module:build"], ["no module 'no_such_module'", "PYTHONPATH"]),
        (["--model", "user_code:Nope"], ["user_code has no 'Nope'", "SkipsOnOdd", "vectors"]),
        (["--model", "broken:model"], ["importing broken failed: NameError", "broken.py line 2"]),
        (["--dataset", "needs_dep:load"], ["importing needs_dep failed", "a_package_nobody_installed"]),
        (["--model", "user_code:"], ["is not an import path", "PKG.MODULE:CALLABLE"]),
        (["--dataset", "user_code:vectors", "--loader", "ray"], ["--loader ray reads Parquet shards"]),
    ],
)
def test_bad_import_path_is_one_line_before_any_worker(user_dir, args, fragments):
    # No cluster is reachable at this address: the error must come before connecting.
    proc = raytrain("run", *args, "--address", "127.0.0.1:1", "--storage-path", str(user_dir / "runs"),
                    cwd=user_dir, timeout=60)
    assert_refused(proc, *fragments)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--model", "wrong:wide"], ["--model wrong:wide gave (2, 5) for a batch of 2, not (2, 4) logits"]),
        (["--model", "convnet"], ["--dry-run: --model convnet on a batch of inputs (2, 20) (torch.float32) failed: Expected"]),
        (["--dataset", "wrong:labels_12"], ["--dataset wrong:labels_12: train labels [12, 12] are not all below --num-classes 4"]),
    ],
)
def test_dry_run_tries_a_first_step_and_names_the_part_that_fails(user_dir, args, fragments):
    """Each of these imports and builds, so only a rank's first step (after the cluster and the
    workers started) would have found it: --dry-run runs that step on the driver's CPU first."""
    good = raytrain("run", *FLAT, "--dry-run", "--storage-path", str(user_dir / "runs"), cwd=user_dir, timeout=120)
    assert good.returncode == 0 and "dry run: a batch of 2 train samples, inputs (20,) float32" in good.stderr, good.stderr
    proc = raytrain("run", *FLAT, *args, "--dry-run", "--storage-path", str(user_dir / "runs"), cwd=user_dir, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]  # after the model state's line
    assert proc.returncode == 2 and last.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert all(fragment in last for fragment in fragments), last


@pytest.mark.e2e
def test_user_model_and_dataset_train_on_flat_vectors(ray_head, user_dir):
    """Not installed, not images, and a layer skipped on odd steps: --find-unused-parameters trains it.
    The dataset comes from a second module beside the model's: the workers import both from there."""
    shutil.copy(USER_CODE, user_dir / "user_data.py")
    proc = raytrain(
        "run", *FLAT, "--dataset", "user_data:vectors", "--find-unused-parameters", *TINY, "--epochs", "3", "--lr", "0.1",
        "--batch-size", "64", "--storage-path", str(user_dir / "runs"), "--name", "flat", env=ray_head.env, cwd=user_dir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("importing ")]
    assert said == [f"importing user_code:SkipsOnOdd, user_data:vectors from {user_dir} on the workers (all on this machine)"], said
    rows = read_csv(user_dir / "runs" / "flat" / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert int(rows[0]["samples"]) == 1024  # the user's dataset is used whole, not capped by --train-samples
    assert float(rows[-1]["val_acc"]) > 0.5  # 4 classes: chance is 0.25
    summary = json.loads((user_dir / "runs" / "flat" / "summary.json").read_text())
    assert summary["config"]["model"] == "user_code:SkipsOnOdd"


@pytest.mark.e2e
def test_skipped_layer_without_the_flag_names_the_flag(ray_head, user_dir):
    """Bad input, not a failure: exit 2, and no retry under --max-failures (each would fail the same)."""
    proc = raytrain("run", *FLAT, *TINY, "--max-failures", "2", "--storage-path", str(user_dir / "runs"),
                    "--name", "static", env=ray_head.env, cwd=user_dir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --model user_code:SkipsOnOdd has parameters"), proc.stderr[-3000:]
    assert "got no gradient" in lines[-1] and "--find-unused-parameters" in lines[-1]
    assert proc.stderr.count("got no gradient") == 1
    assert "Traceback" not in proc.stderr


API_PY = """\
import sys
from torch import nn
from raytrain_ddp import TrainConfig, run

def mlp(num_classes, in_channels):  # defined in __main__, as in a notebook: it travels by value
    return nn.Sequential(nn.Linear(in_channels, 64), nn.ReLU(), nn.Linear(64, num_classes))

cfg = TrainConfig(workers=2, epochs=3, lr=0.1, num_classes=4, data_workers=0, progress="none",
                  storage_path=sys.argv[1], name="api")
summary = run(cfg, model=mlp, dataset="user_code:vectors")
print("RESULT", summary["final"]["val_acc"], summary["config"]["model"], summary["config"]["dataset"])
"""


@pytest.mark.e2e
def test_python_api_takes_a_callable_and_an_import_path(ray_head, user_dir):
    (user_dir / "notebook.py").write_text(API_PY)
    proc = subprocess.run([sys.executable, "notebook.py", str(user_dir / "runs")], env=ray_head.env, cwd=user_dir,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, val_acc, model, dataset = proc.stdout.strip().splitlines()[-1].split()
    assert float(val_acc) > 0.5 and model == "__main__:mlp" and dataset == "user_code:vectors"
    assert (user_dir / "runs" / "api" / "metrics.csv").exists()


USER_MODULE = """\
class Builder:
    def __init__(self, width):
        self.width = width

    def build(self, num_classes):
        return ("built", self.width, num_classes)

    def __call__(self, num_classes):
        return self.build(num_classes)


def build(num_classes, width=1):
    return ("built", width, num_classes)
"""


def test_python_api_sends_partials_lambdas_instances_and_bound_methods_by_value(tmp_path, monkeypatch):
    """Each travels by value, and is called on a worker that cannot import the user's module: a
    fresh interpreter without the module's directory on its path stands in for that worker."""
    import functools

    import ray.cloudpickle

    from raytrain_ddp.plugins import as_spec

    (tmp_path / "api_models19.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import api_models19

    builder = api_models19.Builder(7)
    sent = {
        "partial(build)": functools.partial(api_models19.build, width=7),
        "<lambda>": lambda num_classes: api_models19.build(num_classes, 7),
        "Builder instance": builder,
        "Builder.build": builder.build,
    }
    for label, obj in sent.items():
        spec, by_value = as_spec(obj, "model")
        assert spec.startswith("__main__:") and spec.endswith(label) and by_value is obj, (label, spec)
        blob = ray.cloudpickle.dumps(by_value)
        worker = subprocess.run([sys.executable, "-c", "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())(4))"],
                                input=blob, capture_output=True, cwd="/", timeout=60)
        assert worker.stdout.decode().strip() == "('built', 7, 4)", (label, worker.stderr.decode()[-2000:])
    assert as_spec(api_models19.build, "model") == ("api_models19:build", None)  # importable: by name

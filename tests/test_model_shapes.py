"""driver/plan/model_shapes.py: a built-in model's shapes are built once and read from the cache after,
with no torch on the driver; a new key builds again, a bad cache file costs a build, and the user's
own --model is built every time. The whole driver of the README's quick start staying torch-free on
a warm cache is checked end to end in test_cli.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver.plan import model_shapes as ms
from raytrain_ddp.worker.models import MODELS

CHECK = """
import sys
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.driver.plan import preflight
cfg = TrainConfig(workers=2, storage_path=sys.argv[1], name="shapes", model=sys.argv[2])
plan = preflight.check_request(cfg)
preflight.model_state(plan.cfg, plan.model_shapes)
print("torch" in sys.modules, plan.model_shapes.count)
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "raytrain_ddp" / "model_shapes.json"


def preflight_in_a_new_driver(tmp_path, model: str) -> tuple[bool, int]:
    """check_request and the state estimate in a fresh interpreter: (torch imported, parameters)."""
    proc = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "runs"), model], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_imported, count = proc.stdout.split()
    return torch_imported == "True", int(count)


def test_the_second_driver_of_a_built_in_model_reads_its_shapes_without_torch(tmp_path, cache):
    assert preflight_in_a_new_driver(tmp_path, "resnet18") == (True, 11_181_642)  # built on meta, then kept
    assert preflight_in_a_new_driver(tmp_path, "resnet18") == (False, 11_181_642)


def test_the_shapes_are_the_models_and_a_new_key_builds_again(cache):
    cfg = TrainConfig(model="convnet")
    built = ms.model_shapes(cfg, None, 3)
    with torch.device("meta"):
        model = MODELS["convnet"](num_classes=10, in_channels=3)
    assert built == ms.of(model) and built.state == {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ms.model_shapes(cfg, None, 3) == built  # read back from the file
    mnist = ms.model_shapes(cfg, None, 1)
    assert mnist.state["0.0.weight"] == [32, 1, 3, 3] and built.state["0.0.weight"] == [32, 3, 3, 3]
    assert len(ms.read_cache()) == 2


def test_a_bad_cache_file_costs_a_build_and_is_replaced(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    cfg = TrainConfig(model="convnet")
    assert ms.model_shapes(cfg, None, 3).count == 94_762
    key = ms.cache_key(cfg, 3)
    assert list(ms.read_cache()) == [key]
    cache.write_text('{"%s": {"state": 1}}' % key)  # an entry of another shape: built again
    assert ms.model_shapes(cfg, None, 3).count == 94_762


def test_the_users_own_model_is_built_every_time_and_never_kept(cache):
    calls = []

    def build(num_classes: int, in_channels: int) -> torch.nn.Module:
        calls.append(num_classes)
        return torch.nn.Linear(in_channels, num_classes)

    cfg = TrainConfig(model="__main__:build")
    assert ms.model_shapes(cfg, build, 3).count == 3 * 10 + 10
    assert ms.model_shapes(cfg, build, 3).count == 3 * 10 + 10
    assert calls == [10, 10] and not cache.exists()


def test_a_model_with_lazy_layers_is_refused_in_one_line(cache):
    """DDP refuses uninitialized parameters on every rank; the driver says so first, naming the fix."""
    def lazy(num_classes: int, in_channels: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))

    with pytest.raises(ConfigError, match=r"^--model __main__:lazy has lazy layers, whose parameters \(1\.weight and more\) "
                                          r"have no shape .*nn\.Linear for nn\.LazyLinear"):
        ms.model_shapes(TrainConfig(model="__main__:lazy"), lazy, 3)

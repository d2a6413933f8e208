"""The walls between the parts of the package, read from the imports (lazy ones included), so the
tree keeps saying where a change goes: no module imports one that imports it back, the worker loop
never reaches the CLI or the driver, config stands alone, data and models stay off cluster code, and
the shell scripts use only the `raytrain` and `ray` commands."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "raytrain_ddp"
DRIVER_SIDE = ("raytrain_ddp.cli", "raytrain_ddp.launch", "raytrain_ddp.script", "raytrain_ddp.tools")
"""The CLI, the drivers of `run` and `launch`, and the cluster tools."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """Every module `name` imports anywhere in its body: project modules, and outside ones by top name
    (`ray.data` stays whole, so the data wall can tell Ray Data from the rest of Ray)."""
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
    # `import raytrain_ddp` names the package (its files' location), not its face's imports.
    return {m for m in found if m != "raytrain_ddp"}


def project_imports(name: str) -> set[str]:
    return {m for m in imports(name) if m in MODULES}


def reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for m in project_imports(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_reader_sees_every_module():
    assert {"raytrain_ddp.loop", "raytrain_ddp.config", "raytrain_ddp.data.registry", "raytrain_ddp.tools.submit"} <= set(MODULES)
    assert "raytrain_ddp.data.formats" in project_imports("raytrain_ddp.data.registry")  # a from-import of a module
    assert "raytrain_ddp.data.ray_ingest" in project_imports("raytrain_ddp.data.loaders")  # a lazy one


def test_no_module_imports_one_that_imports_it_back():
    cycles = sorted(name for name in MODULES if name in reachable(name) and name != "raytrain_ddp")
    assert cycles == []


def test_the_worker_loop_never_reaches_the_cli_or_the_driver():
    worker_side = reachable("raytrain_ddp.loop") | reachable("raytrain_ddp.agent") | {"raytrain_ddp.loop"}
    assert sorted(m for m in worker_side if m.startswith(DRIVER_SIDE)) == []


def test_config_imports_no_other_project_module():
    assert project_imports("raytrain_ddp.config") == set()


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("raytrain_ddp.data") or n == "raytrain_ddp.models"))
def test_data_and_models_stay_off_cluster_code(name):
    assert sorted(m for m in reachable(name) if m.startswith(DRIVER_SIDE)) == []
    # Ray Data and Ray Train's per-worker API feed the ingest paths; nothing else of Ray.
    ray_parts = {m for m in imports(name) if m == "ray" or m.startswith("ray.")}
    assert ray_parts <= {"ray.data", "ray.train"}, ray_parts


@pytest.mark.parametrize("script", ["slurm/ray_cluster.sbatch", "cluster/ray_node.sh"])
def test_shell_scripts_use_only_the_commands(script):
    """They run `raytrain` and `ray` (and Ray's Python API), never the package's insides, which may move."""
    code = [line for line in (REPO / script).read_text().splitlines() if not line.lstrip().startswith("#")]
    assert [line for line in code if re.search(r"raytrain_ddp|python3? -m raytrain", line)] == []

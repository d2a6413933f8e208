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
DRIVER_SIDE = ("raytrain_ddp.cli", "raytrain_ddp.driver", "raytrain_ddp.sweep", "raytrain_ddp.jobs",
               "raytrain_ddp.launch.command", "raytrain_ddp.launch.hub")
"""The CLI and the driver side: what runs in the process the user started (and the launch hub, an
actor beside it)."""
RANK_SIDE = ("raytrain_ddp.worker", "raytrain_ddp.launch.agent", "raytrain_ddp.launch.supervisor")
"""What runs on the ranks: the loop and its parts, and launch's agent and the script's supervisor."""


def driver_side(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in DRIVER_SIDE)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def top_level_imports(name: str) -> set[str]:
    """What `name` imports when it is imported: its module body's imports (under `if` and `try` too),
    not those inside functions or under `if TYPE_CHECKING:`."""
    found, todo = set(), list(ast.parse(MODULES[name].read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # for type checkers only: never imported when the module is
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                n for handler in getattr(node, "handlers", []) for n in handler.body]
    return {m for m in found if m != "raytrain_ddp"}


def imported_with(name: str) -> set[str]:
    """Every module that importing `name` imports: its top-level imports, theirs, and the packages above each."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        parents = {".".join(current.split(".")[:i]) for i in range(2, current.count(".") + 1)}
        for m in (top_level_imports(current) if current in MODULES else set()) | (parents & set(MODULES)):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


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
    assert {"raytrain_ddp.worker.loop", "raytrain_ddp.config", "raytrain_ddp.data.registry", "raytrain_ddp.jobs.command"} <= set(MODULES)
    assert "raytrain_ddp.data.formats" in project_imports("raytrain_ddp.data.registry")  # a from-import of a module
    assert "raytrain_ddp.data.ray_ingest" in project_imports("raytrain_ddp.data.loaders")  # a lazy one


def test_no_module_imports_one_that_imports_it_back():
    cycles = sorted(name for name in MODULES if name in reachable(name) and name != "raytrain_ddp")
    assert cycles == []


def test_the_worker_loop_never_reaches_the_cli_or_the_driver():
    entries = sorted(n for n in MODULES if any(n == r or n.startswith(r + ".") for r in RANK_SIDE))
    worker_side = set(entries).union(*(reachable(e) for e in entries))
    assert sorted(m for m in worker_side if driver_side(m)) == []


def test_what_the_workers_run_lives_outside_the_drivers():
    """TorchTrainer's function for `run` is in worker/entry.py and the launch agent's in launch/agent.py,
    so the driver side holds only what runs on the driver."""
    defined = {name: {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)} for name, path in MODULES.items()}
    assert "train_entry" in defined["raytrain_ddp.worker.entry"]
    assert "run_script" in defined["raytrain_ddp.launch.agent"]
    assert sorted(n for n in MODULES if driver_side(n) and {"train_entry", "train_loop", "run_script"} & defined[n]) == []


def test_the_doctor_imports_nothing_of_the_driver_side():
    """The doctor's watches are asked by the drivers; what they raise (stops.py) and write
    (run_files.py) lives on the floor that every side uses."""
    doctor = [n for n in MODULES if n.startswith("raytrain_ddp.doctor.")]
    assert {n: sorted(m for m in project_imports(n) if driver_side(m)) for n in doctor} == {n: [] for n in doctor}


DRIVER_FLOORS = ["session", "plan", "core", "run", "look"]
"""driver/'s rooms from the ground up: joining Ray; the plan; the core every command that trains
shares; the commands. A room imports only the rooms before it in this list (run and look, the top
floor, not each other)."""


def test_the_drivers_rooms_stand_on_the_ones_below():
    floor = {room: min(i, 3) for i, room in enumerate(DRIVER_FLOORS)}
    driver = [n for n in MODULES if n.startswith("raytrain_ddp.driver.") and n.count(".") >= 3]
    assert {n.split(".")[2] for n in driver} == set(DRIVER_FLOORS)
    up = sorted(f"{n} -> {m}" for n in driver for m in project_imports(n)
                if m.startswith("raytrain_ddp.driver.") and m.count(".") >= 3
                and m.split(".")[2] != n.split(".")[2] and floor[m.split(".")[2]] >= floor[n.split(".")[2]])
    assert up == []


@pytest.mark.parametrize("name", ["raytrain_ddp.stops", "raytrain_ddp.run_files", "raytrain_ddp.run_records"])
def test_what_every_side_shares_is_light(name):
    """The stop exceptions, the run's files and rank 0's records are read by the CLI, the drivers, the
    doctor and the ranks alike."""
    assert {m.split(".")[0] for m in imported_with(name) | top_level_imports(name)} & {"torch", "torchvision", "ray"} == set()


MOST_MODULES = 12
"""A folder past this many modules is several rooms."""


def test_no_folder_is_a_hall():
    """One folder, one room: none holds more than MOST_MODULES modules, and no folder under the package
    holds a quarter of its lines, its subfolders' included."""
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    crowded = {str(f.relative_to(REPO)): n for f in folders if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MOST_MODULES}
    total = sum(lines.values())
    share = {str(f.relative_to(REPO)): round(sum(lines[module_name(p)] for p in f.rglob("*.py")) / total, 2)
             for f in folders if f != PACKAGE}
    assert crowded == {}
    assert {f: s for f, s in share.items() if s > 0.25} == {}


def test_exit_codes_are_defined_once():
    assigned = {
        name: [t.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("EXIT_")]
        for name, path in MODULES.items()
    }
    assert {name: codes for name, codes in assigned.items() if codes and name != "raytrain_ddp.errors"} == {}
    assert {"EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_STOPPED", "EXIT_INTERRUPTED"} <= set(assigned["raytrain_ddp.errors"])


RAY_DOOR = "raytrain_ddp.ray_compat"
"""The one door to Ray's internals (its docstring): no other module names a private Ray name."""


def private_ray_names(path: Path) -> list[str]:
    """What a file takes from Ray's private parts: an import of a module with a private part
    (`ray._private`, `ray.train.v2._internal`), a private name imported from Ray, an attribute path
    through one (`ray._private.state`), and a method that overrides a private one of a class of Ray's."""
    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "ray" and any(p.startswith("_") and not p.endswith("__") for p in parts)

    tree = ast.parse(path.read_text())
    from_ray = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.split(".")[0] == "ray" for alias in node.names}
    found, paths = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{a.name}" for a in node.names if private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "ray" and private(".".join(["ray", *parts])):
                paths.append(".".join(["ray", *parts]))
        elif isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in from_ray for b in node.bases):
            found += [f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)
                      and f.name.startswith("_") and not f.name.startswith("__")]
    found += [p for p in paths if not any(other.startswith(p + ".") for other in paths)]  # the whole path once
    return sorted(set(found))


def test_the_wall_sees_each_kind_of_private_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ray\nimport ray._private.state\nfrom ray.train.v2._internal.util import TrainingFramework\n"
        "from ray.train import _internal\nfrom ray.train import Checkpoint\nfrom ray.train.torch import TorchTrainer\n"
        "x = ray._private.state.state\ny = ray.train.report\nz = ray.__version__\n"
        "class T(TorchTrainer):\n    def _initialize_and_run_controller(self): pass\n    def __init__(self): pass\n"
    )
    assert private_ray_names(sample) == [
        "T._initialize_and_run_controller", "ray._private.state", "ray._private.state.state",
        "ray.train._internal", "ray.train.v2._internal.util.TrainingFramework",
    ]


def test_no_module_but_the_door_names_a_private_ray_name():
    outside = [p for name, p in MODULES.items() if not (name == RAY_DOOR or name.startswith(RAY_DOOR + "."))]
    tests = sorted((REPO / "tests").rglob("*.py"))
    found = {str(p.relative_to(REPO)): names for p in outside + tests if (names := private_ray_names(p))}
    assert found == {}


def test_the_door_imports_ray_lazily_where_a_name_may_be_missing():
    """Its face imports no Ray at all: a missing name breaks one feature at its use, not every command."""
    assert {m for m in imports(RAY_DOOR) if m.split(".")[0] == "ray"} == set()


def test_config_imports_no_other_project_module():
    assert project_imports("raytrain_ddp.config") == set()


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("raytrain_ddp.data") or n == "raytrain_ddp.worker.models"))
def test_data_and_models_stay_off_cluster_code(name):
    assert sorted(m for m in reachable(name) if driver_side(m)) == []
    # Ray Data and Ray Train's per-worker API feed the ingest paths; nothing else of Ray.
    ray_parts = {m for m in imports(name) if m == "ray" or m.startswith("ray.")}
    assert ray_parts <= {"ray.data", "ray.train"}, ray_parts


@pytest.mark.parametrize("script", ["slurm/ray_cluster.sbatch", "cluster/ray_node.sh"])
def test_shell_scripts_use_only_the_commands(script):
    """They run `raytrain` and `ray` (and Ray's Python API), never the package's insides, which may move."""
    code = [line for line in (REPO / script).read_text().splitlines() if not line.lstrip().startswith("#")]
    assert [line for line in code if re.search(r"raytrain_ddp|python3? -m raytrain", line)] == []


HEAVY = ("torch", "torchvision")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if driver_side(n)))
def test_the_driver_side_imports_no_torch_at_module_level(name):
    """Importing torch costs seconds on the critical path of every command; the driver side takes it
    only inside the functions that need it (the model state estimate), so imports stay at the top."""
    heavy = sorted(m for m in imported_with(name) | {name} if m.split(".")[0] in HEAVY
                   or (m in MODULES and top_level_imports(m) & set(HEAVY)))
    assert heavy == []


def test_importing_the_cli_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, raytrain_ddp.cli; print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_typer_is_the_clis_alone():
    users = sorted(n for n in MODULES if "typer" in {m.split(".")[0] for m in imports(n)})
    assert users and all(n == "raytrain_ddp.cli" or n.startswith("raytrain_ddp.cli.") for n in users), users


def script_main(path: Path) -> bool:
    """Whether a file runs as a script of its own: `if __name__ == "__main__":`."""
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
               and node.test.left.id == "__name__" for node in ast.parse(path.read_text()).body)


def test_benchmarks_and_tools_have_no_entry_of_their_own():
    """Every command is reached through `raytrain` (the CLI), so there is one way in and one --help.
    Three scripts remain, none a user's: the torchrun baseline, which `raytrain bench overhead` hands
    to torchrun, the generator of docs/cli.md, which a developer runs after changing a flag, and the
    private Ray's keeper, which the driver spawns by its file path."""
    entries = sorted(name for name, path in MODULES.items() if script_main(path) or "argparse" in imports(name))
    assert entries == ["raytrain_ddp.bench.torchrun_baseline", "raytrain_ddp.cli.reference", "raytrain_ddp.driver.session.keeper"]


def test_the_keeper_imports_only_the_standard_library_and_no_neighbour_shadows_it():
    """The private Ray's keeper runs by its file path (python .../keeper.py), with nothing of ours, so
    its folder comes first on its sys.path: a module beside it named like one of the standard
    library's would be imported in its place."""
    import sys

    keeper = "raytrain_ddp.driver.session.keeper"
    assert {m.split(".")[0] for m in imports(keeper)} - {"__future__"} <= set(sys.stdlib_module_names)
    beside = {p.stem for p in MODULES[keeper].parent.glob("*.py")}
    assert beside & set(sys.stdlib_module_names) == set()


def test_checkpoint_file_names_are_light():
    """The file names are declared once, where the driver can read them without torch or Ray."""
    assert {m.split(".")[0] for m in imported_with("raytrain_ddp.checkpoint.files")} & {"torch", "ray"} == set()


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []

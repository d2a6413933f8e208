"""The user's own model and dataset, by import path: `--model PKG.MODULE:CALLABLE`.

The driver imports them first, so a typo, a missing name or a broken module is one line that names
the module and the fix, before any worker starts; then every worker imports them again (from the
shared filesystem, or from the copy shipping.py sent). No Ray here, and no torch at import time.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp.config import ConfigError


def is_import_path(name: str) -> bool:
    return ":" in name


def split(spec: str, flag: str) -> tuple[str, str]:
    module, _, attr = spec.partition(":")
    if not module or not attr or not all(part.isidentifier() for part in [*module.split("."), *attr.split(".")]):
        raise ConfigError(f"{flag} {spec!r} is not an import path; write PKG.MODULE:CALLABLE, e.g. {flag} mymodels:build")
    return module, attr


def importable_from_cwd() -> None:
    """`raytrain` is a console script, so Python put its bin/ on sys.path, not the current directory;
    put the current directory first, as `python -m` and `python script.py` users expect."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def load(spec: str, flag: str) -> Callable[..., Any]:
    """The callable at `spec`, or a one-line ConfigError naming the module and the fix."""
    module_name, attr = split(spec, flag)
    importable_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ConfigError(
                f"{flag} {spec}: no module {err.name!r} in {os.getcwd()} or on PYTHONPATH; run raytrain "
                f"from the directory that holds it, or add that directory to PYTHONPATH"
            ) from None
        raise ConfigError(f"{flag} {spec}: importing {module_name} failed: {err}{where(err)}; install it or fix the import") from None
    except Exception as err:  # SyntaxError, NameError, ... raised while the module runs
        raise ConfigError(f"{flag} {spec}: importing {module_name} failed: {type(err).__name__}: {err}{where(err)}") from None
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            names = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
            raise ConfigError(
                f"{flag} {spec}: {module_name} has no {attr!r}; it defines {', '.join(names) or 'no callables'}"
            )
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"{flag} {spec}: {attr} is a {type(found).__name__}, not a function or class")
    return found


def where(err: BaseException) -> str:
    """' (file.py line N)' of the innermost frame outside importlib, for errors raised on import."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" ({err.filename} line {err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    return f" ({frames[-1].filename} line {frames[-1].lineno})" if frames else ""


def source(spec: str) -> tuple[Path, Path]:
    """(the module's file, the sys.path directory it was imported from), for shipping.place."""
    module_name, _ = split(spec, "")
    file = Path(sys.modules[module_name].__file__).absolute()
    depth = module_name.count(".") + (1 if file.name == "__init__.py" else 0)
    return file, file.parents[depth]


def as_spec(obj: str | Callable[..., Any] | None, flag: str) -> tuple[str | None, Callable[..., Any] | None]:
    """For the Python API: (import path, callable to send by value).

    A function or class that its module's import path names travels as that path, so workers import
    it like any --model. Anything else travels by value (Ray pickles it): one defined in a notebook
    or `__main__`, a lambda, a `functools.partial`, a callable instance, a bound method. Its name
    is then `__main__:<what it is>`, for the run's files only."""
    if obj is None or isinstance(obj, str):
        return obj, None
    if not callable(obj):
        raise ConfigError(f"{flag} must be a name, an import path or a callable (got {type(obj).__name__})")
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and module != "__main__" and name and importable_as(obj, module, name):
        return f"{module}:{name}", None
    for user_module in own_modules(obj):
        # Workers may not be able to import the user's module (not shared, not on their path), so
        # what the callable refers to in it travels by value too.
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(user_module)
    return f"__main__:{label(obj)}", obj


def own_modules(obj: Any) -> list[Any]:
    """The user's modules (not installed packages, not the standard library) behind a callable: a
    partial's function, a bound method's class, a callable instance's class."""
    inner = obj.func if isinstance(obj, functools.partial) else obj
    inner = getattr(inner, "__self__", None) or inner  # a bound method: its object
    cls = inner if inspect.isclass(inner) or inspect.isfunction(inner) else type(inner)
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if module is None or module.__name__ == "__main__" or file is None:
        return []
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if any(Path(file).resolve().is_relative_to(Path(path).resolve()) for path in installed):
        return []
    return [module]


def importable_as(obj: Any, module: str, name: str) -> bool:
    """Whether importing `module` and following `name` gives back `obj` itself: true of a plain
    function or class, false of a lambda, a nested function or a bound method."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)) or "<" in name:
        return False
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found is obj


def label(obj: Any) -> str:
    """A readable name for a callable sent by value: mlp, partial(mlp), Builder.build, <lambda>."""
    if isinstance(obj, functools.partial):
        return f"partial({label(obj.func)})"
    name = getattr(obj, "__qualname__", None) or f"{type(obj).__qualname__} instance"
    return name.replace(".<locals>", "")

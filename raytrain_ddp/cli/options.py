"""The options that many commands share: one per TrainConfig field, and --debug on every command.

Both are added to a command's signature here, so typer shows them, and taken off before the call.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from raytrain_ddp.config import FIELD_TYPES, TrainConfig, field_docs, flag_decls, resolve


def train_options(
    command: Callable[..., Any] | None = None, *, own_flags: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
    helps: dict[str, str] | None = None,
):
    """Give `command(cfg, ...)` one option per TrainConfig field, plus --config.

    Options left out arrive as None, so config.resolve lets the flags the user typed override the
    config file, and the file override the defaults. Fields in `own_flags` are the command's own
    (e.g. scale's --workers 1,2,4); with `only`, the command takes just those fields (and no --config).
    `helps`: a field's help where this command means it otherwise than `run` (launch's --workers).
    """
    if command is None:
        return functools.partial(train_options, own_flags=own_flags, only=only, helps=helps)
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]  # all but cfg
    docs = field_docs() | (helps or {})
    taken = [f.name for f in fields(TrainConfig) if f.name not in own_flags and (only is None or f.name in only)]
    generated = []
    for f in fields(TrainConfig):
        if f.name not in taken:
            continue
        kinds = [k for k in FIELD_TYPES[f.name] if k is not type(None)]
        # The option's own default is None ("not given", so a config file's value stands): the help
        # names the field's, as click would (typer's show_default="..." prints it in parentheses).
        option = typer.Option(None, *flag_decls(f.name), help=docs[f.name] + shown_default(f), show_default=False,
                              metavar="N|MIN:MAX" if f.name == "workers" else None)
        kind = str if f.name == "workers" else kinds[0]  # N, or MIN:MAX (config.parse_workers)
        generated.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=Optional[kind]))
    config_file = inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(None, "--config", help="YAML or TOML file of the same keys; flags override it."),
        annotation=Optional[Path],
    )

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in taken}
        cfg = resolve(kwargs.pop("config", None), flags)
        return command(cfg, **kwargs)

    return with_signature(wrapper, own + ([config_file] if only is None else []) + generated)


def shown_default(f: Any) -> str:
    """`  [default: X]` for a field's help, click's way: a bool flag's default named by its flag."""
    if f.default in (MISSING, None):
        return ""
    decl = flag_decls(f.name)[0]
    if "/" in decl:  # --gpu/--cpu, --resume/--no-resume
        shown = decl.split("/")[0 if f.default else 1].lstrip("-")
    else:
        shown = str(f.default)
    return f"  [default: {shown}]"


DEBUG = inspect.Parameter(
    "debug",
    inspect.Parameter.KEYWORD_ONLY,
    default=typer.Option(False, "--debug", help="Show full tracebacks."),
    annotation=bool,
)
"""Every command's --debug. The command never sees it: cli.main reads it from the command line, as
it decides how an error from anywhere in the command is shown."""


def takes_debug(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with --debug among its options, dropped before the call."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs.pop(DEBUG.name)
        return command(**kwargs)

    return with_signature(wrapper, [*inspect.signature(command, eval_str=True).parameters.values(), DEBUG])


def with_signature(wrapper: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """The signature typer reads to build a command's options, in place of the wrapped function's."""
    del wrapper.__wrapped__  # typer must see the generated signature, not the original one
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper

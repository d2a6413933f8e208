"""Typer's parse errors (a bad value, an unknown option, a missing argument) as one line of ours,
in place of its framed box: the option, the value, what it should be, and where the help is."""

from __future__ import annotations

import math
from typing import Any

import typer

USAGE_ERROR: type[Exception] = typer.BadParameter.__base__
"""click's UsageError: typer before 0.29 raises click's own, 0.29 on its vendored copy's."""


def usage_line(err: Any, argv: list[str]) -> str:
    """The one line for a UsageError from parsing `argv` (not a bare group's, whose error is its help)."""
    param, ctx = getattr(err, "param", None), getattr(err, "ctx", None)
    where = f"see `{ctx.command_path if ctx is not None else command_path(argv)} --help`"
    message = " ".join(str(err).split())
    opts = list(getattr(param, "opts", None) or [])
    if param is None or not opts:
        return f"{lower_first(message.rstrip('.'))}; {where}"
    if type(err).__name__ == "MissingParameter":
        argument = getattr(param, "param_type_name", "") == "argument"
        return f"{(getattr(param, 'metavar', None) or opts[0].upper()) if argument else opts[0]} is missing; {where}"
    value = given(argv, opts)
    shown = f"{value!r} " if value is not None else ""
    if "finite" in message:  # finite_float's own
        return f"{opts[0]}: {message}; {where}"
    if "integer" in message:
        return f"{opts[0]}: {shown}is not a whole number; {where}"
    if "float" in message or "number" in message:
        return f"{opts[0]}: {shown}is not a number; {where}"
    return f"{opts[0]}: {shown}{lower_first(message.rstrip('.'))}; {where}"


def given(argv: list[str], opts: list[str]) -> str | None:
    """The value the user gave `opts` on the command line (its last: the one parsed last)."""
    value = None
    for word, after in zip(argv, [*argv[1:], None]):
        if word in opts:
            value = after
        elif word.startswith("--") and "=" in word and word.split("=", 1)[0] in opts:
            value = word.split("=", 1)[1]
    return value


def command_path(argv: list[str]) -> str:
    """`raytrain` and the command words before the first option: where its help is."""
    words = []
    for word in argv[:2]:
        if word.startswith("-"):
            break
        words.append(word)
    return " ".join(["raytrain", *words])


def lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def finite_float(text: str) -> float:
    """A float option's parser that refuses nan and inf, which pass (and fail) every comparison."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value

"""docs/cli.md, the command-line reference, generated from the CLI itself (typer's click command tree):

    python -m raytrain_ddp.cli.reference docs/cli.md

Without a path it prints the page. tests/test_docs.py fails when docs/cli.md is not what this writes,
so a new flag or command is one edit in the code and one run of this.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import typer.main

from raytrain_ddp.cli import app


def the_cli() -> Any:
    """The `raytrain` command tree, as click sees it."""
    return typer.main.get_command(app)


def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf command under `group`, with its words after `raytrain`, in the order --help lists them."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def is_option(param: Any) -> bool:
    return param.opts[0].startswith("-")


def usage(words: tuple[str, ...], command: Any) -> str:
    parts = ["raytrain", *words, "[OPTIONS]"]
    for arg in (p for p in command.params if not is_option(p)):
        name = arg.metavar or arg.name.upper()
        if arg.nargs == -1 and not name.endswith("..."):
            name += "..."
        parts.append(name if arg.required or name.startswith("[") else f"[{name}]")
    return " ".join(parts)


def cell(text: str) -> str:
    """Help text as a Markdown table cell: one line."""
    return " ".join(text.split()).replace("|", "\\|")


def first_paragraph(command: Any) -> str:
    return cell(command.help.split("\n\n")[0])


def option_row(param: Any, ctx: Any) -> str:
    names = ", ".join(f"`{o}`" for o in param.opts)
    if param.secondary_opts:
        names += " / " + ", ".join(f"`{o}`" for o in param.secondary_opts)
    if param.is_flag:
        kind = ""
    elif param.metavar:
        kind = cell(param.metavar)
    elif hasattr(param, "display_type"):  # typer 0.2x, on its own copy of click
        kind = param.display_type(ctx).strip("<>").upper()
    else:  # typer on click itself
        kind = param.type.name.upper()
    help_text = param.help or ""  # a run option's field default is in it already (options.py)
    if param.show_default and param.default is not None and "[default:" not in help_text:
        if param.is_flag and param.secondary_opts:
            help_text += f" [default: {param.opts[0] if param.default else param.secondary_opts[0]}]"
        elif not param.is_flag:
            help_text += f" [default: {param.default}]"
    return f"| {names} | {kind} | {cell(help_text)} |"


HEADER = """# Command-line reference

Generated from the CLI (`raytrain_ddp/cli/`; `raytrain run`'s options are the fields of
`raytrain_ddp/config.py:TrainConfig`, their docstrings the help). Do not edit: after a change to a
command or option, regenerate it with

```bash
python -m raytrain_ddp.cli.reference docs/cli.md
```

`tests/test_docs.py` fails while this page is stale. Every command also takes `--help`.
"""


def section(words: tuple[str, ...], command: Any, run_rows: dict[str, Any]) -> list[str]:
    """One command's heading, help, usage, arguments and options. Options that a command shares
    with `raytrain run` (the commands that train take most of them) are named, not repeated."""
    ctx = typer.Context(command, info_name=" ".join(words))
    lines = ["", f"## raytrain {' '.join(words)}", "", command.help.strip(), "", "```", usage(words, command), "```", ""]
    arguments = [p for p in command.params if not is_option(p)]
    if arguments:
        lines += ["| argument | help |", "|---|---|"]
        lines += [f"| {cell(f'`{p.metavar or p.name.upper()}`')} | {cell(p.help or '')} |" for p in arguments]
        lines.append("")
    rows = [option_row(p, ctx) for p in command.params if is_option(p)]
    shared = [r for r in rows if r in run_rows] if words != ("run",) else []
    if len(shared) < 10:
        shared = []
    lines += ["| option | type | help |", "|---|---|---|", *(r for r in rows if r not in shared)]
    if shared:
        names = ", ".join(f"`{run_rows[r].opts[0]}`" for r in shared)
        lines += ["", f"And these options of [`raytrain run`](#raytrain-run), with the same meaning: {names}."]
    return lines


def render() -> str:
    """The whole page, as Markdown."""
    root = the_cli()
    leaves = list(commands(root))
    run = root.commands["run"]
    run_rows = {option_row(p, typer.Context(run)): p for p in run.params if is_option(p)}
    lines = [HEADER, root.help.strip(), ""]
    lines += [f"- [`raytrain {' '.join(words)}`](#{'-'.join(('raytrain', *words))}): {first_paragraph(command)}"
              for words, command in leaves]
    for words, command in leaves:
        lines += section(words, command, run_rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    page = render()
    if argv:
        Path(argv[0]).write_text(page)
    else:
        sys.stdout.write(page)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The docs cannot drift from the code: every `raytrain ...` command they show (and those in the
comments of the recipes and the sbatch) names real subcommands and options, every internal link
lands, and docs/cli.md is what the CLI generates.

The CLI's commands and options come from the typer app itself (its click command tree), never from a
list kept here. After a change to a command or option: python -m raytrain_ddp.cli.reference docs/cli.md
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import pytest

from raytrain_ddp.cli.reference import is_option, render, the_cli

REPO = Path(__file__).resolve().parents[1]
CLI_PAGE = REPO / "docs" / "cli.md"
PAGES = sorted({REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "slurm").rglob("*.md"),
                *(REPO / "cluster").rglob("*.md")})
HEADERS = sorted([*(REPO / "configs").glob("*.yaml"), REPO / "slurm" / "ray_cluster.sbatch"])
"""Files whose comments show the command that runs them."""
NOT_SHELL = {"python", "py", "yaml", "yml", "toml", "json", "dockerfile"}
"""Fenced blocks in these languages hold no shell commands (`from raytrain_ddp import ...`)."""
OPERATOR = re.compile(r"^[();<>|&]+$")
PREFIXES = {"env", "exec", "time", "nohup", "sudo", "then", "do", "else", "xargs"}
"""Words after which a shell command starts."""


# ---- reading the pages ------------------------------------------------------------------------


def fenced_blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, lang, first = opening.group(1), opening.group(2).lower(), i + 2  # line numbers count from 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        yield lang, first, body


def prose(text: str) -> str:
    """The page with its fenced blocks blanked out (line numbers hold)."""
    out, fence = [], None
    for line in text.splitlines():
        opening = re.match(r"^\s*(```+|~~~+)", line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append(line)
            continue
        out.append("")
    return "\n".join(out)


def logical_lines(body: list[str], start: int) -> Iterator[tuple[int, str]]:
    """Shell lines with their backslash continuations joined."""
    held, held_at = "", start
    for n, line in enumerate(body, start):
        if not held:
            held_at = n
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1] + " "
            continue
        yield held_at, held + line
        held = ""
    if held:
        yield held_at, held


def words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: a line of prose in a text block
        return line.split()


def raytrain_commands(line: str) -> Iterator[list[str]]:
    """The words after each `raytrain` (or `python -m raytrain_ddp`) that starts a command in `line`."""
    found = words(line)
    for i, word in enumerate(found):
        before = found[i - 1] if i else ""
        starts = (
            word == "raytrain" and (
                i == 0 or OPERATOR.match(before) or before in PREFIXES or before.endswith(".sbatch")
                or re.match(r"^[A-Za-z_]\w*=", before) or (i > 1 and found[i - 2] == "timeout"))
        ) or (word == "raytrain_ddp" and before == "-m")
        if starts:
            rest = found[i + 1:]
            end = next((j for j, w in enumerate(rest) if OPERATOR.match(w)), len(rest))
            yield rest[:end]


def shown_commands(page: Path) -> Iterator[tuple[int, list[str]]]:
    """Every `raytrain ...` command of a page: in its shell code blocks, and inline code that starts
    with `raytrain `."""
    text = page.read_text()
    for lang, start, body in fenced_blocks(text):
        if lang in NOT_SHELL:
            continue
        for n, line in logical_lines(body, start):
            for command in raytrain_commands(line):
                yield n, command
    for n, line in enumerate(prose(text).splitlines(), 1):
        for span in re.findall(r"`(raytrain [^`]+)`", line):
            for command in raytrain_commands(span.replace("\\|", "|")):
                yield n, command


def commented_commands(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Every `raytrain ...` command in a file's `#` comments."""
    comments = [re.sub(r"^#+ ?", "", line) if line.startswith("#") else "" for line in path.read_text().splitlines()]
    for n, line in logical_lines(comments, 1):
        for command in raytrain_commands(line):
            yield n, command


# ---- checking a command against the CLI -------------------------------------------------------


def command_problems(argv: list[str]) -> list[str]:
    """What in `raytrain <argv>` the CLI does not have: a subcommand, an option, an argument."""
    command, path, i = the_cli(), ["raytrain"], 0
    while hasattr(command, "commands"):  # a group: the next word is one of its commands
        if i == len(argv) or argv[i] in ("...", "--help"):
            return []
        if argv[i] not in command.commands:
            return [f"`{' '.join(path)}` has no command {argv[i]!r} (it has {', '.join(command.commands)})"]
        command = command.commands[argv[i]]
        path.append(argv[i])
        i += 1
    return option_problems(command, path, argv[i:])


def option_problems(command: Any, path: list[str], argv: list[str]) -> list[str]:
    options = {name: p for p in command.params if is_option(p) for name in (*p.opts, *p.secondary_opts)}
    takes_arguments = any(not is_option(p) for p in command.params)
    interspersed = command.context_settings.get("allow_interspersed_args", True)
    problems, i = [], 0
    while i < len(argv):
        word = argv[i].strip("[]")  # [--follow], [JOB_ID]: optional parts of a usage line
        i += 1
        if word in ("", "...") or re.match(r"^-\d", word):
            continue
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            if name == "--help":
                continue
            if name not in options:
                problems.append(f"`{' '.join(path)}` has no option {name}")
                i += i < len(argv) and not argv[i].startswith("-")  # its value, if it looks like one
                continue
            param = options[name]
            if not (param.is_flag or param.count or "=" in word):
                i += 1  # its value
            continue
        if not takes_arguments:
            problems.append(f"`{' '.join(path)}` takes no argument {word!r}")
        elif not interspersed:  # launch's script, or submit's `launch ...`: the rest is not ours
            if path[-1] == "submit" and word == "launch":
                launch = the_cli().commands["launch"]
                problems += option_problems(launch, [*path, "launch"], argv[i:])
            break
    return problems


# ---- links -------------------------------------------------------------------------------------


def anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    ids = set()
    for line in prose(page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def links(page: Path) -> Iterator[tuple[int, str]]:
    text = re.sub(r"`[^`\n]*`", "", prose(page.read_text()))  # a link inside inline code is not one
    for n, line in enumerate(text.splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"^[a-z]+:", target):
                yield n, target


def link_problem(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    where = (page.parent / path).resolve() if path else page
    if not where.exists():
        return f"{target}: no such file"
    if anchor and where.suffix == ".md" and anchor not in anchors(where):
        return f"{target}: {where.relative_to(REPO)} has no heading #{anchor}"
    return None


# ---- the tests ----------------------------------------------------------------------------------


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_the_checker_reads_commands_as_the_cli_does():
    assert command_problems(["run", "--workers", "2", "--gpu", "--epochs", "3"]) == []
    assert command_problems(["run", "--wrokers", "2"]) == ["`raytrain run` has no option --wrokers"]
    assert command_problems(["bench", "overhead", "--rounds", "3"]) == []
    assert command_problems(["tarin"])[0].startswith("`raytrain` has no command 'tarin'")
    # launch's options end at the script: the script's own flags are its business
    assert command_problems(["launch", "-w", "4", "train.py", "--lr", "0.1", "--anything"]) == []
    assert command_problems(["submit", "--address", "http://h:8265", "launch", "--bogus", "x.py"]) == [
        "`raytrain submit launch` has no option --bogus"]
    assert list(raytrain_commands('RAY_ADDRESS=h:6379 raytrain run --gpu >log 2>&1 && raytrain verify runs/x')) == [
        ["run", "--gpu"], ["verify", "runs/x"]]
    assert list(raytrain_commands("sbatch --job-name raytrain s.sbatch raytrain run")) == [["run"]]


@pytest.mark.parametrize("page", [p for p in PAGES if p != CLI_PAGE], ids=page_id)
def test_every_command_shown_is_one_the_cli_has(page):
    """docs/cli.md is left out: the CLI writes it (test_the_cli_reference_is_current)."""
    problems = [f"{page_id(page)}:{n}: raytrain {' '.join(argv)}\n    {problem}"
                for n, argv in shown_commands(page) for problem in command_problems(argv)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("path", HEADERS, ids=page_id)
def test_every_command_in_a_header_comment_is_one_the_cli_has(path):
    problems = [f"{page_id(path)}:{n}: raytrain {' '.join(argv)}\n    {problem}"
                for n, argv in commented_commands(path) for problem in command_problems(argv)]
    assert problems == [], "\n".join(problems)
    assert list(commented_commands(path)), "no `raytrain ...` command found in its comments"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_internal_links_land(page):
    problems = [f"{page_id(page)}:{n}: {problem}" for n, target in links(page)
                if (problem := link_problem(page, target))]
    assert problems == [], "\n".join(problems)


def test_the_pages_show_commands_at_all():
    """A checker that finds nothing passes everything: the front page alone shows a dozen."""
    assert len(list(shown_commands(REPO / "README.md"))) >= 10


def test_the_cli_reference_is_current():
    assert CLI_PAGE.read_text() == render(), (
        "docs/cli.md is stale; regenerate it: python -m raytrain_ddp.cli.reference docs/cli.md")


def test_every_help_prints_whole_in_80_columns():
    """Rich's tables cut `run`'s option names short at 80 columns (`--checkpoint-every…`), ate help
    text as markup (`pip install 'raytrain-ddp[mlflow]'`), and showed a default as `[default: (2)]`.
    Each command's --help, as a terminal of 80 columns gets it, holds every flag and help text whole."""
    from typer.testing import CliRunner

    from raytrain_ddp.cli import app
    from raytrain_ddp.cli.reference import commands, is_option

    runner = CliRunner()
    for words, command in commands(the_cli()):
        out = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "80", "TERM": "dumb"}).output
        assert max(map(len, out.splitlines())) <= 80, (words, out)
        flat = " ".join(re.sub(r"-\n +", "-", out).split())  # click wraps at hyphens too: all-|reduces
        for text in [command.help or ""] + [p.help or "" for p in command.params if getattr(p, "help", None)]:
            assert " ".join(text.split()) in flat, (words, text)
        for p in filter(is_option, command.params):
            for flag in [*p.opts, *p.secondary_opts]:
                assert flag in out.split() or f"{flag}," in out or f"{flag}/" in out, (words, flag)
        assert "[default: (" not in flat, (words, out)
    assert "[default: 2]" in " ".join(runner.invoke(app, ["run", "--help"]).output.split())

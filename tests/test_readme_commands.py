"""Every shell command in the README and the docs works in a fresh clone (issue 19).

The fenced `sh` blocks are extracted and each command is checked without needing a running stack:
the program exists where it is called from (`.venv/bin/...`, a script in the repository, a `make`
target; a bare `flexlb` or `python` is not on a fresh clone's PATH), every repository path it
names exists (the shipped traces included; output folders and runtime files excepted), and every
`flexlb` command line parses with that subcommand's real parser (options and values valid)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "data" / "traces" / "README.md"]
#: Tools a reader installs or already has; their commands are checked for paths only.
EXTERNAL = {"curl", "docker", "open", "prometheus", "export", "openssl", "git", "cd", "nice"}
#: Options whose value is something the command writes (need not exist beforehand).
WRITES = {"--output", "--log-dir", "--storage.tsdb.path", ">", ">>"}
#: Files that exist only while a stack runs.
RUNTIME = ("logs/",)
_PATH = re.compile(r"^(?:\./)?[A-Za-z0-9_.-]+/[A-Za-z0-9_./@-]*[A-Za-z0-9_-]$")


def _commands(text: str) -> list[str]:
    """Commands of the fenced sh blocks: continuation lines joined, heredoc bodies dropped,
    a quote left open (a multi-line `python -c '...'`) continued on the next line."""
    out = []
    for block in re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", text, flags=re.S | re.M):
        lines = block.splitlines()
        cur = ""
        heredoc = None
        for line in lines:
            if heredoc is not None:
                if line.strip() == heredoc:
                    heredoc = None
                continue
            m = re.search(r"<<-?'?(\w+)'?", line)
            if m:
                heredoc = m.group(1)
                line = line[: m.start()] + line[m.end() :]
            cur = f"{cur}\n{line}" if cur else line
            if cur.endswith("\\"):
                cur = cur[:-1]
                continue
            try:
                shlex.split(cur, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if cur.strip() and not cur.strip().startswith("#"):
                out.append(cur)
            cur = ""
        assert not cur, f"unterminated command: {cur!r}"
    return out


def _all_commands() -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), c) for doc in DOCS for c in _commands(doc.read_text())]


def _parse_flexlb(argv: list[str]) -> None:
    """Parse (never run) a `flexlb ...` command line with the subcommand's real parser."""
    sub, rest = argv[0], argv[1:]
    if sub in ("bench", "simulate"):
        from app.loadgen.cli import build_parser as bench_parser
        from app.sim.cli import build_parser as sim_parser

        parser = bench_parser() if sub == "bench" else sim_parser()
        try:
            parser.parse_args(rest)
        except SystemExit as exc:
            assert exc.code == 0, f"flexlb {shlex.join(argv)} does not parse"
        return
    from app.cli import app

    # typer vendors its own click: its errors are not `click.UsageError`, so they are told by name.
    group = typer.main.get_command(app)
    cmd = group.get_command(group.make_context("flexlb", [sub]), sub)  # type: ignore[attr-defined]
    assert cmd is not None, f"no subcommand {sub!r}"
    try:
        cmd.make_context(sub, rest)
    except Exception as exc:
        if type(exc).__name__ == "Exit" and getattr(exc, "exit_code", 1) == 0:
            return  # --help
        raise AssertionError(f"flexlb {shlex.join(argv)}: {exc}") from None


def _check(cmd: str) -> list[str]:
    problems = []
    words = shlex.split(cmd, comments=True)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return []
    prog, args = words[0], words[1:]
    if prog in ("flexlb", "python", "python3", "pip", "pytest", "ruff"):
        problems.append(f"`{prog}` is not on a fresh clone's PATH: write .venv/bin/{prog}")
    elif prog.startswith(".venv/bin/"):
        if not Path(sys.executable).with_name(prog.removeprefix(".venv/bin/")).exists():
            problems.append(f"{prog} is not installed by `make install`")
        if prog == ".venv/bin/flexlb":
            try:
                _parse_flexlb(args)
            except AssertionError as exc:
                problems.append(str(exc))
    elif prog == "make":
        targets = re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M)
        problems += [f"no make target {t!r}" for t in args if "=" not in t and t not in targets]
    elif "/" in prog:
        if not os.access(ROOT / prog, os.X_OK):
            problems.append(f"{prog} is not an executable file of the repository")
    elif prog not in EXTERNAL:
        problems.append(f"unknown program {prog!r} (add it to EXTERNAL if a reader has it)")
    previous = ""
    for word in args:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        named = previous not in WRITES and _PATH.match(value) and ":" not in value
        # A path that leaves the clone (../shared/...) may exist on a developer's machine, never in
        # a user's fresh clone: it counts as missing whatever this machine holds.
        outside = named and not (ROOT / value).resolve().is_relative_to(ROOT.resolve())
        if named and not value.startswith(RUNTIME) and (outside or not (ROOT / value).exists()):
            problems.append(f"names {value}, which is not in the repository")
        previous = word
    return problems


def test_the_docs_have_commands_to_check() -> None:
    cmds = _all_commands()
    assert len(cmds) >= 20, cmds
    assert any("data/traces/trace_30min.jsonl.gz" in c for _, c in cmds)


@pytest.mark.parametrize(("doc", "cmd"), _all_commands(), ids=lambda x: x.split("\n")[0][:60])
def test_every_documented_command_works_in_a_fresh_clone(doc: str, cmd: str) -> None:
    problems = _check(cmd)
    assert not problems, f"{doc}: {cmd}\n" + "\n".join(problems)


def test_the_checker_catches_what_a_fresh_clone_lacks() -> None:
    assert _check("python -c 'print(1)'")
    assert _check("flexlb simulate --trace data/traces/trace_30min.jsonl.gz")
    assert _check(".venv/bin/flexlb simulate --trace ../shared/traces/trace_30min.jsonl.gz")
    assert _check(".venv/bin/flexlb simulate --trace data/traces/trace_30min.jsonl.gz --no-such-option")
    assert _check(".venv/bin/flexlb worker --role prefill --grpc-port nine")
    assert _check("make no-such-target")
    assert not _check(".venv/bin/flexlb simulate --trace data/traces/trace_30min.jsonl.gz --output sim_out/x")

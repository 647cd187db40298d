"""One CLI style for every `flexlb` subcommand.

`worker`, `gateway`, `up` and `status` are typer commands; `bench` and `simulate` keep their
argparse parsers (mutually exclusive sources, argument groups, a `main(argv)` the tests and
scripts call). Users saw two styles: rich boxes that cut option names in a narrow terminal next
to argparse's `usage:`/`options:` blocks, and two error formats. Here argparse renders help,
usage and errors through click's own formatter, exactly as the typer commands do with rich
turned off: `Usage: flexlb X [OPTIONS]`, `Options:` with `<int>`-style metavars, `[default: …]`
and `[required]`, wrapped (never cut) to the terminal's width, and `Error: …` with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

import click

_METAVARS = {int: "<int>", float: "<float>", str: "<str>"}


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return "[" + "|".join(str(c) for c in action.choices) + "]"
    if action.metavar:
        return f"<{str(action.metavar).lower()}>"
    typ = action.type
    if typ in _METAVARS:
        return _METAVARS[typ]  # type: ignore[index]
    name = getattr(typ, "__name__", "")
    if "int" in name:
        return "<int>"
    if "float" in name:
        return "<float>"
    if "path" in name.lower() or name == "Path":
        return "<path>"
    return "<str>"


def _row(action: argparse.Action) -> tuple[str, str]:
    if isinstance(action, argparse._HelpAction):
        return ("--help", "Show this message and exit.")
    names = ", ".join(action.option_strings) or action.dest
    mv = _metavar(action)
    help_text = action.help or ""
    extras = []
    if action.required:
        extras.append("required")
    elif action.nargs != 0 and action.default not in (None, argparse.SUPPRESS) and "default" not in help_text:
        extras.append(f"default: {action.default}")
    if extras:
        help_text = f"{help_text}  [{'; '.join(extras)}]".strip()
    return (f"{names} {mv}".strip(), help_text)


class ClickStyleParser(argparse.ArgumentParser):
    """An ArgumentParser whose help, usage and errors look like the typer commands'."""

    def format_usage(self) -> str:
        f = click.HelpFormatter()
        f.write_usage(self.prog, "[OPTIONS]", prefix="Usage: ")
        return f.getvalue()

    def format_help(self) -> str:
        f = click.HelpFormatter()
        f.write_usage(self.prog, "[OPTIONS]", prefix="Usage: ")
        if self.description:
            f.write_paragraph()
            with f.indentation():
                f.write_text(self.description)
        for group in self._action_groups:
            actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
            # click lists --help last; -h still works
            actions.sort(key=lambda a: isinstance(a, argparse._HelpAction))
            rows = [_row(a) for a in actions]
            if not rows:
                continue
            title = "Options" if group.title in ("options", "optional arguments") else (group.title or "")
            with f.section(title[:1].upper() + title[1:]):
                f.write_dl(rows)
        if self.epilog:
            f.write_paragraph()
            f.write_text(self.epilog)
        return f.getvalue()

    def error(self, message: str) -> NoReturn:
        """click's `UsageError` layout: usage, how to get help, then the error; exit code 2."""
        sys.stderr.write(self.format_usage())
        sys.stderr.write(f"Try '{self.prog} --help' for help.\n\nError: {message}\n")
        raise SystemExit(2)

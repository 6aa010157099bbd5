"""MkDocs hooks: the CLI reference rendered from `fastjobs.cli`'s parser, and bench/RESULTS.md as a page.

Both are generated at build time from their one source, so neither can go stale.
"""

from __future__ import annotations

import argparse
import html
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
CLI_MARKER = "<!-- the parser of fastjobs.cli, rendered by docs/hooks.py -->"
RESULTS = ROOT / "bench" / "RESULTS.md"


def on_files(files: Files, config: Any) -> Files:
    """bench/RESULTS.md and the plots it shows, under performance/, as they are in the tree."""
    files.append(File.generated(config, "performance/results.md", content=RESULTS.read_text()))
    for image in sorted(RESULTS.parent.glob("*.png")):
        files.append(File.generated(config, f"performance/{image.name}", abs_src_path=str(image)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if CLI_MARKER not in markdown:
        return markdown
    from fastjobs.cli import command

    return markdown.replace(CLI_MARKER, "\n".join(_render(command._parser(), level=2)))


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """(help, parser) of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _cell(text: str) -> str:
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _render(parser: argparse.ArgumentParser, level: int, summary: str = "") -> list[str]:
    formatter = parser._get_formatter()
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if summary or parser.description:
        lines += [_cell(summary or parser.description or ""), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        if action.option_strings and action.default not in (None, False) and "default" not in text:
            text += f" (default {action.default})"
        rows.append(f"| `{formatter._format_action_invocation(action)}` | {_cell(text)} |")
    if rows:
        lines += ["| argument | meaning |", "| --- | --- |", *rows, ""]
    for help_text, sub in _subcommands(parser):
        lines += _render(sub, level + 1 if level < 4 else level, help_text)
    return lines

"""The `fastjobs` command: one module per command family, the parser and `main` in fastjobs.cli.command."""

from .command import main

__all__ = ["main"]

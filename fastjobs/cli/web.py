"""`fastjobs web`: the dashboard (fastjobs.web, the web extra), imported by this command only."""

from __future__ import annotations

import argparse

from .. import database, schema
from ..app import App
from ..errors import ConfigurationError
from .run import load_app

__all__ = ["add_web_arguments", "web_command"]


def add_web_arguments(web: argparse.ArgumentParser) -> None:
    """The options of `fastjobs web` (fastjobs.web.serve)."""
    web.add_argument(
        "module", nargs="?", help="module holding a fastjobs.App: its periodic jobs' schedules and its lanes"
    )
    web.add_argument("--host", default="127.0.0.1", help="address to serve (default %(default)s)")
    web.add_argument("--port", type=int, default=8087, help="port to serve (default %(default)s)")
    web.add_argument(
        "--auth",
        metavar="USER:PASSWORD",
        help="require HTTP basic credentials (default: $FASTJOBS_WEB_AUTH; $FASTJOBS_WEB_TOKEN, when set,"
        " is accepted as a bearer token); an address other than loopback needs one or the other",
    )
    web.add_argument("--read-only", action="store_true", help="hide and refuse every write")


def web_command(args: argparse.Namespace) -> int:
    try:
        from .. import web
    except ImportError as exc:
        raise ConfigurationError(
            f"fastjobs web needs the web extra: pip install 'fastjobs[web]' ({exc})"
        ) from None
    app = (
        load_app(args.module, args.dsn, args.schema)
        if args.module
        else App(database.resolve_dsn(args.dsn, fallback=True), schema=args.schema)
    )
    with database.connect(app.dsn, autocommit=True) as conn:
        schema.check(conn, app.sql)
    web.serve(app, args.host, args.port, auth=args.auth, read_only=args.read_only)
    return 0

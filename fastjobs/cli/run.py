"""`fastjobs run`: the application loaded, the settings checked, the master run until it stops."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable

from ..app import App
from ..children import EXIT_BOOT_ERROR
from ..errors import ConfigurationError
from ..heartbeat import host_id
from ..leader import LeaderConfig
from ..maintenance import RescuerConfig
from ..master import Master
from ..sharding import parse_queues, threaded_queues
from ..worker import WorkerConfig

__all__ = ["load_app", "run", "run_command"]

logger = logging.getLogger("fastjobs.cli")


def load_app(target: str, dsn: str | None = None, schema: str | None = None) -> App:
    """Import `module` or `module:attr` and return its App; a clear error otherwise.

    With `dsn` (`fastjobs --dsn`), the App is pointed at that database
    (`App.configure`), whatever its own DSN; with `schema` (`--schema`), at that schema.
    """
    module_name, _, attr = target.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        hint = ""
        if module_name.endswith(".py") or os.sep in module_name:  # `flask --app` takes a file; we do not
            dotted = module_name.removesuffix(".py").strip(os.sep).replace(os.sep, ".")
            hint = f" (name the module, as in an import: {dotted}, not its file)"
        raise ConfigurationError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{hint}") from exc
    if attr:
        app = getattr(module, attr, None)
        if not isinstance(app, App):
            raise ConfigurationError(f"{target!r} is not a fastjobs.App")
    else:
        apps = [v for v in vars(module).values() if isinstance(v, App)]
        if len(apps) != 1:
            raise ConfigurationError(
                f"module {module_name!r} holds {len(apps)} fastjobs.App instances;"
                f" name one as {module_name}:attribute"
            )
        app = apps[0]
    if dsn or schema:
        app.configure(dsn=dsn or None, schema=schema)
    return app


def run_command(args: argparse.Namespace) -> int:
    return run(args, lambda: load_app(args.module, args.dsn, args.schema))


def run(args: argparse.Namespace, load: Callable[[], App], queues: Iterable[str] = ()) -> int:
    """`fastjobs run` with the options of add_run_arguments: its settings checked, then the App
    loaded by `load`, then the master run until it stops. The workers serve `--queues`, else
    every queue of a registered job and `queues`."""
    host = host_id(args.host_id)  # the settings are checked before the application is imported
    worker = WorkerConfig(
        batch_max=args.batch_max,
        keep_completed=args.keep_completed,
        grace=args.grace,
        fast_lane=args.fast_lane,
    )
    leader = LeaderConfig(
        lock_key=args.leader_key, rescuer=RescuerConfig.after(args.rescue_after), lease=args.leader_lease
    )
    app = load()
    registered = sorted({spec.queue for spec in app.jobs.values()} | set(queues))
    queues = parse_queues(args.queues, registered, args.processes)
    metrics = (args.metrics_host, args.metrics_port) if args.metrics_port is not None else None
    master = Master(
        app,
        args.processes,
        queues,
        worker=worker,
        leader=leader,
        worker_timeout=args.worker_timeout,
        metrics=metrics,
        host=host,
        threaded=threaded_queues(args.queues),
    )
    code = master.run()
    if code != EXIT_BOOT_ERROR:  # what could not start says why, and nothing was stopped
        logger.info("stopped")
    return code

"""fastjobs: a PostgreSQL-backed background job queue built for throughput."""

import logging

from .app import App, Job
from .errors import (
    Cancel,
    ConfigurationError,
    DatabaseUnavailable,
    FastjobsError,
    InvalidArguments,
    JobNotFound,
    JobTimeout,
    LoopError,
    Retry,
    SchemaMissing,
    SchemaTooNew,
    Snooze,
    UnknownKind,
)
from .handlers import JobContext, current_job
from .middleware import Enqueue
from .retry import default_backoff
from .types import JobSpec, JobState
from .worker import Worker, WorkerConfig

# A library configures no output: its records reach nothing (not even logging's
# last-resort stderr) until the application configures logging (docs/operations/monitoring.md, Logging).
# No module logs at import, so this comes in time.
logging.getLogger("fastjobs").addHandler(logging.NullHandler())

__all__ = [
    "App",
    "Cancel",
    "ConfigurationError",
    "DatabaseUnavailable",
    "Enqueue",
    "FastjobsError",
    "InvalidArguments",
    "Job",
    "JobContext",
    "JobNotFound",
    "JobSpec",
    "JobState",
    "JobTimeout",
    "LoopError",
    "Retry",
    "SchemaMissing",
    "SchemaTooNew",
    "Snooze",
    "UnknownKind",
    "Worker",
    "WorkerConfig",
    "current_job",
    "default_backoff",
]

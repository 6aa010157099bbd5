"""fastjobs: a PostgreSQL-backed background job queue built for throughput."""

import logging as _logging
from types import ModuleType as _ModuleType

from .app import App, Job
from .errors import (
    Cancel,
    ConfigurationError,
    DatabaseUnavailable,
    FastjobsError,
    InvalidArguments,
    JobCancelled,
    JobFailed,
    JobNotFound,
    JobTimeout,
    LoopError,
    QueueFull,
    Retry,
    SchemaMissing,
    SchemaTooNew,
    Snooze,
    UnknownKind,
)
from .handlers import JobContext, current_job
from .middleware import Enqueue
from .queues import QueueInfo
from .results import JobHandle, JobStatus
from .retry import default_backoff
from .types import JobSpec, JobState
from .worker import Worker, WorkerConfig

# A library configures no output: its records reach nothing (not even logging's
# last-resort stderr) until the application configures logging (docs/operations/monitoring.md, Logging).
# No module logs at import, so this comes in time.
_logging.getLogger("fastjobs").addHandler(_logging.NullHandler())

__all__ = [
    "App",
    "Cancel",
    "ConfigurationError",
    "DatabaseUnavailable",
    "Enqueue",
    "FastjobsError",
    "InvalidArguments",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobFailed",
    "JobHandle",
    "JobNotFound",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobTimeout",
    "LoopError",
    "QueueFull",
    "QueueInfo",
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


def __dir__() -> list[str]:
    """The public names, and the submodules imported so far (fastjobs.testing, fastjobs.leader...)."""
    modules = (name for name, value in globals().items() if isinstance(value, _ModuleType) and name[0] != "_")
    return sorted({*__all__, *modules})

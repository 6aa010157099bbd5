"""fastjobs: a PostgreSQL-backed background job queue built for throughput."""

from .app import App, Job
from .errors import (
    Cancel,
    ConfigurationError,
    DatabaseUnavailable,
    FastjobsError,
    JobNotFound,
    JobTimeout,
    LoopError,
    Retry,
    SchemaMissing,
    SchemaTooNew,
    Snooze,
)
from .handlers import JobContext, current_job
from .retry import default_backoff
from .types import JobSpec, JobState
from .worker import Worker, WorkerConfig

__all__ = [
    "App",
    "Cancel",
    "ConfigurationError",
    "DatabaseUnavailable",
    "FastjobsError",
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
    "Worker",
    "WorkerConfig",
    "current_job",
    "default_backoff",
]

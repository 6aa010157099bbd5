"""fastjobs: a PostgreSQL-backed background job queue built for throughput."""

from .app import App, Job
from .errors import (
    Cancel,
    ConfigurationError,
    DatabaseUnavailable,
    FastjobsError,
    JobTimeout,
    Retry,
    SchemaMissing,
    Snooze,
)
from .retry import default_backoff
from .types import JobSpec, JobState
from .worker import Worker

__all__ = [
    "App",
    "Cancel",
    "ConfigurationError",
    "DatabaseUnavailable",
    "FastjobsError",
    "Job",
    "JobSpec",
    "JobState",
    "JobTimeout",
    "Retry",
    "SchemaMissing",
    "Snooze",
    "Worker",
    "default_backoff",
]

"""fastjobs: a PostgreSQL-backed background job queue built for throughput."""

from .app import App, Job
from .errors import ConfigurationError, DatabaseUnavailable, FastjobsError, SchemaMissing
from .types import JobSpec, JobState

__all__ = [
    "App",
    "ConfigurationError",
    "DatabaseUnavailable",
    "FastjobsError",
    "Job",
    "JobSpec",
    "JobState",
    "SchemaMissing",
]

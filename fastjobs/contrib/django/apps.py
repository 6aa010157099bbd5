"""The Django application `fastjobs.contrib.django`: the schema as a migration, `manage.py fastjobs_run`."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["FastjobsConfig"]


class FastjobsConfig(AppConfig):  # type: ignore[misc]  # django has no type information
    name = "fastjobs.contrib.django"
    label = "fastjobs"
    verbose_name = "fastjobs"

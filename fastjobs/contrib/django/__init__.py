"""Django Tasks (`fastjobs[django]`): fastjobs as the backend of `django.tasks`.

`TASKS = {"default": {"BACKEND": "fastjobs.contrib.django.FastjobsBackend"}}`.

Add "fastjobs.contrib.django" to INSTALLED_APPS as well: `manage.py migrate`
then installs fastjobs' schema, and `manage.py fastjobs_run` runs the workers.
docs/guides/django.md tells the whole of it.
"""

from __future__ import annotations

from .backend import FastjobsBackend

__all__ = ["FastjobsBackend"]

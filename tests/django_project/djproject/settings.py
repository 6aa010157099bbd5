"""A small Django project on fastjobs' task backend, for tests/test_django.py.

The database is FASTJOBS_DJANGO_DSN's (each test gets one of its own);
CONN_MAX_AGE and the backend's MAX_ATTEMPTS come from the environment too.
"""

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ.get("FASTJOBS_DJANGO_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"))

SECRET_KEY = "fastjobs-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "djproject.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["fastjobs.contrib.django", "shop"]
MIDDLEWARE: list[str] = []

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", "postgres"),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", "127.0.0.1"),
        "PORT": _db.get("port", "5432"),
        "CONN_MAX_AGE": int(os.environ.get("FASTJOBS_DJANGO_CONN_MAX_AGE", "0")),
        # Django's own sessions are counted by this name in pg_stat_activity.
        "OPTIONS": {"application_name": "fastjobs-django-test"},
    },
    # Not PostgreSQL: a task backend pointed at it refuses, saying so.
    "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
DATABASE_ROUTERS = ["djproject.routers.DefaultOnly"]

TASKS = {
    "default": {
        "BACKEND": "fastjobs.contrib.django.FastjobsBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"MAX_ATTEMPTS": int(os.environ.get("FASTJOBS_DJANGO_MAX_ATTEMPTS", "1"))},
    }
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"django.tasks": {"handlers": ["stderr"], "level": "WARNING"}},
}

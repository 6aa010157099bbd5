"""Build the Cython hot path against the system libpq (flags from pg_config)."""

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

# What to install for each missing piece, by the package managers users name most.
HINTS = {
    "compiler": "Debian/Ubuntu: apt-get install build-essential; Fedora/RHEL: dnf install gcc;"
    " Alpine: apk add build-base",
    "libpq": "Debian/Ubuntu: apt-get install libpq-dev; Fedora/RHEL: dnf install libpq-devel;"
    " Alpine: apk add postgresql-dev",
}


def pg_config(flag: str) -> str | None:
    try:
        return subprocess.check_output(["pg_config", flag], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def missing_pieces() -> list[str]:
    """What the build lacks, each with how to install it: checked before anything is compiled,
    so the error names the piece instead of a compiler's "libpq-fe.h: No such file" halfway
    through psycopg[c]'s build or ours (both compile against libpq)."""
    missing = []
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not compiler or shutil.which(compiler[0]) is None:
        missing.append(
            f"a C compiler (`{compiler[0] if compiler else 'cc'}` is not on PATH; {HINTS['compiler']})"
        )
    includedir = pg_config("--includedir")
    if includedir is None:
        missing.append(f"libpq's headers and pg_config (`pg_config` is not on PATH; {HINTS['libpq']})")
    elif not (Path(includedir) / "libpq-fe.h").is_file():
        missing.append(
            f"libpq's headers (no libpq-fe.h in {includedir}, pg_config's --includedir; {HINTS['libpq']})"
        )
    return missing


missing = missing_pieces()
if missing:
    raise SystemExit(
        "fastjobs cannot be built: it compiles a C extension against libpq, as psycopg[c] does, and"
        " this machine lacks " + "; and ".join(missing) + ". Install them and run pip again."
    )

debug = os.environ.get("FASTJOBS_DEBUG") == "1"
extension = Extension(
    "fastjobs._core",
    ["fastjobs/_core.pyx"],
    include_dirs=[pg_config("--includedir") or ""],
    library_dirs=[pg_config("--libdir") or ""],
    libraries=["pq"],
    define_macros=[("CYTHON_TRACE_NOGIL", "1")] if debug else [],
    extra_compile_args=["-O2"] if not debug else ["-O0", "-g"],
)

setup(
    ext_modules=cythonize(
        [extension],
        compiler_directives={"language_level": "3", "linetrace": debug, "boundscheck": debug},
    )
)

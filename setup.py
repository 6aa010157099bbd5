"""Build the Cython hot path against the system libpq (flags from pg_config)."""

import os
import subprocess

from Cython.Build import cythonize
from setuptools import Extension, setup


def pg_config(flag: str) -> str:
    try:
        return subprocess.check_output(["pg_config", flag], text=True).strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(
            f"fastjobs: `pg_config {flag}` failed ({exc}); install libpq's headers "
            "(Debian: apt-get install libpq-dev) so the C hot path can be built"
        ) from None


debug = os.environ.get("FASTJOBS_DEBUG") == "1"
extension = Extension(
    "fastjobs._core",
    ["fastjobs/_core.pyx"],
    include_dirs=[pg_config("--includedir")],
    library_dirs=[pg_config("--libdir")],
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

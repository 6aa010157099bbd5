"""The dashboard (the `web` extra): `fastjobs web`, or `asgi_app(app)` mounted in an ASGI application.

Server-rendered pages (Starlette, Jinja2) that read without JavaScript; the
vendored htmx (static/htmx.min.js, htmx.org 2.0.11, BSD0) refreshes them in
place. Importing fastjobs never imports this package.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .pages import asgi_app
from .security import Credentials, check_bind

if TYPE_CHECKING:
    from ..app import App

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "asgi_app", "serve"]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8087
# Where `fastjobs web` reads credentials, so they stay out of the process list.
AUTH_ENV = "FASTJOBS_WEB_AUTH"  # USER:PASSWORD, as --auth
TOKEN_ENV = "FASTJOBS_WEB_TOKEN"  # a bearer token


def serve(
    app: App,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    auth: str | None = None,
    read_only: bool = False,
) -> None:
    """Serve the dashboard of `app`'s database with uvicorn until interrupted.

    `auth` is USER:PASSWORD (else FASTJOBS_WEB_AUTH); FASTJOBS_WEB_TOKEN, when
    set, is accepted as a bearer token. An address other machines reach is
    refused without one of them (ConfigurationError).
    """
    import uvicorn

    basic_text = auth or os.environ.get(AUTH_ENV) or None
    token = os.environ.get(TOKEN_ENV) or None
    basic = Credentials.parse_basic(basic_text) if basic_text else None
    credentials = Credentials(basic, token) if basic or token else None
    check_bind(host, credentials)
    application = asgi_app(app, read_only=read_only, auth=basic, token=token)
    how = "read-only, " if read_only else ""
    how += "authentication required" if credentials else "no authentication (loopback only)"
    logger.info("dashboard on http://%s:%d/ (%s)", host if ":" not in host else f"[{host}]", port, how)
    uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False)

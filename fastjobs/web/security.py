"""Who may see and steer the dashboard: authentication, CSRF, the headers of every answer."""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import secrets
import socket
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigurationError

__all__ = [
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "HEADERS",
    "Credentials",
    "Guard",
    "check_bind",
    "csrf_ok",
    "csrf_token",
    "is_loopback",
]

CSRF_COOKIE = "fastjobs_csrf"
CSRF_FIELD = "csrf"
# No script but the vendored htmx, no inline script or style, no frame, no form posted elsewhere:
# text from a job that escaped its escaping still could not run.
HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
        b" form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request must present: basic credentials (user, password), a bearer token, or either."""

    basic: tuple[str, str] | None = None
    token: str | None = None

    @classmethod
    def parse_basic(cls, text: str) -> tuple[str, str]:
        """`user:password` (the --auth option, FASTJOBS_WEB_AUTH)."""
        user, sep, password = text.partition(":")
        if not sep or not user or not password:
            raise ConfigurationError("--auth takes USER:PASSWORD, both non-empty")
        return user, password

    def allows(self, authorization: str) -> bool:
        scheme, _, value = authorization.partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer" and self.token is not None:
            return hmac.compare_digest(value.strip().encode(), self.token.encode())
        if scheme == "basic" and self.basic is not None:
            try:
                user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            # Both compared, whatever the first gives: the time taken says nothing of which was wrong.
            ok_user = hmac.compare_digest(user.encode(), self.basic[0].encode())
            ok_password = hmac.compare_digest(password.encode(), self.basic[1].encode())
            return ok_user and ok_password
        return False


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, credentials: Credentials | None) -> None:
    """Refuse to serve an address other machines reach without authentication."""
    if credentials is None and not is_loopback(host):
        raise ConfigurationError(
            f"fastjobs web will not serve {host}, which other machines reach, without authentication:"
            " pass --auth USER:PASSWORD (or set FASTJOBS_WEB_AUTH), or set FASTJOBS_WEB_TOKEN for bearer"
            " tokens; or bind 127.0.0.1"
        )


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


def csrf_token(scope: Scope) -> str:
    """The request's CSRF token, which every form posts back (set by Guard)."""
    return str(scope["state"]["csrf"])


def csrf_ok(scope: Scope, posted: str | None) -> bool:
    """A write is allowed when its form carries the token of the cookie set on this browser (double
    submit; the cookie is SameSite=Strict and HttpOnly) and any Origin it names is this server."""
    origin = _header(scope, b"origin")
    host = _header(scope, b"host")
    if origin and origin != "null" and origin.split("://", 1)[-1] != host:
        return False
    if origin == "null":
        return False
    expected = scope["state"].get("csrf_cookie")
    return bool(posted and expected) and hmac.compare_digest(str(posted), str(expected))


class Guard:
    """ASGI middleware in front of every page: authentication (when configured), the CSRF cookie,
    and the security headers."""

    def __init__(self, app: ASGIApp, credentials: Credentials | None) -> None:
        self.app = app
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.credentials is not None and not self.credentials.allows(_header(scope, b"authorization")):
            await _unauthorized(send, self.credentials)
            return
        cookie = SimpleCookie()
        try:
            cookie.load(_header(scope, b"cookie"))
        except Exception:  # a malformed Cookie header is no cookie
            cookie = SimpleCookie()
        known = cookie[CSRF_COOKIE].value if CSRF_COOKIE in cookie else None
        if known is not None and not (
            16 <= len(known) <= 128 and known.replace("-", "").replace("_", "").isalnum()
        ):
            known = None
        token = known or secrets.token_urlsafe(32)
        state: dict[str, Any] = scope.setdefault("state", {})
        state["csrf"], state["csrf_cookie"] = token, known
        path = scope.get("root_path", "") or "/"

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + HEADERS
                if known is None:
                    value = f"{CSRF_COOKIE}={token}; Path={path}; HttpOnly; SameSite=Strict"
                    headers.append((b"set-cookie", value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _unauthorized(send: Send, credentials: Credentials) -> None:
    challenge = (
        b'Basic realm="fastjobs", charset="UTF-8"' if credentials.basic else b'Bearer realm="fastjobs"'
    )
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"www-authenticate", challenge),
                (b"content-type", b"text/plain; charset=utf-8"),
                *HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"authentication required\n"})

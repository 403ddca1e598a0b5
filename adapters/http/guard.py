"""Who may talk to the HTTP API: Host, Origin and Content-Type checks on every route.

A daemon on 127.0.0.1 is reachable from every page the user's browser opens. Three
checks keep those pages out, before authentication and before any route runs:

- Host must name loopback, the bound address or a configured name (`allowed_hosts`):
  a page that rebinds its own domain to 127.0.0.1 (DNS rebinding) still sends its own
  name, and gets a 421.
- Origin, which browsers send with cross-site requests, must be a loopback origin (any
  port: a web UI the user runs locally) or a configured one (`allowed_origins`); other
  origins get a 403. Requests without Origin (every non-browser client) pass.
- A POST body must be declared `application/json` (415 otherwise): the "simple" requests
  a page may send cross-site without asking first (text/plain, forms) never reach a route.

Allowed origins get CORS headers from Starlette's CORSMiddleware (see `cors_options`),
so a browser client they serve can call the API. Bound to a wildcard address (0.0.0.0,
::), the names clients use cannot be known: the Host check then needs `allowed_hosts`
to be set and is otherwise off, and an API key (required there by Settings) protects.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from starlette.datastructures import Headers

from adapters.http.body_limit import Refusal
from mtplxd.config import is_loopback

log = logging.getLogger("mtplxd.http")

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
LOOPBACK_ORIGIN = r"https?://(127\.0\.0\.1|localhost|\[::1\])(:\d+)?"
JSON_TYPES = ("application/json",)


def host_names(settings: Any) -> list[str]:
    """Host header names (without port) clients may use; empty: any (wildcard bind)."""
    configured = [h.lower() for h in settings.allowed_hosts]
    if settings.host in WILDCARD_HOSTS:
        return configured
    bound = settings.host.lower()
    bound = f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound
    names = list(LOOPBACK_NAMES) + configured
    return names if is_loopback(settings.host) or bound in names else names + [bound]


def cors_options(settings: Any) -> dict:
    """Starlette CORSMiddleware arguments: loopback and configured origins only."""
    return {
        "allow_origins": list(settings.allowed_origins),
        "allow_origin_regex": LOOPBACK_ORIGIN,
        "allow_methods": ["GET", "POST", "DELETE"],
        "allow_headers": ["*"],
        "expose_headers": ["mcp-session-id", "retry-after"],
    }


class HostOriginGuard:
    """ASGI middleware applying the three checks of the module docstring."""

    def __init__(self, app: Any, settings: Any, refuse: Refusal):
        self.app = app
        self.hosts = host_names(settings)
        self.origins = set(settings.allowed_origins)
        self.loopback_origin = re.compile(LOOPBACK_ORIGIN)
        self.refuse = refuse

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, code = refusal
        log.warning("refused %s %s: %s", scope["method"], scope["path"], message)
        await self.refuse(scope["path"], status, message, code)(scope, receive, send)

    def _check(self, scope: dict) -> tuple[int, str, str] | None:
        headers = Headers(scope=scope)
        host = _name(headers.get("host", ""))
        if self.hosts and host not in self.hosts:
            return (421, f"the Host header {host!r} is not a name of this daemon; allowed: "
                    f"{', '.join(self.hosts)} (the allowed_hosts setting adds names)", "misdirected_request")
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins and not self.loopback_origin.fullmatch(origin):
            return (403, f"requests from the web origin {origin!r} are not allowed (the allowed_origins "
                    "setting lists browser origins besides loopback ones)", "origin_not_allowed")
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type not in JSON_TYPES:
                return (415, f"send the body as Content-Type: application/json (got {media_type or 'none'!r})",
                        "unsupported_media_type")
        return None


def _name(host: str) -> str:
    """A Host header's name, without its port (IPv6 literals keep their brackets)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host

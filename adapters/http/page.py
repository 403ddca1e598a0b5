"""The daemon's own page: static files shipped in the package, served at `/`.

    GET /               adapters/http/page/index.html
    GET /page/{name}    its script and style sheet (a fixed list: nothing else is served)

Nothing to build: plain HTML, CSS and JavaScript, the plots drawn on canvas. The files
are open without the API key (a browser cannot send a header when it navigates); the
page, told by a meta tag whether the daemon has one, asks for the key before its first
call and sends it on every call it makes. The Content-Security-
Policy allows this origin only, so the page works offline and loads nothing from
elsewhere.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PAGE_PREFIX = "/page/"
FILES = {"index.html": "text/html", "page.js": "text/javascript", "page.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a daemon upgraded in place serves its new page at once
}


def is_page_path(path: str) -> bool:
    """A path of the page itself (open without the API key)."""
    return path == "/" or (path.startswith(PAGE_PREFIX) and path[len(PAGE_PREFIX):] in FILES)


def page_routes(api_key_set: bool) -> list[Route]:
    async def index(request: Request) -> Response:
        body = _read("index.html").replace(b"__AUTH__", b"key" if api_key_set else b"none")
        return Response(body, media_type=FILES["index.html"], headers=HEADERS)

    return [Route("/", index, methods=["GET"]), Route(PAGE_PREFIX + "{name}", _file, methods=["GET"])]


async def _file(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES:
        return Response("not found", status_code=404, media_type="text/plain")
    return Response(_read(name), media_type=FILES[name], headers=HEADERS)


def _read(name: str) -> bytes:
    return resources.files("adapters.http").joinpath("page", name).read_bytes()

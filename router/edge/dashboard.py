"""``GET /dashboard``: the live operator page (DESIGN.md "Gateway HTTP").

One self-contained HTML file, ``router/edge/static/dashboard.html`` (package data): inline CSS and
JavaScript, charts drawn as inline SVG, nothing fetched from anywhere but the gateway itself. The
page holds no data, so loading it needs no token. It asks the operator for the admin token once,
keeps it in the tab's ``sessionStorage`` and polls the admin API with ``Authorization: Bearer``
every second:

| call | shown |
|---|---|
| ``GET /admin/workers`` | per worker: health, draining, role, in flight, engine running/waiting, KV cache usage, prefill left, evidence |
| ``GET /admin/index`` | blocks per tier (gpu, cpu, ssd) and speculative; KV-event seq, last event age, gaps, replays, resyncs |
| ``GET /admin/summary`` | prefix-hit rate (predicted and actual) and cached tokens over the last 5 minutes, decisions by reason |
| ``GET /admin/decisions?limit=20`` | the last routing decisions, newest first, with each candidate's matched blocks, load and cost |
| ``GET /admin/policy`` | the policy's name in the header |
| ``POST /admin/explain`` | the explain box: a pasted chat or completions body, its decision and candidates |

A 401 clears the kept token and asks again, saying why. Every string from the gateway goes into
the page as text (``textContent``, text nodes, attribute values), never parsed as HTML. The page
is also served with a Content-Security-Policy that lets run only its own inline script and style
(named by their SHA-256) and lets it talk only to its own origin, so a hostile string (a client
chooses its request ids) could neither run nor send anything elsewhere.
"""
from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse

PAGE_RESOURCE = ("router.edge", "static/dashboard.html")
_INLINE = {kind: re.compile(rb"<%s>(.*?)</%s>" % (kind, kind), re.DOTALL) for kind in (b"script", b"style")}


def load_page() -> bytes:
    """The dashboard's HTML as shipped in the package (UTF-8 bytes). Raises ``FileNotFoundError``
    when the package was installed without its data files."""
    package, path = PAGE_RESOURCE
    return resources.files(package).joinpath(path).read_bytes()


def content_security_policy(page: bytes) -> str:
    """The ``Content-Security-Policy`` value for ``page``: scripts and styles only its own inline
    ``<script>`` and ``<style>`` blocks (attribute-less tags, matched by SHA-256), requests only to
    the page's own origin, images only ``data:`` URLs, no frames, forms, plugins or base URL."""
    sources: dict[bytes, list[str]] = {}
    for kind, pattern in _INLINE.items():
        hashes = [base64.b64encode(hashlib.sha256(body).digest()).decode("ascii") for body in pattern.findall(page)]
        sources[kind] = [f"'sha256-{h}'" for h in hashes] or ["'none'"]
    return "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(sources[b"script"]),
        "style-src " + " ".join(sources[b"style"]),
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])


def make_dashboard_router() -> APIRouter:
    """``GET /dashboard``: the page (``text/html``, 200, no token needed) with its CSP, no caching
    (a new gateway version serves its new page at once) and no referrer. The page is read once,
    here, so a missing data file fails at start, not at the first visit."""
    page = load_page()
    headers = {
        "Content-Security-Policy": content_security_policy(page),
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    router = APIRouter()

    @router.get("/dashboard", response_class=HTMLResponse, tags=["operator"],
                summary="The live operator dashboard (an HTML page; its data comes from /admin with the admin token)")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    return router

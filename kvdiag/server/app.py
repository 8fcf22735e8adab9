"""The exporter's HTTP surface: /metrics, /probe, the JSON API, health, and the landing page.

``/metrics`` and ``/probe`` are for Prometheus and stay open (like every exporter); the JSON
API under ``/api/v1/`` carries evidence and remedies and takes a bearer token when one is
configured. ``/probe`` follows the multi-target exporter pattern: Prometheus discovers the
engines and passes each as ``?target=``; kvdiag fetches only what the allowlist permits, on
probe workers of its own (the endpoint is async and only awaits them), so probes never take
the threads that answer /healthz, /metrics and the API. Each target is rendered on its own:
one whose data kvdiag cannot render is answered as that target's error, the others as usual.
The OpenAPI docs (/docs) are served with Swagger UI's files from the installed
``swagger-ui-bundle`` package, so they work without Internet access.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from typing import Any, Awaitable, Callable

import swagger_ui_bundle
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder

from kvdiag import __version__, checks
from kvdiag.config import Config
from kvdiag.engines import ADAPTERS
from kvdiag.excerpt import excerpt
from kvdiag.model import NUMERIC_FIELDS, Diagnosis
from kvdiag.report.json import diagnosis_json, dumps
from kvdiag.report.samples import sample_json
from kvdiag.server.collector import ExporterCollector
from kvdiag.server.loop import ProbeBusy, ScrapeLoop
from kvdiag.server.page import landing_page
from kvdiag.server.probe import ProbeInvalid, ProbeRefused
from kvdiag.server.settings import is_loopback
from kvdiag.server.state import TargetState, fresh_instances, internal_error

#: Where the Swagger UI files are served from (the installed package's copy, not a CDN).
DOCS_ASSETS = "/docs-assets"
#: Prometheus sends its scrape timeout with every scrape; a probe answers within it.
SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"
#: Seconds kept back from Prometheus' timeout for rendering and the way back (as the
#: blackbox exporter's scrape_timeout_offset does).
SCRAPE_TIMEOUT_OFFSET = 0.5


class SafeJSONResponse(JSONResponse):
    """JSON without NaN/Infinity (which strict parsers and browsers reject): they become null."""

    def render(self, content: Any) -> bytes:
        return dumps(content, separators=(",", ":")).encode("utf-8")


def create_app(loop: ScrapeLoop) -> FastAPI:
    """The FastAPI app over a (started or not) scrape loop."""
    settings = loop.settings
    app = FastAPI(
        title="kvdiag",
        version=__version__,
        description="Is the GPU KV pool (L1) what caps concurrency and drives P99 TTFT? "
        "Verdicts with evidence for every scraped SGLang / vLLM instance.",
        default_response_class=SafeJSONResponse,
        docs_url=None,
        redoc_url=None,
    )
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="kvdiag API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )

    if is_loopback(settings.host) and settings.api_token is None:

        @app.middleware("http")
        async def loopback_host_only(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            host = request.headers.get("host")
            if host is not None and not loopback_host(host):
                return SafeJSONResponse({"detail": rebinding_refusal(host)}, status_code=403)
            return await call_next(request)

    bearer = HTTPBearer(auto_error=False, description="the api_bearer_token of the kvdiag config")

    def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        token = settings.api_token
        if token is None:
            return
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    metrics_registry = CollectorRegistry(auto_describe=False)
    metrics_registry.register(ExporterCollector(loop.snapshot, settings.checks))
    metrics_registry.register(ProcessCollector(registry=None))

    def exposition(registry: CollectorRegistry, request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(landing_page(api_token_required=settings.api_token is not None))

    @app.get("/metrics", response_class=Response, summary="kvdiag_* series for every configured target (Prometheus exposition)")
    def metrics(request: Request) -> Response:
        return exposition(metrics_registry, request)

    @app.get("/probe", response_class=Response, summary="scrape one allowlisted target now and return its kvdiag_* series")
    async def probe(request: Request, target: str = Query(..., description="engine URL or host:port"), engine: str = Query("auto", description="auto, sglang or vllm")) -> Response:
        if engine != "auto" and engine not in ADAPTERS:
            raise HTTPException(400, f"engine must be auto or one of {', '.join(sorted(ADAPTERS))}")
        try:
            future = loop.submit_probe(target, engine, prometheus_budget(request.headers.get(SCRAPE_TIMEOUT_HEADER)))
        except ProbeBusy as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None
        try:
            state = await asyncio.wait_for(asyncio.wrap_future(future), timeout=loop.probe_deadline + 1.0)
        except ProbeInvalid as exc:
            raise HTTPException(400, f"bad target: {exc}") from None
        except ProbeRefused as exc:
            raise HTTPException(403, f"target refused: {exc}") from None
        except asyncio.TimeoutError:
            raise HTTPException(504, f"the probe did not finish within {loop.probe_deadline:g}s") from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ExporterCollector(lambda: [state], settings.checks, build_info=False))
        return exposition(registry, request)

    @app.get("/api/v1/instances", dependencies=[Depends(authorized)], summary="every instance: health, verdict, newest normalized sample")
    def instances() -> dict:
        now = time.time()
        out: list[dict] = []
        for source, states in (("config", loop.snapshot()), ("probe", loop.snapshot(probes=True))):
            for state in states:
                out.extend(contained(state, lambda st: _instance_rows(st, source, settings.checks, now), lambda reason: [_error_row(state, source, reason)]))
        return {"instances": out, "window_seconds": settings.checks.window, "interval_seconds": settings.scrape.interval}

    @app.get("/api/v1/verdicts", dependencies=[Depends(authorized)], summary="the `kvdiag diagnose --json` report for every instance (configured and probed)")
    def verdicts() -> dict:
        now = time.time()
        diagnoses: list[Diagnosis] = []
        rendered: list[dict] = []
        for state in loop.snapshot() + loop.snapshot(probes=True):
            def render(st: TargetState) -> list[tuple[Diagnosis, dict]]:
                return [(d, diagnosis_json(d)) for d in _diagnoses(st, settings.checks, now)]

            def failed(reason: str) -> list[tuple[Diagnosis, dict]]:
                d = checks.undiagnosable(state.url, reason, now)
                return [(d, diagnosis_json(d))]

            for d, row in contained(state, render, failed):
                diagnoses.append(d)
                rendered.append(row)
        return {"instances": rendered, "exit_code": checks.exit_code(diagnoses)}

    @app.get("/api/v1/instances/{instance:path}/series", dependencies=[Depends(authorized)], summary="one instance's window: every normalized field per scrape")
    def series(instance: str, fields: str | None = Query(None, description="comma-separated PoolSample fields (default: all)")) -> dict:
        wanted = [f for f in fields.split(",") if f] if fields else list(NUMERIC_FIELDS)
        unknown = [f for f in wanted if f not in NUMERIC_FIELDS]
        if unknown:
            raise HTTPException(400, f"unknown field {unknown[0]!r}; known: {', '.join(NUMERIC_FIELDS)}")
        for state in loop.snapshot() + loop.snapshot(probes=True):
            inst = state.instances.get(instance)
            if inst is not None:
                ts, values = inst.ring.series(wanted)
                return {
                    "instance": instance,
                    "window_seconds": settings.checks.window,
                    "ts": ts.tolist(),
                    "series": {f: v.tolist() for f, v in values.items()},
                }
        raise HTTPException(404, f"no instance {instance!r}")

    @app.get("/healthz", summary="200 while the scrape loop runs")
    async def healthz() -> JSONResponse:  # async: answered on the event loop, never queued behind work
        ok = loop.alive
        return SafeJSONResponse({"status": "ok" if ok else "scrape loop stopped"}, status_code=200 if ok else 503)

    @app.get("/readyz", summary="200 once every configured target has been scraped once")
    def readyz() -> JSONResponse:
        ok = loop.alive and loop.ready
        return SafeJSONResponse({"status": "ready" if ok else "not ready", "targets": len(loop.targets)}, status_code=200 if ok else 503)

    return app


def loopback_host(header: str) -> bool:
    """A ``Host`` header that names this machine: localhost or a loopback address, any port.

    An exporter bound to loopback without an API token trusts that only this machine can reach
    it; a web page the operator opens can still reach it by a name of its own that resolves to
    127.0.0.1 (DNS rebinding), and its requests carry that name. Refusing any other Host keeps
    such a page from reading the API or driving /probe."""
    name, port = header.strip(), ""
    if name.startswith("[") and "]" in name:
        name, rest = name[1:].split("]", 1)
        if rest and not rest.startswith(":"):
            return False
        port = rest[1:]
    elif name.count(":") == 1:
        name, port = name.split(":")
    if port and not port.isdigit():
        return False
    return is_loopback(name.lower().rstrip("."))


def rebinding_refusal(header: str) -> str:
    return (
        f"Host {excerpt(header, 60)} is not this machine: an exporter on loopback without an API token answers "
        "only to localhost or a loopback address (DNS rebinding guard); set api_bearer_token_file to serve it under another name"
    )


def prometheus_budget(header: str | None) -> float | None:
    """The scrape deadline Prometheus' timeout header leaves (None: absent or unreadable)."""
    try:
        seconds = float(header) if header is not None else math.nan
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    return max(seconds - SCRAPE_TIMEOUT_OFFSET, seconds / 2)


def contained(state: TargetState, render: Callable[[TargetState], list], failed: Callable[[str], list]) -> list:
    """``render(state)``, or ``failed(reason)`` when rendering this one target raises: one
    target's data that kvdiag cannot render answers as that target's error, not a 500."""
    try:
        return render(state)
    except Exception as exc:
        return failed(internal_error(state, "rendering the API answer", exc))


def _diagnoses(state: TargetState, config: Config, now: float) -> list[Diagnosis]:
    """The target's current answers: its fresh instances', else why it has none (a KV tier's
    own exporter that an engine instance joined answers through that instance)."""
    fresh = fresh_instances(state, config, now)
    found = [i.diagnosis for i in fresh if i.diagnosis is not None and not i.joined(now)]
    if not fresh and state.failure is not None:
        found.append(state.failure)
    return found


def _base_row(state: TargetState, source: str) -> dict:
    return {
        "target": state.url,
        "source": source,
        "labels": state.target.label_dict,
        "up": state.up,
        "error": state.error,
        "last_scrape": state.last_scrape,
        "scrape_duration_seconds": state.duration,
    }


def _error_row(state: TargetState, source: str, reason: str) -> dict:
    return {**_base_row(state, source), "up": False, "error": reason, "instance": state.url, "verdict": "unknown", "severity": "warning", "reason": reason, "latest": None}


def _instance_rows(state: TargetState, source: str, config: Config, now: float) -> list[dict]:
    """The API rows of one target: one per fresh instance, or one for the target itself."""
    base = _base_row(state, source)
    fresh = fresh_instances(state, config, now)
    if not fresh:
        if state.last_scrape is None:
            return [{**base, "instance": state.url, "verdict": None, "severity": None, "reason": "not scraped yet", "latest": None}]
        reason = state.failure.verdict.reason if state.failure else state.error
        return [{**base, "instance": state.url, "verdict": "unknown", "severity": "warning", "reason": reason, "latest": None}]
    rows = []
    for inst in fresh:
        joined = inst.joined_to if inst.joined(now) else None  # a KV tier's exporter, shown through its engine
        d = None if joined else inst.diagnosis
        latest = sample_json(inst.latest) if inst.latest is not None else None
        if latest is not None:
            latest["evictions_total_corrected"] = inst.evictions_total
        reason = d.verdict.reason if d else f"joined to instance {joined}: its figures are on that instance's verdict" if joined else "not evaluated yet"
        rows.append(
            {
                **base,
                "instance": inst.key,
                "samples": len(inst.ring),
                "verdict": d.verdict.name if d else None,
                "severity": d.verdict.severity if d else None,
                "reason": reason,
                "joined_to": joined,
                "ttft_p99_seconds": inst.ttft_p99,
                "latest": latest,
            }
        )
    return rows

"""The exporter's HTTP surface: /metrics, /probe, the JSON API, health, and the landing page.

``/metrics`` and ``/probe`` are for Prometheus and stay open (like every exporter); the JSON
API under ``/api/v1/`` carries evidence and remedies and takes a bearer token when one is
configured. ``/probe`` follows the multi-target exporter pattern: Prometheus discovers the
engines and passes each as ``?target=``; kvdiag fetches only what the allowlist permits.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder

from kvdiag import __version__, checks
from kvdiag.commands.inspect import sample_json
from kvdiag.config import Config
from kvdiag.engines import ADAPTERS
from kvdiag.model import NUMERIC_FIELDS
from kvdiag.report.json import dumps, report_json
from kvdiag.server.collector import ExporterCollector
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.page import landing_page
from kvdiag.server.probe import ProbeRefused
from kvdiag.server.state import TargetState, fresh_instances


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
    )
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
    def probe(request: Request, target: str = Query(..., description="engine URL or host:port"), engine: str = Query("auto", description="auto, sglang or vllm")) -> Response:
        if engine != "auto" and engine not in ADAPTERS:
            raise HTTPException(400, f"engine must be auto or one of {', '.join(sorted(ADAPTERS))}")
        try:
            url = settings.probe.check(target)
        except ProbeRefused as exc:
            raise HTTPException(403, f"target refused: {exc}") from None
        state = loop.probe(url, engine)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ExporterCollector(lambda: [state], settings.checks, build_info=False))
        return exposition(registry, request)

    @app.get("/api/v1/instances", dependencies=[Depends(authorized)], summary="every instance: health, verdict, newest normalized sample")
    def instances() -> dict:
        now = time.time()
        out: list[dict] = []
        for source, states in (("config", loop.snapshot()), ("probe", loop.snapshot(probes=True))):
            for state in states:
                out.extend(_instance_rows(state, source, settings.checks, now))
        return {"instances": out, "window_seconds": settings.checks.window, "interval_seconds": settings.scrape.interval}

    @app.get("/api/v1/verdicts", dependencies=[Depends(authorized)], summary="the `kvdiag diagnose --json` report for every instance (configured and probed)")
    def verdicts() -> dict:
        now = time.time()
        diagnoses = []
        for state in loop.snapshot() + loop.snapshot(probes=True):
            fresh = fresh_instances(state, settings.checks, now)
            diagnoses += [i.diagnosis for i in fresh if i.diagnosis is not None]
            if not fresh and state.failure is not None:
                diagnoses.append(state.failure)
        return report_json(diagnoses, checks.exit_code(diagnoses))

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
    def healthz() -> JSONResponse:
        ok = loop.alive
        return SafeJSONResponse({"status": "ok" if ok else "scrape loop stopped"}, status_code=200 if ok else 503)

    @app.get("/readyz", summary="200 once every configured target has been scraped once")
    def readyz() -> JSONResponse:
        ok = loop.alive and loop.ready
        return SafeJSONResponse({"status": "ready" if ok else "not ready", "targets": len(loop.targets)}, status_code=200 if ok else 503)

    return app


def _instance_rows(state: TargetState, source: str, config: Config, now: float) -> list[dict]:
    """The API rows of one target: one per fresh instance, or one for the target itself."""
    base = {
        "target": state.url,
        "source": source,
        "labels": state.target.label_dict,
        "up": state.up,
        "error": state.error,
        "last_scrape": state.last_scrape,
        "scrape_duration_seconds": state.duration,
    }
    fresh = fresh_instances(state, config, now)
    if not fresh:
        if state.last_scrape is None:
            return [{**base, "instance": state.url, "verdict": None, "severity": None, "reason": "not scraped yet", "latest": None}]
        reason = state.failure.verdict.reason if state.failure else state.error
        return [{**base, "instance": state.url, "verdict": "unknown", "severity": "warning", "reason": reason, "latest": None}]
    rows = []
    for inst in fresh:
        d = inst.diagnosis
        latest = sample_json(inst.latest) if inst.latest is not None else None
        if latest is not None:
            latest["evictions_total_corrected"] = inst.evictions_total
        rows.append(
            {
                **base,
                "instance": inst.key,
                "samples": len(inst.ring),
                "verdict": d.verdict.name if d else None,
                "severity": d.verdict.severity if d else None,
                "reason": d.verdict.reason if d else "not evaluated yet",
                "ttft_p99_seconds": inst.ttft_p99,
                "latest": latest,
            }
        )
    return rows

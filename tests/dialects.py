"""Wire forms of one exposition, written by prometheus_client itself (the engines' library).

An engine answers in whatever form the scraper negotiates: text 0.0.4 or OpenMetrics, and,
since prometheus_client 0.23, an ``escaping=`` scheme (Prometheus 3 asks for one). Tests
re-expose a real fixture in every such form through prometheus_client's own writers, so the
spellings are the library's, not ours.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

ESCAPINGS = ("underscores", "dots", "values", "allow-utf-8")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def reexpose(text: str, escaping: str, openmetrics: bool) -> tuple[str, str | None]:
    """(body, content type) of a 0.0.4 ``text`` written again in one wire form."""
    families = list(text_string_to_metric_families(text))

    class Fixed:
        def collect(self):  # noqa: ANN202 (prometheus_client collector API)
            return families

    registry = CollectorRegistry()
    registry.register(Fixed())
    if openmetrics:
        return generate_openmetrics(registry, escaping=escaping).decode(), f"{OPENMETRICS}; escaping={escaping}"
    return generate_latest(registry, escaping=escaping).decode(), f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}"

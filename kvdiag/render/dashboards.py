"""Grafana (>= 10) dashboards, rendered from the recorded series and the checklist's config.

Two dashboards: "KV pool overview" (the fleet) and "KV pool instance" (one instance, linked
from every alert's ``dashboard_url``). Panels are data (``Panel``/``Query``) laid out on a
24-column grid in order; queries read the ``instance:kvdiag_*`` series of ``rules/``, so the
dashboards work on engine metrics alone, and the verdict/check panels add the exporter's
``kvdiag_verdict`` / ``kvdiag_check_status`` series when the exporter is scraped too. The
queue-by-reason and pools-by-kind panels show what the checks add up (every queue of a PD role
by what it waits for, each pool of a hybrid model) from the rules' ``instance:kvdiag_queue:requests``
and ``instance:kvdiag_kv_pool_usage:ratio``, labelled as the exporter's ``kvdiag_queue_requests``
and ``kvdiag_kv_pool_usage_ratio``. Thresholds drawn on panels (the saturation line, the TTFT SLO) come from ``Config``. The JSON
is deterministic: sorted keys, ids and ``refId`` by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvdiag.config import Config
from kvdiag.render.normalize import series_name
from kvdiag.render.promql import CHECK_STATUS, INSTANCE_INFO, Labels
from kvdiag.report.json import dumps

OVERVIEW_UID = "kvdiag-overview"
OVERVIEW_SLUG = "kv-pool-overview"
INSTANCE_UID = "kvdiag-instance"
INSTANCE_SLUG = "kv-pool-instance"
SCHEMA_VERSION = 39  # Grafana 10.3 - 11.x

DS = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | table | state-timeline | heatmap
    queries: tuple[Query, ...]
    description: str
    unit: str = "short"
    width: int = 12
    height: int = 8
    thresholds: tuple[tuple[float, str], ...] = ()  # (value, color) drawn as lines/colors
    stacked: bool = False
    max: float | None = None


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = field(default=("job", "instance", "model"))


def _names(config: Config) -> dict[str, str]:
    w = config.promql_params()["window"]
    t = lambda n: series_name(n, config)  # noqa: E731
    return {
        "usage": t("instance:kvdiag_kv_usage:ratio"),
        "admission": t("instance:kvdiag_kv_admission_usage:ratio{window}"),
        "waiting": t("instance:kvdiag_waiting:requests"),
        "running": t("instance:kvdiag_running:requests"),
        "evictions": t("instance:kvdiag_evictions:rate{window}"),
        "ttft": t("instance:kvdiag_ttft_seconds:p99_{window}"),
        "hit": t("instance:kvdiag_prefix_hit:ratio{window}"),
        "l2_usage": t("instance:kvdiag_l2_usage:ratio"),
        "l2_hit": t("instance:kvdiag_l2_hit:share{window}"),
        "l2_load": t("instance:kvdiag_l2_load_bytes:rate{window}"),
        "l2_store": t("instance:kvdiag_l2_store_bytes:rate{window}"),
        "capacity": "instance:kvdiag_kv_capacity:tokens",
        "pool": "instance:kvdiag_kv_pool:tokens",
        "queues": "instance:kvdiag_queue:requests",
        "pools": "instance:kvdiag_kv_pool_usage:ratio",
        "ceiling": f"instance:kvdiag_concurrency_ceiling:requests{w}",
    }


def _matchers(lbl: Labels) -> str:
    """The dashboard variables as label matchers."""
    return f'{lbl.target[0]}=~"$job", {lbl.target[-1]}=~"$instance", {lbl.model}=~"$model"'


def _sel(lbl: Labels, extra: str = "") -> str:
    """The dashboard variables as matchers on the recorded series."""
    return "{" + _matchers(lbl) + (", " + extra if extra else "") + "}"


def _legend(lbl: Labels) -> str:
    return "{{" + lbl.target[-1] + "}}" + "".join(f"{{{{{s}}}}}" for s in lbl.split)


#: Instances listed in the overview's worst-k tables.
WORST = 10
#: The admission usage buckets of the overview's heatmap (upper bounds).
HEAT_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)


def picked(lbl: Labels) -> str:
    """A condition that holds only where instances are picked (not "All"): Grafana writes the
    variable's text into the query, and "All" is its ``allValue`` ``.*``. Per-instance series
    are drawn only then, so a fleet of thousands never sends one series per instance."""
    var = f"${lbl.target[-1]}"
    return f'and on () (label_replace(vector(1), "picked", "{var}", "", "") unless on (picked) label_replace(vector(1), "picked", ".*", "", ""))'


def _heatmap(series: str) -> str:
    """Instances per admission usage bucket (cumulative ``le``, Grafana's heatmap format)."""
    return "\nor ".join(f'label_replace(count({series} <= {b:g}) or vector(0), "le", "{b:g}", "", "")' for b in HEAT_BUCKETS) + \
        f'\nor label_replace(count({series}) or vector(0), "le", "+Inf", "", "")'


def overview(config: Config, lbl: Labels = Labels()) -> Dashboard:
    """The fleet at a glance with every instance selected (counts, the worst few, a heatmap);
    the per-instance panels fill in only once instances are picked (``picked``)."""
    n, s, leg = _names(config), _sel(lbl), _legend(lbl)
    alerts = f'ALERTS{{alertname=~"Kvdiag.*", {lbl.target[0]}=~"$job", {lbl.target[-1]}=~"$instance"}}'
    only = picked(lbl)
    per_instance = lambda key, title, unit, desc, **kw: Panel(  # noqa: E731
        title, "timeseries", (Query(f"{n[key]}{s} {only}", leg),), desc + " Drawn once instances are picked.", unit, **kw
    )
    worst = lambda key, title, unit, desc: Panel(  # noqa: E731
        title, "table", (Query(f"topk({WORST}, {n[key]}{s})", key, instant=True),), desc, unit, width=8
    )
    table = tuple(
        Query(f"{n[key]}{s} {only}", key, instant=True) for key in ("usage", "waiting", "running", "evictions", "ttft", "hit", "ceiling")
    )
    quantile = f"P{config.ttft_quantile * 100:g} TTFT"
    return Dashboard(
        OVERVIEW_UID,
        "KV pool overview",
        "Is the GPU KV pool (L1) what caps concurrency and drives P99 TTFT, across the fleet? With every instance "
        "selected: counts, the worst few and the spread; pick instances to see their own series.",
        (
            Panel("Verdicts", "stat", (
                Query(f"count by (alertname, alertstate) ({alerts})", "{{alertname}} ({{alertstate}})", instant=True),
                Query("count by (verdict) (kvdiag_verdict == 1)", "{{verdict}} (exporter)", instant=True),
            ), "Instances per kvdiag alert (from the rules; pending = condition true, waiting out `for:`), and per verdict from the kvdiag exporter where it runs.", width=16),
            Panel("Instances", "stat", (Query(f"count({INSTANCE_INFO}{s})", "instances", instant=True),),
                  "Engine instances (data-parallel engines) reporting scheduler metrics.", width=8),
            worst("waiting", f"Worst {WORST} by waiting requests", "short", "The longest waiting queues now."),
            worst("admission", f"Worst {WORST} by KV admission usage", "percentunit",
                  "The fullest pools now, as admission counts them (usage + the room the next admission needs)."),
            worst("ttft", f"Worst {WORST} by {quantile}", "s", "The slowest first tokens over the window now."),
            Panel("KV admission usage spread", "timeseries", (
                Query(f"max({n['admission']}{s})", "max"),
                Query(f"quantile(0.5, {n['admission']}{s})", "median"),
                Query(f"min({n['admission']}{s})", "min"),
            ), "Admission usage across instances (active usage + the room the next admission needs: its uncached prompt, "
               "the output reserve where the engine keeps one, the room one step frees where the gauge is read after the "
               "frees); the line is the saturation threshold.",
                  "percentunit", thresholds=((config.saturated_usage, "red"),), max=1.0),
            Panel("KV admission usage heatmap", "heatmap", (Query(_heatmap(f"{n['admission']}{s}"), "{{le}}"),),
                  "Instances by admission usage over time: how much of the fleet sits near the saturation threshold "
                  f"({config.saturated_usage:g}).", "short"),
            per_instance("waiting", "Waiting requests", "short", "Requests in each instance's waiting queue."),
            per_instance("evictions", "Evictions per second", "reqps", "Running requests retracted (SGLang) or preempted (vLLM) and recomputed."),
            per_instance("ttft", quantile, "s", "From the TTFT histogram over the window; the line is the SLO.",
                         thresholds=((config.ttft_slo, "red"),)),
            per_instance("hit", "Prefix hit ratio", "percentunit", "Prefix-cache hit tokens / queried tokens, from counters.", max=1.0),
            Panel("Instance table", "table", table, "Each picked instance now: usage, queue, evictions, TTFT, hit ratio, ceiling.",
                  width=24, height=10),
        ),
    )


def instance(config: Config, lbl: Labels = Labels()) -> Dashboard:
    n, s, leg = _names(config), _sel(lbl), _legend(lbl)
    return _only_picked(lbl, Dashboard(
        INSTANCE_UID,
        "KV pool instance",
        "One engine instance's KV pool (L1): the three states, the queue, evictions, P99 TTFT, hit ratio, L2, the ceiling.",
        (
            Panel("Alerts", "table", (
                Query(f'ALERTS{{alertname=~"Kvdiag.*", {lbl.target[0]}=~"$job", {lbl.target[-1]}=~"$instance"}}', "{{alertname}}", instant=True),
                Query('kvdiag_verdict{model=~"$model"} == 1', "{{verdict}}", instant=True),
            ), "kvdiag alerts on this instance (rules), and the exporter's verdict where it runs.", width=10),
            Panel("Checks", "state-timeline", (
                Query(f"{CHECK_STATUS}{s}", leg + " {{check}}"),
                Query('kvdiag_check_status{model=~"$model"}', "{{check}} (exporter)"),
            ), "Each check: 1 firing, 0 ok, empty unknown.", width=14, max=1.0),
            Panel("KV pool: used / evictable / available", "timeseries", (Query(f"{n['pool']}{s}", leg + " {{state}}"),),
                  "The pool's three states where the engine reports them apart (SGLang >= 0.5.11); vLLM folds evictable into free, so only used.",
                  "short", stacked=True),
            Panel("KV used against capacity", "timeseries", (
                Query(f'{n["pool"]}{_sel(lbl, "state=" + chr(34) + "used" + chr(34))}', leg + " used"),
                Query(f"{n['capacity']}{s}", leg + " capacity"),
            ), "Tokens held by running requests against the pool's capacity in tokens.", "short"),
            Panel("KV usage (active share) and admission usage", "timeseries", (
                Query(f"{n['usage']}{s}", leg + " usage"),
                Query(f"{n['admission']}{s}", leg + " admission"),
            ), "Active (non-evictable) share of the pool, and admission usage: that plus the room the next admission "
               "needs (uncached prompt; output and the running requests' output reserve where the engine reserves it; the "
               "room one step frees where the gauge is read after the frees). "
               "The line is the saturation threshold, applied to admission usage.", "percentunit",
                  thresholds=((config.saturated_usage, "red"),), max=1.0),
            Panel("Waiting and running", "timeseries", (
                Query(f"{n['waiting']}{s}", leg + " waiting"),
                Query(f"{n['running']}{s}", leg + " running"),
            ), "Waiting queue against the running batch.", "short"),
            Panel("Queue by reason", "timeseries", (Query(f"{n['queues']}{s}", leg + " {{queue}} ({{kind}})"),),
                  "Each queue apart. A decode instance waits in its prealloc queue for room in its own pool (capacity) and "
                  "in its transfer queue for KV from the prefill instance; a prefill instance's bootstrap queue waits for "
                  "the decode instance; vLLM's deferred requests wait for their KV transfer (or LoRA), its capacity ones "
                  "for the pool or the scheduler; in_flight requests (KV on the wire) are not waiting.", "short", stacked=True),
            Panel("Pools by kind", "timeseries", (Query(f"{n['usage']}{s}", leg + " usage (checked)"), Query(f"{n['pools']}{s}", leg + " {{pool}}")),
                  "A hybrid model's pools, each with its own usage: the one that binds is the larger (SGLang's "
                  "token_usage). Full attention holds every token, a sliding-window pool at most the window per "
                  "request, Mamba one state per request; 0 where the model has no such pool.", "percentunit", max=1.0),
            Panel("Evictions per second", "timeseries", (Query(f"{n['evictions']}{s}", leg),),
                  "Retract (SGLang) / preempt (vLLM) rate: running requests thrown out of L1 and recomputed.", "reqps"),
            Panel("L2 occupancy and hits", "timeseries", (
                Query(f"{n['l2_usage']}{s}", leg + " occupancy"),
                Query(f"{n['l2_hit']}{s}", leg + " hit share"),
            ), "The KV tier below L1 (L2: SGLang HiCache host memory, vLLM offloading, LMCache), where reported: occupancy "
               "where the tier exports it, and the share of lookups it served (the tier's own lookups for LMCache, "
               "queried tokens otherwise).", "percentunit", max=1.0),
            Panel("L2 traffic", "timeseries", (
                Query(f"{n['l2_load']}{s}", leg + " load (L2 to L1)"),
                Query(f"{n['l2_store']}{s}", leg + " store (L1 to L2)"),
            ), "Bytes per second between the GPU pool and the tier below it (SGLang HiCache load-back / backup, vLLM "
               "offloading load / store). A hit is loaded into L1 slots allocated first: traffic with a pinned L1 is "
               "recompute avoided, never room gained.", "Bps"),
            Panel(f"P{config.ttft_quantile * 100:g} TTFT", "timeseries", (Query(f"{n['ttft']}{s}", leg),),
                  "From the TTFT histogram over the window; the line is the SLO.", "s", thresholds=((config.ttft_slo, "red"),)),
            Panel("Prefix hit ratio", "timeseries", (Query(f"{n['hit']}{s}", leg),),
                  "Beside P99: a high hit ratio with a bad P99 means concurrency, not the cache, is the problem.", "percentunit", max=1.0),
            Panel("Concurrency ceiling", "timeseries", (
                Query(f"{n['ceiling']}{s}", leg + " ceiling"),
                Query(f"{n['running']}{s}", leg + " running"),
            ), "Pool tokens / average sequence length (input + output) against the running count.", "short", width=24),
        ),
    ))


def _only_picked(lbl: Labels, d: Dashboard) -> Dashboard:
    """The dashboard with every query drawn only for picked instances (``picked``): the
    instance dashboard opened with "All" on a fleet would otherwise ask for every series."""
    only = picked(lbl)
    panels = tuple(replace(p, queries=tuple(replace(q, expr=f"({q.expr}) {only}") for q in p.queries)) for p in d.panels)
    return replace(d, panels=panels)


def _variables(d: Dashboard, lbl: Labels) -> list[dict]:
    out: list[dict] = [{
        "current": {}, "hide": 0, "includeAll": False, "label": "Data source", "multi": False, "name": "datasource",
        "options": [], "query": "prometheus", "refresh": 1, "regex": "", "type": "datasource",
    }]
    filters = {"job": f"{INSTANCE_INFO}", "instance": f'{INSTANCE_INFO}{{{lbl.target[0]}=~"$job"}}', "model": f'{INSTANCE_INFO}{{{lbl.target[0]}=~"$job"}}'}
    label = {"job": lbl.target[0], "instance": lbl.target[-1], "model": lbl.model}
    for var in d.variables:
        q = f"label_values({filters[var]}, {label[var]})"
        out.append({
            "allValue": ".*", "current": {}, "datasource": DS, "definition": q, "hide": 0, "includeAll": True,
            "label": var, "multi": True, "name": var, "options": [], "query": {"query": q, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2, "regex": "", "sort": 1, "type": "query",
        })
    return out


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    steps = [{"color": "green", "value": None}] + [{"color": c, "value": v} for v, c in p.thresholds]
    custom: dict = {}
    if p.kind == "timeseries":
        custom = {
            "drawStyle": "line", "fillOpacity": 60 if p.stacked else 10, "lineWidth": 1, "showPoints": "never",
            "spanNulls": False, "stacking": {"group": "A", "mode": "normal" if p.stacked else "none"},
            "thresholdsStyle": {"mode": "line" if p.thresholds else "off"},
        }
    defaults: dict = {"custom": custom, "thresholds": {"mode": "absolute", "steps": steps}, "unit": p.unit}
    if p.max is not None:
        defaults["max"] = p.max
        defaults["min"] = 0
    targets = [
        {
            "datasource": DS, "editorMode": "code", "expr": q.expr, "format": "table" if p.kind == "table" else "time_series",
            "instant": q.instant, "legendFormat": q.legend, "range": not q.instant, "refId": chr(ord("A") + i),
        }
        for i, q in enumerate(p.queries)
    ]
    out = {
        "datasource": DS,
        "description": p.description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "id": pid,
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}, "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": targets,
        "title": p.title,
        "type": p.kind,
    }
    if p.kind == "heatmap":
        targets[0]["format"] = "heatmap"
        out["options"] = {"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges"},
                          "yAxis": {"unit": "percentunit"}, "tooltip": {"show": True, "yHistogram": False}}
    if p.kind == "table":
        out["transformations"] = [{"id": "merge", "options": {}}]
        out["options"] = {"cellHeight": "sm", "showHeader": True}
    if p.kind == "stat":
        out["options"] = {"colorMode": "value", "graphMode": "none", "justifyMode": "auto", "orientation": "auto",
                          "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "textMode": "value_and_name"}
    return out


def to_json(d: Dashboard, lbl: Labels = Labels()) -> str:
    panels, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        panels.append(_panel(p, i, x, y))
        x, row_h = x + p.width, max(row_h, p.height)
    body = {
        "annotations": {"list": []},
        "description": d.description,
        "editable": True,
        "graphTooltip": 1,
        "links": [{"asDropdown": False, "includeVars": True, "keepTime": True, "tags": ["kvdiag"], "title": "kvdiag", "type": "dashboards"}],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["kvdiag"],
        "templating": {"list": _variables(d, lbl)},
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "title": d.title,
        "uid": d.uid,
        "version": 1,
    }
    return dumps(body, indent=2, sort_keys=True) + "\n"


def dashboards(config: Config, lbl: Labels = Labels()) -> dict[str, Dashboard]:
    """File stem -> dashboard."""
    return {OVERVIEW_SLUG: overview(config, lbl), INSTANCE_SLUG: instance(config, lbl)}

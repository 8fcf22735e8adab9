"""The landing page at ``/``: the page a person keeps open beside a deployment.

One static HTML document; its script fetches the JSON API every few seconds and redraws, so
the page needs no server-side templating and shows exactly what the API says. Per instance:
the verdict and its reason; the pool in three states, used (held by running requests),
evictable (cached, reclaimable) and available (an engine that does not report the split, vLLM,
shows its active share against the rest, labelled so, rather than an invented split); the
figures the diagnosis gives over the window (prefix hit ratio, L2 occupancy, evictions per
minute, P99 TTFT: from ``/api/v1/verdicts``, so the page never computes a figure of its own);
and sparklines of KV usage and the waiting queue over the window (from each instance's
``/series``, for the first ``MAX_TRENDS`` instances so a fleet page stays light).
"""

from __future__ import annotations

REFRESH_MS = 5000
MAX_TRENDS = 50  # instances whose series the page fetches for sparklines, per refresh

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvdiag</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin-top: 1em; width: 100%; }
th, td { text-align: left; padding: .35em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
.bar { display: flex; width: 180px; height: 12px; background: #eee; border-radius: 2px; overflow: hidden; }
.bar span { display: block; height: 100%; }
.used { background: #c0392b; } .evictable { background: #f5b041; } .available { background: #58d68d; }
.rest { background: #d5d8dc; }
.verdict { font-weight: 600; padding: .1em .4em; border-radius: 3px; }
.critical { background: #f5b7b1; } .warning { background: #fad7a0; } .info { background: #aed6f1; }
.none { background: #d5f5e3; } .down { color: #c0392b; }
small { color: #666; }
#status { color: #666; margin-top: .5em; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
.spark { display: block; }
.spark polyline { fill: none; stroke-width: 1.5; }
.spark .u { stroke: #c0392b; } .spark .w { stroke: #e67e22; }
.model { white-space: nowrap; }
</style></head>
<body>
<h1>kvdiag</h1>
<div>Is the GPU KV pool (L1) what caps concurrency and drives P99 TTFT?</div>
<nav><a href="/metrics">/metrics</a><a href="/api/v1/instances">/api/v1/instances</a>
<a href="/api/v1/verdicts">/api/v1/verdicts</a><a href="/docs">API docs</a></nav>
<div id="auth" hidden>API token: <input id="token" type="password" size="30">
<button id="save">use</button></div>
<table><thead><tr><th>instance</th><th>engine</th><th>verdict</th><th>KV pool
<small>(<span class="used">&nbsp;</span> used <span class="evictable">&nbsp;</span> evictable
<span class="available">&nbsp;</span> available)</small></th><th>hit ratio</th><th>L2</th>
<th>evictions / min</th><th>running / waiting</th><th>P99 TTFT</th>
<th>over the window <small>(<span class="used">&nbsp;</span> usage, <span style="background:#e67e22">&nbsp;</span> waiting)</small></th>
</tr></thead><tbody id="rows"><tr><td colspan="10">loading…</td></tr></tbody></table>
<div id="status"></div>
<script>
const TOKEN_REQUIRED = __TOKEN_REQUIRED__;
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));
const pct = (x, total) => total > 0 ? Math.max(0, Math.min(100, 100 * x / total)) : 0;
function bar(s) {
  if (!s) return "<small>no sample</small>";
  const cap = s.capacity_tokens;
  if (cap && s.used_tokens != null && s.available_tokens != null) {
    const ev = s.evictable_tokens ?? 0;
    const t = `used ${s.used_tokens} / evictable ${ev} / available ${s.available_tokens} of ${cap} tokens`;
    return `<div class="bar" title="${t}"><span class="used" style="width:${pct(s.used_tokens, cap)}%"></span>` +
      `<span class="evictable" style="width:${pct(ev, cap)}%"></span>` +
      `<span class="available" style="width:${pct(s.available_tokens, cap)}%"></span></div><small>${t}</small>`;
  }
  if (s.kv_usage != null) {
    const t = `active ${(100 * s.kv_usage).toFixed(1)}% (evictable not reported apart)`;
    return `<div class="bar" title="${t}"><span class="used" style="width:${pct(s.kv_usage, 1)}%"></span>` +
      `<span class="rest" style="width:${100 - pct(s.kv_usage, 1)}%"></span></div><small>${t}</small>`;
  }
  return "<small>pool not reported</small>";
}
function figure(d, check, key) {
  // a figure the diagnosis gives in one check's evidence; null where it gives none
  const c = d && d.checks ? d.checks[check] : null;
  const v = c && c.evidence ? c.evidence[key] : null;
  return typeof v === "number" && isFinite(v) ? v : null;
}
const ratio = v => v != null && v >= 0 && v <= 1 ? v.toFixed(2) : "–";  // an impossible ratio is not shown
const num = (v, digits) => v != null ? v.toFixed(digits) : "–";
function spark(series, windowSeconds) {
  if (!series || !series.ts || series.ts.length < 2) return "<small>–</small>";
  const end = series.ts[series.ts.length - 1], start = end - windowSeconds;
  const pts = series.ts.map((t, i) => [t, series.series.usage_ratio[i], series.series.waiting[i]]).filter(p => p[0] >= start);
  const W = 160, H = 34, t0 = pts[0][0], span = Math.max(end - t0, 1e-9);
  const waits = pts.map(p => p[2]).filter(v => v != null);
  const wmax = Math.max(1, ...waits);
  const line = (k, top) => {
    // one polyline per run of present values: a gap in the data is a gap in the line
    const runs = [[]];
    for (const p of pts) {
      if (p[k] == null) { if (runs[runs.length - 1].length) runs.push([]); continue; }
      const x = (W * (p[0] - t0) / span).toFixed(1), y = (H - 2 - (H - 4) * Math.min(p[k] / top, 1)).toFixed(1);
      runs[runs.length - 1].push(`${x},${y}`);
    }
    return runs.filter(r => r.length).map(r => `<polyline class="${k === 1 ? "u" : "w"}" points="${r.join(" ")}"/>`).join("");
  };
  const title = `usage 0–1, waiting 0–${wmax} over the last ${Math.round(end - t0)} s (${pts.length} scrapes)`;
  return `<svg class="spark" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" data-points="${pts.length}" data-waiting-max="${wmax}">` +
    `<title>${title}</title>${line(1, 1)}${line(2, wmax)}</svg><small>usage 0–1, waiting 0–${wmax}</small>`;
}
function row(r, d, series, windowSeconds) {
  const s = r.latest, sev = r.severity || "none";
  const verdict = r.verdict ? `<span class="verdict ${esc(sev)}" title="${esc(r.reason)}">${esc(r.verdict)}</span>` : `<small>${r.joined_to ? "joined" : "pending"}</small>`;
  const up = r.up ? "" : ` <small class="down">down: ${esc(r.error)}</small>`;
  const link = `/api/v1/instances/${encodeURIComponent(r.instance)}/series`;
  const ttft = r.ttft_p99_seconds != null ? r.ttft_p99_seconds.toFixed(2) + " s" : "–";
  const rw = s ? `${s.running ?? "–"} / ${s.waiting ?? "–"}` : "–";
  const l2 = figure(d, "l2_underused", "l2_occupancy");
  return `<tr data-instance="${esc(r.instance)}"><td><a href="${link}">${esc(r.instance)}</a>${up}</td>` +
    `<td>${esc(s ? s.engine : "")}<br><small class="model">${esc(s && s.model ? s.model : "")}</small></td>` +
    `<td>${verdict}<br><small>${esc(r.reason)}</small></td><td>${bar(s)}</td>` +
    `<td class="num hit">${ratio(figure(d, "prefix_hit_high", "hit_ratio"))}</td>` +
    `<td class="num l2" title="L2 (host tier) occupancy">${l2 != null && l2 >= 0 && l2 <= 1 ? (100 * l2).toFixed(0) + "%" : "–"}</td>` +
    `<td class="num evictions">${num(figure(d, "evictions_growing", "per_minute"), 1)}</td>` +
    `<td class="num">${rw}</td><td class="num ttft">${ttft}</td><td>${s ? spark(series, windowSeconds) : "–"}</td></tr>`;
}
async function getJSON(url, headers) {
  const resp = await fetch(url, {headers});
  if (resp.status === 401) { document.getElementById("auth").hidden = false; throw new Error("API token needed"); }
  if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
  return resp.json();
}
async function refresh() {
  const headers = {};
  const token = sessionStorage.getItem("kvdiag-token");
  if (token) headers["Authorization"] = "Bearer " + token;
  try {
    const [data, verdicts] = await Promise.all([getJSON("/api/v1/instances", headers), getJSON("/api/v1/verdicts", headers)]);
    const diagnoses = Object.fromEntries(verdicts.instances.map(d => [d.instance, d]));
    const trended = data.instances.filter(r => r.latest).slice(0, __MAX_TRENDS__);
    const series = Object.fromEntries(await Promise.all(trended.map(r =>
      getJSON(`/api/v1/instances/${encodeURIComponent(r.instance)}/series?fields=usage_ratio,waiting`, headers)
        .then(s => [r.instance, s], () => [r.instance, null]))));
    const rows = data.instances.map(r => row(r, diagnoses[r.instance], series[r.instance], data.window_seconds)).join("");
    document.getElementById("rows").innerHTML = rows || '<tr><td colspan="10">no targets configured</td></tr>';
    const more = data.instances.length > trended.length ? `; sparklines for the first ${trended.length}` : "";
    document.getElementById("status").textContent =
      `${data.instances.length} instance(s), window ${data.window_seconds} s${more}; updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    document.getElementById("status").textContent = "refresh failed: " + e.message;
  }
}
document.getElementById("auth").hidden = !TOKEN_REQUIRED;
document.getElementById("save").onclick = () => {
  sessionStorage.setItem("kvdiag-token", document.getElementById("token").value); refresh(); };
refresh();
setInterval(refresh, __REFRESH_MS__);
</script></body></html>
"""


def landing_page(api_token_required: bool) -> str:
    """The page; with a token configured it asks for it (kept in the tab's sessionStorage)."""
    page = _PAGE.replace("__TOKEN_REQUIRED__", "true" if api_token_required else "false")
    return page.replace("__REFRESH_MS__", str(REFRESH_MS)).replace("__MAX_TRENDS__", str(MAX_TRENDS))

"""The landing page at ``/``: every instance, its verdict and its pool, refreshing by itself.

One static HTML document; its script fetches ``/api/v1/instances`` every few seconds and
redraws, so the page needs no server-side templating and shows exactly what the API says.
The bar is the pool in three states: used (held by running requests), evictable (cached,
reclaimable) and available; an engine that does not report the split (vLLM) shows its active
share against the rest, labelled so, rather than an invented split.
"""

from __future__ import annotations

REFRESH_MS = 5000

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
<span class="available">&nbsp;</span> available)</small></th><th>running / waiting</th>
<th>P99 TTFT</th></tr></thead><tbody id="rows"><tr><td colspan="6">loading…</td></tr></tbody></table>
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
function row(r) {
  const s = r.latest, sev = r.severity || "none";
  const verdict = r.verdict ? `<span class="verdict ${esc(sev)}" title="${esc(r.reason)}">${esc(r.verdict)}</span>` : "<small>pending</small>";
  const up = r.up ? "" : ` <small class="down">down: ${esc(r.error)}</small>`;
  const link = `/api/v1/instances/${encodeURIComponent(r.instance)}/series`;
  const ttft = r.ttft_p99_seconds != null ? r.ttft_p99_seconds.toFixed(2) + " s" : "–";
  const rw = s ? `${s.running ?? "–"} / ${s.waiting ?? "–"}` : "–";
  return `<tr data-instance="${esc(r.instance)}"><td><a href="${link}">${esc(r.instance)}</a>${up}</td>` +
    `<td>${esc(s ? s.engine : "")} <small>${esc(s && s.model ? s.model : "")}</small></td>` +
    `<td>${verdict}<br><small>${esc(r.reason)}</small></td><td>${bar(s)}</td><td>${rw}</td><td>${ttft}</td></tr>`;
}
async function refresh() {
  const headers = {};
  const token = sessionStorage.getItem("kvdiag-token");
  if (token) headers["Authorization"] = "Bearer " + token;
  try {
    const resp = await fetch("/api/v1/instances", {headers});
    if (resp.status === 401) { document.getElementById("auth").hidden = false; throw new Error("API token needed"); }
    const data = await resp.json();
    const rows = data.instances.map(row).join("");
    document.getElementById("rows").innerHTML = rows || '<tr><td colspan="6">no targets configured</td></tr>';
    document.getElementById("status").textContent =
      `${data.instances.length} instance(s), window ${data.window_seconds} s; updated ${new Date().toLocaleTimeString()}`;
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
    return _PAGE.replace("__TOKEN_REQUIRED__", "true" if api_token_required else "false").replace("__REFRESH_MS__", str(REFRESH_MS))

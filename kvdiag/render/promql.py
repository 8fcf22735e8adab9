"""PromQL building blocks that mirror the engine adapters' reading rules.

The adapters (``kvdiag.engines``) read one figure per instance by taking the max over samples
that repeat the same pool (TP/PP ranks, multiprocess pids), adding up true partitions
(streaming vs non-streaming, cache modes) and keeping data-parallel engines apart. The
recording rules must do exactly the same in PromQL, so every rule is written with the helpers
here instead of by hand:

- ``sel``: a family under both spellings a Prometheus 2.x server may store it as
  (``sglang:x`` and the underscore-escaped ``sglang_x`` that prometheus_client >= 0.23 serves
  to old scrapers), as one ``__name__`` regex (``sglang:x|sglang_x``);
- ``gauge`` / ``counter_total``: one figure per instance from one scrape, as an adapter reads
  it: max over the duplicate labels (everything not in the instance key), then sum over
  partitions. The first rule layer records these; rates are taken by later layers over the
  recorded totals (``rate`` of the one counter the adapters read, extrapolated once, with
  resets seen as the window sees them);
- ``broadcast``: a server-wide series (SGLang's tokenizer process has no ``dp_rank``) copied
  onto every data-parallel instance of its server, as the adapters do;
- ``label_value``: a number that an engine only publishes as a label value (vLLM's
  ``cache_config_info{kv_cache_size_tokens="..."}``) turned into a sample value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Labels:
    """The labels that identify one kvdiag instance in Prometheus.

    ``target`` are the scrape target's labels (from service discovery; add ``cluster`` or
    ``namespace`` here when the fleet spans several), ``model`` the engines' model label and
    ``split`` the data-parallel labels (vLLM ``engine``, SGLang ``dp_rank``): each value is its
    own KV pool, hence its own instance. Every other label on an engine series repeats the
    same pool (``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``pid``) or is a partition that the
    rules add up.
    """

    target: tuple[str, ...] = ("job", "instance")
    model: str = "model_name"
    split: tuple[str, ...] = ("engine", "dp_rank")

    @property
    def key(self) -> tuple[str, ...]:
        return self.target + (self.model,) + self.split

    @property
    def server(self) -> tuple[str, ...]:
        """One engine server: what a server-wide series is keyed by."""
        return self.target + (self.model,)

    def by(self, *extra: str) -> str:
        return "by (" + ", ".join(self.key + extra) + ")"


#: The recorded series that says "this instance exists" (one per data-parallel engine).
INSTANCE_INFO = "instance:kvdiag_instance:info"
#: The recorded check results: 1 firing, 0 ok, absent when unknown (label ``check``).
CHECK_STATUS = "instance:kvdiag_check:status"


def sel(family: str, suffix: str = "", matchers: str = "") -> str:
    """A selector for one family (``prefix:name``) under both of its stored spellings, as an
    alternation of the two names: Prometheus looks such a set up in its index directly, where
    a character class (``sglang[:_]name``) makes it try the regex on every metric name."""
    prefix, _, rest = family.partition(":")
    name = f"{prefix}:{rest}{suffix}|{prefix}_{rest}{suffix}" if rest else family + suffix
    inner = f'__name__=~"{name}"'
    return "{" + inner + (", " + matchers if matchers else "") + "}"


def gauge(lbl: Labels, family: str, matchers: str = "", partitions: tuple[str, ...] = ()) -> str:
    """One gauge figure per instance: max over duplicates, summed over ``partitions``."""
    return _combine(lbl, sel(family, "", matchers), partitions)


def counter_total(lbl: Labels, family: str, matchers: str = "", partitions: tuple[str, ...] = (),
                  suffix: str = "_total", extra: tuple[str, ...] = ()) -> str:
    """A counter's value (``<family><suffix>``) per instance (and ``extra`` labels, e.g. a
    histogram's ``le``): max over duplicates, summed over ``partitions``, the figure an adapter
    reads from one scrape."""
    return _combine(lbl, sel(family, suffix, matchers), partitions, extra)


def _combine(lbl: Labels, inner: str, partitions: tuple[str, ...], extra: tuple[str, ...] = ()) -> str:
    if not partitions:
        return f"max {lbl.by(*extra)} ({inner})"
    return f"sum {lbl.by(*extra)} (max {lbl.by(*extra, *partitions)} ({inner}))"


def first(*exprs: str) -> str:
    """The first alternative present for an instance (``or`` keeps the left side's series).
    One alternative per line, so the rules file reads as the adapters' fallback list."""
    return "\nor ".join(f"({e})" for e in exprs)


def broadcast(lbl: Labels, expr: str) -> str:
    """Copy a server-wide series onto each instance of its server (adapters: "server-wide
    series, not split by dp_rank"). The instance list comes from ``INSTANCE_INFO``."""
    on = ", ".join(lbl.server)
    return f"({expr}) + on ({on}) group_right () (0 * {INSTANCE_INFO})"


def label_value(lbl: Labels, family: str, label: str) -> str:
    """A label's numeric value as the sample value, per target and split (no model label).

    PromQL has no label-to-number function, but ``histogram_quantile`` parses ``le``: a
    one-observation histogram whose only finite bucket is ``le=<value>`` has its maximum
    (quantile 1) exactly at ``<value>``. A value that is not a number (vLLM writes ``"None"``
    for unset fields) leaves only the +Inf bucket, which yields NaN, and ``> 0`` drops it.
    """
    by = "by (" + ", ".join(lbl.target + lbl.split + ("le",)) + ")"
    src = sel(family)
    buckets = f'label_replace({src}, "le", "$1", "{label}", "(.+)") or label_replace({src}, "le", "+Inf", "__name__", ".*")'
    return f"histogram_quantile(1, max {by} ({buckets})) > 0"


def with_model(lbl: Labels, expr: str) -> str:
    """Attach the model label (and the instance list) to a series keyed without it."""
    on = ", ".join(lbl.target + lbl.split)
    return f"({expr}) + on ({on}) group_right () (0 * {INSTANCE_INFO})"

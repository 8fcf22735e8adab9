"""A keep-list for a Prometheus that serves kvdiag alone: ``metric_relabel_configs`` that store
only the engine families the recording rules read, and the kvdiag exporter's own series.

An engine exposes far more than the checklist needs (per-request histograms, speculative
decoding, per-LoRA series); at fleet scale those fill the head block and the memory of a
Prometheus that only runs kvdiag's rules. The list is read off the rendered rules themselves
(every ``__name__`` matcher they hold, each family in both stored spellings), so it keeps
exactly what the rules select and is regenerated with them (``kvdiag render``); the alerts and
dashboards read recorded series, ``ALERTS`` and the exporter's ``kvdiag_*``, which it keeps too.
"""

from __future__ import annotations

import re

from kvdiag.render.rules import HEADER, dump

#: The exporter's own series (``kvdiag_verdict``, ``kvdiag_check_status``...), which the dashboards read.
EXPORTER = "kvdiag_.*"
_MATCHER = re.compile(r'__name__=~"([^"]+)"')


def families(rule_file: str) -> list[str]:
    """Every ``__name__`` regex the rules select by, in first-seen order."""
    return list(dict.fromkeys(_MATCHER.findall(rule_file)))


def keep_regex(rule_file: str) -> str:
    """One anchored regex (Prometheus anchors relabel regexes) matching every family the
    rules read, and the exporter's series."""
    return "|".join(sorted(families(rule_file)) + [EXPORTER])


def keep_file(rule_file: str) -> str:
    """The ``metric_relabel_configs`` to paste under each engine scrape job (and the
    exporter's), as a YAML document of its own."""
    text = HEADER
    text += "# metric_relabel_configs for the scrape jobs of a Prometheus that serves kvdiag alone: keeps the\n"
    text += "# engine families rules/kvdiag-recording.yaml reads (both spellings) and the exporter's kvdiag_*\n"
    text += "# series, and drops every other sample before it is stored. Paste the list under each job.\n"
    return text + dump({"metric_relabel_configs": [{"source_labels": ["__name__"], "regex": keep_regex(rule_file), "action": "keep"}]})

"""``kvdiag serve``: the exporter that runs beside a serving cluster.

It scrapes every engine on a schedule (``loop``), keeps a bounded window per instance
(``ring``), runs the checks, and publishes the answers three ways: ``/metrics`` for Prometheus
(``collector``), a JSON API and a landing page for people (``app``, ``page``), and ``/probe``
for Prometheus-driven service discovery (``probe``). Targets come from the config file, the
command line and Prometheus ``file_sd`` files (``targets``, ``settings``).
"""

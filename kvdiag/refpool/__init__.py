"""The reference KV pool: both engines' L1 accounting, admission, eviction and L2, runnable.

It generates ground truth for every verdict: a simulated engine knows whether admission was
blocked on L1, how many requests it retracted or preempted, and when P99 TTFT crossed the SLO.
"""

from kvdiag.refpool import native

native.install()  # before any compiled module is imported: the compiled build, or the sources

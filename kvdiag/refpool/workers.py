"""Independent simulation runs spread over worker processes (``validate``'s scenarios, the
what-if replays and pairs): one loop, so that every caller gets the same ordering, progress and
garbage-collector tuning."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Sequence, TypeVar

from kvdiag.refpool.sim import tune_gc

T = TypeVar("T")
R = TypeVar("R")


def in_workers(fn: Callable[[T], R], items: Sequence[T], workers: int = 1, progress: Callable[[R], None] | None = None) -> list[R]:
    """``fn`` over ``items``, ``workers`` at a time in worker processes (a module-level ``fn``;
    each worker collects garbage as a simulation process should, ``tune_gc``), in this process
    when one worker or one item; results in the order given, ``progress(result)`` as each
    finishes."""
    done: dict[int, R] = {}
    if workers <= 1 or len(items) <= 1:
        for k, item in enumerate(items):
            done[k] = fn(item)
            if progress is not None:
                progress(done[k])
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(items)), initializer=tune_gc) as pool:
            futures = {pool.submit(fn, item): k for k, item in enumerate(items)}
            for fut in as_completed(futures):
                done[futures[fut]] = fut.result()
                if progress is not None:
                    progress(done[futures[fut]])
    return [done[k] for k in range(len(items))]

"""Batch-level decode accounting for the vLLM reference scheduler (exact; accounting-only runs).

Under load nearly every running request of a vLLM step is a one-token decode, and the
step-by-step scheduler spends a Python call chain per running request per step on it
(``allocate_slots``, a chunk, a sampled token, ``check_stop``): at a thousand running requests
that caps a run at a few simulated seconds per wall second. Yet a decoding request needs its
own work only at three kinds of step: its next token starts a block (``allocate_slots`` takes a
block from the free queue), its last token fills one (``cache_blocks`` hashes and indexes it),
or it stops (``check_stop``, its blocks are freed). Between those a step changes it by exactly
one computed and one output token.

So a *steady* request (it decoded in the last step, so it decodes in this one) is not touched
per step: its fields are exact as of its ``anchor`` step, it has decoded once per step since,
and they are brought up to date (``_sync``) only when it stops or the normal path needs it.
Its block events are periodic: with ``c`` computed tokens at a step's start it takes a block
where ``c % block_size == 0`` and fills one where ``(c + 1) % block_size == 0``, and ``c - step``
is constant while it is steady, so steady requests sit in one of ``block_size`` phase buckets
(in running order) and a step's events are two buckets. Stops come from a heap keyed by step.

Events of one step are applied in running order, merged with the requests that are not steady
(prefills, chunks) going through the normal ``allocate_slots``, so block ids, block hashes, the
free queue's order and the cache's order are those of the step-by-step loop (the running list is
in admission order: it only appends at the tail and removes). Where no explicit request comes
between them and no block a step caches shares a hash with a block it takes from the free queue,
its block takes commute with its caching and are one ``get_new_blocks``. The plan lists the
steady decodes as one aggregate (``StepPlan.decode_batch``, ``decode_context``) instead of a
chunk each. Where blocks run out, the step preempts from the back of the running list as
``schedule`` does, each victim brought up to date first; a step whose running phase could run
out of token budget (checked before anything changes) brings every request up to date and
takes the normal path.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import TYPE_CHECKING

from kvdiag.refpool.types import DecodeRun
from kvdiag.refpool.vllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvdiag.refpool.vllm.scheduler import VLLMScheduler, _SchedulerOutput

_RUNNING = RequestStatus.RUNNING
#: The most steps one decode run is offered (the engine loop cuts it at the next arrival or
#: scrape anyway): a bound on the offer's own walk over the steps' block takes.
MAX_RUN_STEPS = 1024


def _seq(r: Request) -> int:
    return r.seq


def _live(entry: tuple[int, int, Request]) -> bool:
    """Whether a stop heap entry (step, seq, request) is its request's current stop: one left
    by a request that was made steady again since, or stopped being steady, is not."""
    step, seq, r = entry
    return r.steady and r.seq == seq and r.stop_step == step


class BatchDecode:
    """The steady requests of one ``VLLMScheduler`` and their upcoming events."""

    def __init__(self, s: VLLMScheduler) -> None:
        assert not s.running and not s.moves_bytes and not s.debug and s.connector is None
        self.s = s
        self.step = 0  # the step whose schedule is next (or under way)
        self.n = 0  # steady requests
        self.context = 0  # their computed tokens at the start of this step's schedule
        # phases[p]: steady requests with (computed - step) % block_size == p, in running order
        self.phases: list[list[Request]] = [[] for _ in range(s.block_size)]
        self.stops: list[tuple[int, int, Request]] = []  # (step, seq, request): at that update
        self.explicit: list[Request] = []  # running requests that are not steady, in running order
        self._full = False  # this step took the normal path: every running request is explicit
        self._seq = itertools.count()
        # Every step's block events one at a time (the tests hold that path to step by step on
        # any stream), and how often a step took it because a block cached shared a hash taken.
        self.always_in_order = False
        self.hash_order_steps = 0

    def admitted(self, r: Request) -> None:
        """``r`` was appended to the running list: it sorts after every running request."""
        r.seq = next(self._seq)

    # ---- schedule: the running phase
    def schedule_running(
        self, out: _SchedulerOutput, token_budget: int, threshold: int, now: float
    ) -> tuple[int, list[Request]] | None:
        """The running phase of this step: the token budget left and the requests preempted
        (from the back of the running list, as ``schedule`` does, where a block is missing), or
        None (nothing changed) where it could exhaust the token budget: then every request is
        brought up to date for the normal path."""
        s = self.s
        kv, bs = s.kv_cache_manager, s.block_size
        blocks_of = kv.req_to_blocks
        takes, fills, filled, hashes = self._events()
        need_tokens, need_blocks = self.n, len(takes)
        sizes = []
        for r in self.explicit:
            n = r.num_tokens - r.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            sizes.append(n)
            need_tokens += n
            end = min(r.num_computed_tokens + n, s.max_model_len)
            need_blocks += max(-(-end // bs) - len(blocks_of.get(r.request_id, ())), 0)
        if need_tokens > token_budget:
            self.sync_all()
            return None
        explicit = self.explicit
        last = max(takes[-1].seq if takes else -1, fills[-1].seq if fills else -1)
        preempted: list[Request] = []
        if (
            need_blocks <= s.block_pool.get_num_free_blocks()
            and (not explicit or explicit[0].seq > last)
            and not self.always_in_order
            and not self._shares_hash(hashes, len(takes))
        ):
            self._take_and_fill(takes, fills, filled, hashes)
            for r, n in zip(explicit, sizes):
                self._explicit_step(out, r, n, now, preempted)  # fits: checked above
        else:  # one request at a time, in running order, preempting where blocks run out
            need_tokens = self._one_at_a_time(out, sorted(takes + fills, key=_seq), sizes, now, preempted)
        out.plan.decode_batch, out.plan.decode_context = self.n, self.context
        return token_budget - need_tokens, preempted

    def _events(self) -> tuple[list[Request], list[Request], list[int], list[int]]:
        """This step's block events: the steady requests that take a block (``c % bs == 0``),
        those that fill one (``(c + 1) % bs == 0``, where blocks are cached), and for each fill
        the index of the block it fills (the one after those it has cached) and its hash."""
        j, bs = self.step, self.s.block_size
        takes = self.phases[-j % bs]
        fills = self.phases[(-j - 1) % bs] if self.s.kv_cache_manager.enable_caching else []
        filled = [(r.num_computed_tokens + j - r.anchor + 1) // bs - 1 for r in fills]
        return takes, fills, filled, [r.block_hashes[i] for r, i in zip(fills, filled)]

    def _take_and_fill(self, takes: list[Request], fills: list[Request], filled: list[int], hashes: list[int]) -> None:
        """A step's block events at once (where their order does not matter): the takes as one
        ``get_new_blocks``, the fills as one ``cache_hashed`` (``cache_blocks`` of each: one
        block each)."""
        s = self.s
        kv, pool = s.kv_cache_manager, s.block_pool
        blocks_of = kv.req_to_blocks
        for r, b in zip(takes, pool.get_new_blocks(len(takes))):
            blocks_of[r.request_id].append(b)
        if fills:
            pool.cache_hashed([blocks_of[r.request_id][i] for r, i in zip(fills, filled)], hashes)
            cached = kv.num_cached_block
            for r, i in zip(fills, filled):
                cached[r.request_id] = i + 1

    def _one_at_a_time(
        self, out: _SchedulerOutput | None, steady: list[Request], sizes: list[int], now: float, preempted: list[Request]
    ) -> int:
        """This step's block events and explicit requests merged in running order, each as the
        normal loop takes it: where a request's blocks do not fit, the last running request is
        preempted until they do, or until it is the one preempted (then the phase ends: nothing
        is left behind it). Returns the tokens scheduled."""
        s, j = self.s, self.step
        kv, bs = s.kv_cache_manager, s.block_size
        items = sorted([(r.seq, r, 0) for r in steady] + [(r.seq, r, n) for r, n in zip(self.explicit, sizes)])
        tokens, queue = 0, s.block_pool.free_block_queue
        for _, r, n in items:
            if r.status is not _RUNNING:
                continue  # preempted earlier in this step
            if n:
                assert out is not None, "explicit requests are scheduled into a step's output"
                if not self._explicit_step(out, r, n, now, preempted):
                    return tokens + self.n
                tokens += n
                continue
            c = r.num_computed_tokens + j - r.anchor
            need = -(-(c + 1) // bs) - len(kv.req_to_blocks[r.request_id])
            while need > queue.num_free_blocks:  # allocate_slots would return None
                if self._preempt_last(preempted) is r:
                    return tokens + self.n
            if need:  # allocate_slots of a running decode ...
                kv._allocate_new_blocks(r.request_id, c + 1)
            if (c + 1) % bs == 0:  # ... and its caching up to num_tokens (only a fill caches)
                kv.cache_blocks(r, c + 1)
        return tokens + self.n

    def _preempt_last(self, preempted: list[Request]) -> Request:
        """``schedule``'s preemption: the last running request, brought up to date first."""
        victim = self.s.running.pop()
        if victim.steady:
            self._sync(victim, self.step)
            self._unsteady(victim)
        self.s._preempt_request(victim)
        preempted.append(victim)
        return victim

    def _shares_hash(self, caching: list[int], n_takes: int) -> bool:
        """Whether a block this step caches (``caching``: their hashes) has the hash of one of
        the next ``n_takes`` free blocks (whose hash taking it drops): only then does their order
        matter. A free block's hash is in the cache map (hashed blocks are exactly the indexed
        ones), so the queue is walked only where a hash cached is there already: an answer's
        blocks seldom are."""
        if not caching or not n_takes:
            return False
        cached_map = self.s.block_pool.cached_block_hash_to_block
        known = {h for h in caching if h in cached_map}
        if not known:
            return False
        queue = self.s.block_pool.free_block_queue
        b = queue.fake_free_list_head.next_free_block
        for _ in range(n_takes):
            assert b is not None
            if b.block_hash is not None and b.block_hash in known:
                self.hash_order_steps += 1
                return True
            b = b.next_free_block
        return False

    def _explicit_step(self, out: _SchedulerOutput, r: Request, n: int, now: float, preempted: list[Request]) -> bool:
        """``allocate_slots`` as the normal loop calls it, preempting the last running request
        while it does not fit; False where ``r`` itself was preempted."""
        while self.s.kv_cache_manager.allocate_slots(r, n) is None:
            if self._preempt_last(preempted) is r:
                return False
        is_decode = r.num_computed_tokens == r.num_tokens - 1 and bool(r.sim.output)
        self.s._add_chunk(out, r, n, not is_decode, now)
        return True

    # ---- runs of identical steps (types.FastForward)
    def decode_run(self) -> DecodeRun | None:
        """The steps from this one on that are the same decode of the same steady batch
        (``types.DecodeRun``), or None: every running request is steady, none stops before the
        last of them (a stop is at the update of its request's ``stop_step``), their decodes fit
        the token budget, every step's blocks come from free ones (no preemption: nothing is
        freed during the run), and a queue, if any, is refused before any lookup: as many
        requests run as ``max_num_seqs`` allows, or no token budget is left. Such a refusal has
        no side effect and holds for the whole run (nobody leaves the running list), so requests
        arriving meanwhile only join the queue (``queue_latched``). A queue whose head is refused
        for lack of blocks is not offered: a block cached during the run can extend its prefix
        hit."""
        s = self.s
        if self.explicit or not self.n or s.kv_holding_waiting:
            return None
        budget = s.max_num_batched_tokens - self.n
        queued = bool(s.waiting)
        if budget < 0 or queued and budget and len(s.running) < s.max_num_seqs:
            return None
        heap = self.stops
        while heap and not _live(heap[0]):
            heapq.heappop(heap)  # left by a request that stopped being steady
        until = heap[0][0] - self.step if heap else MAX_RUN_STEPS
        free, bs = s.block_pool.get_num_free_blocks(), s.block_size
        steps = 0
        while steps < min(until, MAX_RUN_STEPS):
            free -= len(self.phases[-(self.step + steps) % bs])
            if free < 0:
                break
            steps += 1
        if steps < 2:
            return None
        return DecodeRun(steps, self.n, self.context, False, queued, len(s.waiting), queue_latched=queued)

    def advance_decode(self, steps: int) -> list[int]:
        """``steps`` steps of the offered run, each as ``schedule`` and ``update_from_output``
        take it: its block events (at once, or one at a time where a block cached shares a hash
        taken), no admission, no stop, then ``after_update``. The pool's used tokens after each
        step, in the metrics hook's convention (blocks not free, the null block excluded)."""
        pool, bs = self.s.block_pool, self.s.block_size
        used = []
        for _ in range(steps):
            takes, fills, filled, hashes = self._events()
            if self.always_in_order or self._shares_hash(hashes, len(takes)):
                self._one_at_a_time(None, sorted(takes + fills, key=_seq), [], 0.0, [])
            else:
                self._take_and_fill(takes, fills, filled, hashes)
            self.after_update([])
            used.append((pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * bs)
        return used

    # ---- update
    def with_stops(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """This step's scheduled requests plus the steady ones that stop at its update (brought
        up to date, no longer steady), in running order: the update processes them alike."""
        j, stops = self.step, []
        heap = self.stops
        while heap and heap[0][0] <= j:
            entry = heapq.heappop(heap)
            if _live(entry):
                stops.append(entry[2])
        if not stops:
            return scheduled
        for r in stops:
            self._sync(r, j)
            self._unsteady(r)
        return sorted(scheduled + [(r, 1) for r in stops], key=lambda x: x[0].seq)

    def after_update(self, scheduled: list[tuple[Request, int]]) -> None:
        """The steady requests decoded once more; every request that decoded this step and is
        still running becomes steady from the next step."""
        s = self.s
        self.context += self.n
        s.generation_tokens_total += self.n
        nxt = self.step + 1
        explicit = []
        for r in s.running if self._full else (r for r, _ in scheduled):
            if r.steady or r.status is not _RUNNING:
                continue
            if not self._make_steady(r, nxt):
                explicit.append(r)
        self.explicit = explicit
        self._full = False
        self.step = nxt

    # ---- bookkeeping
    def sync_all(self) -> None:
        """Bring every running request up to date and make it explicit (the normal path's
        state, exactly as the step-by-step loop would have it now)."""
        for r in self.s.running:
            if r.steady:
                self._sync(r, self.step)
                r.steady = False
        self.n = self.context = 0
        self.phases = [[] for _ in self.phases]
        self.stops = []
        self.explicit = list(self.s.running)
        self._full = True

    def _make_steady(self, r: Request, step: int) -> bool:
        """Make ``r`` steady from ``step`` if it decodes there with its blocks on the periodic
        pattern (as many blocks as its computed tokens need, every full one cached)."""
        s, sim, bs = self.s, r.sim, self.s.block_size
        c = r.num_computed_tokens
        if c != r.num_tokens - 1 or not sim.output:
            return False  # prefilling, or resumed and recomputing
        kv = s.kv_cache_manager
        if len(kv.req_to_blocks[r.request_id]) != -(-c // bs) or (
            kv.enable_caching and kv.num_cached_block.get(r.request_id, 0) != c // bs
        ):
            return False
        n_out = len(sim.output)
        # check_stop stops it at the d-th decode from now (d >= 1: it did not stop yet).
        d = min(sim.max_new_tokens - n_out, sim.output_len - n_out, s.max_model_len - r.num_tokens)
        r.steady, r.anchor, r.stop_step = True, step, step + d - 1
        # The hashes of every block it fills until then (its answer is known ahead), in one
        # pass rather than one call per block filled; they are those positions' hashes whatever
        # happens (a preempted request recomputes the same tokens).
        r.hash_blocks_to(c + d)
        heapq.heappush(self.stops, (r.stop_step, r.seq, r))
        bisect.insort(self.phases[(c - step) % bs], r, key=_seq)
        self.n += 1
        self.context += c
        return True

    def _unsteady(self, r: Request) -> None:
        """``r`` (brought up to date) leaves the steady set."""
        self.phases[(r.num_computed_tokens - self.step) % self.s.block_size].remove(r)
        r.steady = False
        self.n -= 1
        self.context -= r.num_computed_tokens

    @staticmethod
    def _sync(r: Request, step: int) -> None:
        """``r``'s fields as the step-by-step loop has them at the start of ``step``."""
        d = step - r.anchor
        if d:
            r.append_output_tokens(d)
            r.num_computed_tokens += d
            r.anchor = step

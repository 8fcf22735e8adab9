"""SGLang 0.5.23 side of the reference KV pool, in SGLang's own vocabulary.

``allocator`` (TokenToKVPoolAllocator), ``radix_cache`` (RadixCache, TreeNode), ``hicache``
(HostKVCache, HiRadixCache), ``prefill_budget`` (NewTokenRatioTracker, PrefillBudget,
PrefillAdder), ``schedule_batch`` (Req, release/checkpoint, decode check, retraction order) and
``scheduler`` (SGLangScheduler, the ``EngineScheduler`` the engine loop drives).
"""

from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sglang.stats import SGLangStats

__all__ = ["SGLangScheduler", "SGLangStats"]

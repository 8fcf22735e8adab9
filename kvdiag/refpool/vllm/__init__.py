"""Reference model of vLLM V1's GPU KV pool and scheduler (vLLM 0.33.0 mechanics)."""

from kvdiag.refpool.vllm.scheduler import VLLMScheduler, VLLMStats

__all__ = ["VLLMScheduler", "VLLMStats"]

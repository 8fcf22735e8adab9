"""kvdiag: diagnose GPU KV-pool (L1) saturation in SGLang and vLLM from their Prometheus metrics."""

__version__ = "0.1.0"

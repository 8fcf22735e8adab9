"""``kvdiag capacity``: KV bytes per token, pool tokens and the concurrency ceiling of a deployment."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from kvdiag import capacity as cap
from kvdiag.report.json import dumps

EXIT_ERROR = 3
DEFAULT_CONTEXTS = (4096, 32768, 131072)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    presets = ", ".join(m.name for m in cap.MODELS.values())
    p = sub.add_parser(
        "capacity",
        description="The pool is the hard cap on concurrency: pool tokens / (input + output tokens per request).",
    )
    p.add_argument("--model", required=True, metavar="PRESET|config.json", help=f"a preset ({presets}) or a HF config.json path")
    p.add_argument("--kv-dtype", default="bf16", choices=sorted(cap.DTYPE_BYTES), help="KV cache dtype (default bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--pool-gib-per-gpu", type=float, metavar="GIB", help="KV pool size per GPU, as the engine reports it")
    pool.add_argument("--gpu", choices=sorted(cap.GPUS), help="GPU preset: its memory, with --mem-fraction and the weights")
    pool.add_argument("--gpu-mem-gib", type=float, metavar="GIB", help="GPU memory, with --mem-fraction and the weights")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of GPU memory for weights + KV pool (default 0.9)")
    p.add_argument("--weight-dtype", default="bf16", choices=sorted(cap.DTYPE_BYTES), help="weight dtype for the weights estimate")
    p.add_argument("--weights-gib", type=float, metavar="GIB", help="total weight size instead of the estimate from parameters")
    p.add_argument("--context", type=int, action="append", metavar="TOKENS", help="sequence length (input + output); repeatable")
    p.add_argument(
        "--swa-full-tokens-ratio", type=float, metavar="R",
        help="hybrid sliding-window model on SGLang: its SWA pool is R x the full pool in tokens (SGLang's default 0.8); "
        "without it the pool is sized per request",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def plan(args: argparse.Namespace) -> cap.Plan:
    """The deployment the flags describe; ValueError names what is missing or impossible."""
    spec = cap.model(args.model)
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    ratio = args.swa_full_tokens_ratio
    if ratio is not None and not spec.swa_layers:
        raise ValueError(f"--swa-full-tokens-ratio: {spec.name} has no sliding-window layers")
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError("--swa-full-tokens-ratio must be in (0, 1]")
    for flag in ("pool_gib_per_gpu", "gpu_mem_gib", "weights_gib"):
        _check_gib(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.pool_gib_per_gpu is not None:
        return cap.Plan(spec, args.kv_dtype, args.tp, int(args.pool_gib_per_gpu * cap.GIB), swa_full_tokens_ratio=ratio)
    if args.gpu is None and args.gpu_mem_gib is None:
        raise ValueError("give --pool-gib-per-gpu, or --gpu / --gpu-mem-gib with --mem-fraction")
    if not 0 < args.mem_fraction <= 1:
        raise ValueError("--mem-fraction must be in (0, 1]")
    gpu_bytes = cap.GPUS[args.gpu].memory_bytes if args.gpu else args.gpu_mem_gib * cap.GIB
    weights = args.weights_gib * cap.GIB if args.weights_gib is not None else spec.weight_bytes(cap.DTYPE_BYTES[args.weight_dtype])
    try:
        pool, per_gpu = cap.pool_from_memory(spec, args.tp, gpu_bytes, args.mem_fraction, weights)
    except ValueError as exc:
        hint = None if args.weights_gib is not None else _weight_dtype_hint(spec, args, gpu_bytes)
        raise ValueError(f"{exc}{hint or ''}") from None
    return cap.Plan(spec, args.kv_dtype, args.tp, pool, per_gpu, swa_full_tokens_ratio=ratio)


#: The most GiB a per-GPU figure may be (64 TiB): beyond it a flag is a typo, and its bytes
#: would overflow the integer conversions (1e308 GiB is infinity in bytes).
MAX_GIB = float(1 << 16)


def _check_gib(value: float | None, flag: str) -> None:
    if value is not None and not 0 < value <= MAX_GIB:  # NaN fails both comparisons
        raise ValueError(f"{flag} must be more than 0 and at most {MAX_GIB:g} GiB, not {value:g}")


def _weight_dtype_hint(spec: cap.ModelSpec, args: argparse.Namespace, gpu_bytes: float) -> str | None:
    """The first narrower ``--weight-dtype`` whose weights leave room for a pool, said as a
    flag to add: weights that do not fit in bf16 often do in fp8 (DeepSeek-V3 ships fp8)."""
    current = cap.DTYPE_BYTES[args.weight_dtype]
    for dtype in sorted((d for d, b in cap.DTYPE_BYTES.items() if b < current), key=cap.DTYPE_BYTES.__getitem__, reverse=True):
        try:
            pool, _ = cap.pool_from_memory(spec, args.tp, gpu_bytes, args.mem_fraction, spec.weight_bytes(cap.DTYPE_BYTES[dtype]))
        except ValueError:
            continue
        return f", or add --weight-dtype {dtype} (its weights leave {pool / cap.GIB:.1f} GiB per GPU for the pool)"
    return None


def plan_json(p: cap.Plan, contexts: tuple[int, ...]) -> dict:
    """The documented ``capacity --json`` shape, plus the per-GPU figures named as such."""
    return {
        "model": p.model.name,
        "kv_dtype": p.kv_dtype,
        "tp": p.tp,
        "mla": p.model.mla,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": p.kv_bytes_per_token_per_gpu,
        "pool_bytes_per_gpu": p.pool_bytes_per_gpu,
        "weight_bytes_per_gpu": p.weight_bytes_per_gpu,
        "pool_tokens": p.pool_tokens,
        "concurrency": {str(c): p.concurrency(c) for c in contexts},
        "kv_bytes_per_request": {str(c): p.request_bytes(c) for c in contexts},
        **({"hybrid": _hybrid_json(p)} if p.model.hybrid else {}),
    }


def _hybrid_json(p: cap.Plan) -> dict:
    """A hybrid model's layer kinds and, under SGLang's fixed split, its two pools."""
    m = p.model
    pools = p.swa_pools()
    return {
        "full_attention_layers": m.full_layers,
        "sliding_window_layers": m.swa_layers,
        "sliding_window": m.sliding_window,
        "mamba_layers": m.mamba_layers,
        "mamba_state_bytes_per_request": m.mamba_layers * m.mamba_state_bytes,
        "swa_full_tokens_ratio": p.swa_full_tokens_ratio,
        "full_pool_tokens": pools[0] if pools else None,
        "swa_pool_tokens": pools[1] if pools else None,
    }


def _hybrid_line(p: cap.Plan) -> str:
    m = p.model
    parts = [f"{m.full_layers} full-attention layers"]
    if m.swa_layers:
        parts.append(f"{m.swa_layers} sliding-window layers (at most {m.sliding_window:,} tokens per request each)")
    if m.mamba_layers:
        parts.append(f"{m.mamba_layers} Mamba layers ({m.mamba_layers * m.mamba_state_bytes / cap.MIB:.1f} MiB of state per request)")
    line = "hybrid: " + ", ".join(parts)
    pools = p.swa_pools()
    if pools:
        line += f"; pools at ratio {p.swa_full_tokens_ratio:g}: full {pools[0]:,} tokens, SWA {pools[1]:,} tokens"
    return line


def run(args: argparse.Namespace) -> int:
    contexts = tuple(args.context or DEFAULT_CONTEXTS)
    try:
        if any(c <= 0 for c in contexts):
            raise ValueError("--context must be > 0")
        p = plan(args)
    except ValueError as exc:
        print(f"kvdiag capacity: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(dumps(plan_json(p, contexts), indent=2))
        return 0
    console = Console()
    kind = "MLA latent" if p.model.mla else "K+V"
    console.print(
        f"[bold]{p.model.name}[/bold] {p.kv_dtype} KV ({kind}): {p.kv_bytes_per_token:,} bytes "
        f"({p.kv_bytes_per_token / 1024:.1f} KiB) per token; {p.kv_bytes_per_token_per_gpu:,} per GPU at TP{p.tp}"
    )
    weights = f", after {p.weight_bytes_per_gpu / cap.GIB:.1f} GiB of weights" if p.weight_bytes_per_gpu else ""
    console.print(f"pool: {p.pool_bytes_per_gpu / cap.GIB:.1f} GiB per GPU{weights} = [bold]{p.pool_tokens:,}[/bold] tokens")
    if p.model.hybrid:
        console.print(_hybrid_line(p), highlight=False)
    table = Table(title="concurrency ceiling")
    for col in ("context (in + out)", "KV per request", "max concurrent"):
        table.add_column(col, justify="right")
    for c in contexts:
        table.add_row(f"{c:,}", f"{p.request_bytes(c) / 1e9:.2f} GB", f"{p.concurrency(c):,}")
    console.print(table)
    return 0

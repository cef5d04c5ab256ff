"""Whether a layer runs its fused kernels, and up to how many tokens the shared experts run
inside the routed experts' GEMV: the model's two switches, read from the process environment
(``PDD_FUSED_DECODE``, ``PDD_SHARED_IN_GEMV_TOKENS``) so the engine, the benches and the tests
need nothing else, and settable in-process so a bench can time both paths in one run.

The fused path computes what the unfused one does with the same fp32 arithmetic; what differs is
rounding order (the shared experts' output summed with the routed ones in fp32 before one
rounding, the router's logits summed in another order), within bf16's precision. A value is read
when a step runs, so a CUDA graph keeps the path it was captured with."""

from __future__ import annotations

import os

from pdd_sidecar.switch import switch

PDD_FUSED_DECODE = "PDD_FUSED_DECODE"
PDD_SHARED_IN_GEMV_TOKENS = "PDD_SHARED_IN_GEMV_TOKENS"
PDD_PDL = "PDD_PDL"
_state: dict[str, object] = {}


def fused() -> bool:
    """``PDD_FUSED_DECODE``: ``1`` (default) or ``0``, unless ``set_fused`` said otherwise."""
    if "fused" not in _state:
        _state["fused"] = switch(os.environ, PDD_FUSED_DECODE, True)
    return bool(_state["fused"])


def shared_in_gemv_tokens() -> int:
    """``PDD_SHARED_IN_GEMV_TOKENS`` (default ``SHARED_IN_GEMV_TOKENS``): at batch 16 the shared
    experts apart measured faster (each token's pairs would read the shared weights again), at
    one and two tokens (a speculative verify step's rows) inside."""
    if "shared_tokens" not in _state:
        raw = os.environ.get(PDD_SHARED_IN_GEMV_TOKENS, "").strip() or str(SHARED_IN_GEMV_TOKENS)
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{PDD_SHARED_IN_GEMV_TOKENS}: must be a whole number >= 0, "
                             f"got {raw!r}")
        _state["shared_tokens"] = n
    return int(_state["shared_tokens"])  # type: ignore[call-overload]



def pdl() -> bool:
    """``PDD_PDL``: ``1`` or ``0`` (``PDL_DEFAULT``), unless ``set_fused(pdl=...)`` said otherwise:
    whether the step's Triton kernels launch as programmatic dependents of the kernel before
    them (kernels/pdl.py; Hopper and later only)."""
    if "pdl" not in _state:
        _state["pdl"] = switch(os.environ, PDD_PDL, PDL_DEFAULT)
    return bool(_state["pdl"])


def fused_router() -> bool:
    """Whether the fused path routes with the one-kernel router (default) or with the fp32
    projection and the softmax/top-k kernel apart (``set_fused(router=False)``: the bench's
    same-run comparison)."""
    return fused() and bool(_state.get("router", True))


# 0: cuBLAS. The Triton GEMV measured slower at batch 1 on an H100 (qkv_a 51 % of the HBM read
# rate at its best tiles against cuBLAS's 58 %, o_proj 33 % against 41 %; --gemv-sweep), so it
# only runs when asked (bench/engine.py --fusion on+dense=N)
DENSE_GEMV_TOKENS = 0
# An H100 step at 1k context, engine graph (docs/gpu.md, "Few rows"): 2 rows 4.18 ms with the
# shared experts inside the per-pair GEMV against 5.17 with them apart and the per-expert GEMV;
# the per-pair GEMV also at 3-8 rows (8: 8.63 against 8.77); the per-expert one at 16 (11.68
# against 12.46, an earlier run)
SHARED_IN_GEMV_TOKENS = 2
GROUPED_GEMV_TOKENS = (9, 21)  # --fusion on+grouped=A-B: the per-expert GEMV from A to B tokens
# tests/gpu/test_pdl.py passed on an H100 (bit-identical steps; every kernel waits for a late
# writer); bench/engine.py --fusion on,on+pdl: batch 1 3.41 -> 3.32 ms, 2 rows 4.42 -> 4.37
PDL_DEFAULT = True  # kernels/pdl.py: up to its MAX_ROWS


def grouped_gemv_tokens() -> tuple[int, int]:
    """From and up to how many tokens the fused path runs the routed experts as the per-expert
    GEMV (``grouped_gemv_experts``) rather than the per-pair GEMV or the grouped GEMMs
    (``set_fused(grouped=(A, B))``; an empty range: never)."""
    span: tuple[int, int] = _state.get("grouped", GROUPED_GEMV_TOKENS)  # type: ignore[assignment]
    return span


def dense_gemv_tokens() -> int:
    """Up to how many tokens the fused path runs the dense projections (the stacked query and
    latent one, the output one) as Triton GEMVs rather than cuBLAS (``set_fused(dense=N)``)."""
    return int(_state.get("dense", DENSE_GEMV_TOKENS))  # type: ignore[call-overload]


def set_fused(on: bool | None, shared_tokens: int | None = None,
              router: bool | None = None, dense: int | None = None,
              grouped: tuple[int, int] | None = None, pdl: bool | None = None) -> None:
    """Overrides the environment for this process (``None``: read it again; the router, dense
    and grouped settings back to their defaults)."""
    for key, value in (("fused", on), ("shared_tokens", shared_tokens), ("router", router),
                       ("dense", dense), ("grouped", grouped), ("pdl", pdl)):
        if value is None:
            _state.pop(key, None)
        else:
            _state[key] = value

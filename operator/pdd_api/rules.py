"""Value rules of a PDDeployment spec, each stated once and rendered twice: as a Python check
(`pdd validate`, the admission webhook, the operator) and as a CEL rule of the CRD, with the same
message, so a GitOps dry run, the webhook and the CLI agree word for word.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from pdd_api.models import (
    API_GROUP,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_NGRAM_MAX_N,
    DEFAULT_NGRAM_MIN_N,
    GPU_RESOURCE,
    KV_CACHE_DTYPES,
    MAX_DRAIN_SECONDS,
    MAX_LOCAL_PREFILL_TOKENS,
    OWNED_CONTAINER_FIELDS,
    OWNED_POD_FIELDS,
    ROLES,
    SPECULATIVE_METHODS,
    PDDeploymentSpec,
)
from pdd_api.models_catalog import without_mtp
from pdd_api.quantity import GIB, parse_quantity

MAX_TP = 64
MAX_REPLICAS = 64
MAX_ROUTER_WORKERS = 64  # PDD_ROUTER_WORKERS, the router's bound too
MAX_BLOCK_SIZE = 1024
BLOCK_ALIGN = 16
MAX_KV_CACHE_BLOCKS = 1 << 24  # per rank; far beyond any GPU, short of overflowing anything
# GiB of host KV per rank: a node's memory shared by its GPUs, with room to spare; a byte count
# typed into the field (17179869184 for 16Gi) is caught here instead of at scheduling.
MAX_HOST_KV_CACHE_GIB = 4096
MAX_LATENCY_TARGET_SECONDS = 3600.0
MAX_QUEUED_TOKENS = 1 << 30
# Speculative decoding: tokens drafted per step (a verify step computes k + 1 positions per
# sequence; acceptance falls with each further position, so more rarely pays), and the longest
# ending the n-gram drafter looks up.
MAX_SPECULATIVE_TOKENS = 8
MAX_NGRAM_N = 16
SPECULATIVE = "decode.speculative"
PREFILL_TARGETS = ("ttft", "queuedPromptTokensPerReplica", "promptTokensPerSecondPerReplica")


def default_of(path: str) -> Any:
    """The model's default for a dotted spec path, so rules see what the API server would."""
    model: Any = PDDeploymentSpec
    value: Any = None
    for part in path.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        value = field.get_default(call_default_factory=True)
        annotation = field.annotation
        members = getattr(annotation, "__args__", (annotation,))
        model = next((a for a in members if hasattr(a, "model_fields")), None)
    return value.model_dump() if hasattr(value, "model_dump") else value


def lookup(spec: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path, the model default when absent, None when not reachable."""
    node: Any = spec
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        if part not in node:
            return default_of(path)
        node = node[part]
    return node


def _int(spec: Mapping[str, Any], path: str) -> int | None:
    v = lookup(spec, path)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _number(spec: Mapping[str, Any], path: str) -> float | None:
    v = lookup(spec, path)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def cel_double(x: float) -> str:
    """A double as CEL's `string(double)` and `'%s'.format([double])` write it (Go's
    strconv 'g' with the shortest precision): 1 -> `1`, 0.9 -> `0.9`, 1e6 -> `1e+06`."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if x == 0:
        return sign + "0"
    t = Decimal(repr(abs(x))).normalize().as_tuple()
    digits = "".join(map(str, t.digits))
    nd, dp = len(digits), len(digits) + int(t.exponent)
    e = dp - 1
    if e < -4 or e >= 6:
        mantissa = digits[0] + (f".{digits[1:]}" if nd > 1 else "")
        return f"{sign}{mantissa}e{'+' if e >= 0 else '-'}{abs(e):02d}"
    if dp <= 0:
        return f"{sign}0.{'0' * -dp}{digits}"
    if dp >= nd:
        return sign + digits + "0" * (dp - nd)
    return f"{sign}{digits[:dp]}.{digits[dp:]}"


def _cel(field: str, rule: str, message: str, reason: str = "FieldValueInvalid") -> dict[str, str]:
    """One x-kubernetes-validations entry, reported at the field it is about."""
    return {"rule": rule, "messageExpression": message, "fieldPath": f".{field}", "reason": reason}


def _fmt(template: str, *args: str) -> str:
    """A CEL messageExpression. `'..' + string(int)` is refused by the API server's cost
    estimator (unbounded string size); `format` is not."""
    return f"'{template}'.format([{', '.join(args)}])"


def _cel_guard(path: str) -> str:
    """`!has(self.a) || !has(self.a.b) || ` for spec path a.b."""
    parts = path.split(".")
    return "".join(f"!has(self.{'.'.join(parts[: i + 1])}) || " for i in range(len(parts)))


class Rule(Protocol):
    @property
    def field(self) -> str: ...  # dotted path under spec

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]: ...  # integers the CEL rule evaluates

    def check(self, spec: Mapping[str, Any]) -> str | None: ...

    def cel(self) -> dict[str, str]: ...


def _path(dotted: str, *more: str) -> tuple[str, ...]:
    return (*dotted.split("."), *more)


@dataclass(frozen=True)
class RangeRule:
    field: str
    lo: int
    hi: int

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field),)

    def check(self, spec: Mapping[str, Any]) -> str | None:
        v = _int(spec, self.field)
        if v is None or self.lo <= v <= self.hi:
            return None
        return f"spec.{self.field}: must be between {self.lo} and {self.hi}, got {v}"

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}({f} >= {self.lo} && {f} <= {self.hi})",
            _fmt(
                f"spec.{self.field}: must be between {self.lo} and {self.hi}, got %d", f
            ),
        )


@dataclass(frozen=True)
class DcpRule:
    """Per side, KV is either replicated (dcp 1) or fully sharded (dcp == tp); never partial."""

    role: str

    @property
    def field(self) -> str:
        return f"{self.role}.decodeContextParallelSize"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field), _path(f"{self.role}.tensorParallelSize"))

    def check(self, spec: Mapping[str, Any]) -> str | None:
        dcp, tp = _int(spec, self.field), _int(spec, f"{self.role}.tensorParallelSize")
        if dcp is None or tp is None or tp < 1 or dcp in (1, tp):
            return None
        return (
            f"spec.{self.field}: must be 1 or equal to tensorParallelSize ({tp}), got {dcp}"
        )

    def cel(self) -> dict[str, str]:
        d, t = f"self.{self.field}", f"self.{self.role}.tensorParallelSize"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}!has({t}) || {t} < 1 || {d} == 1 || {d} == {t}",
            _fmt(
                f"spec.{self.field}: must be 1 or equal to tensorParallelSize (%d), got %d", t, d
            ),
        )


def _vllm(spec: Mapping[str, Any]) -> bool:
    return lookup(spec, "engine") == "vllm"


_CEL_NOT_VLLM = "!has(self.engine) || self.engine != 'vllm' || "


@dataclass(frozen=True)
class DivideEitherWayRule:
    """Two sizes of which one divides the other. The two sides' DCP sizes, so plain modulo
    routing is exact; with ``vllm_only``, the TP sizes for vLLM, whose NIXL routing maps ranks
    by the TP ratio and has no answer for, say, P TP2 -> D TP3, which pdd's own sidecars do
    serve. (vLLM's other rule, dcp divides tp, follows from DcpRule.)"""

    field: str
    other: str
    vllm_only: bool = False

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field), _path(self.other))

    @property
    def _words(self) -> str:
        return "with engine vllm, " if self.vllm_only else ""

    def check(self, spec: Mapping[str, Any]) -> str | None:
        d, p = _int(spec, self.field), _int(spec, self.other)
        if ((self.vllm_only and not _vllm(spec)) or d is None or p is None or d < 1 or p < 1
                or d % p == 0 or p % d == 0):
            return None
        return (
            f"spec.{self.field}: {self._words}must divide or be a multiple of "
            f"spec.{self.other} ({p}), got {d}"
        )

    def cel(self) -> dict[str, str]:
        d, p = f"self.{self.field}", f"self.{self.other}"
        return _cel(
            self.field,
            f"{_CEL_NOT_VLLM if self.vllm_only else ''}"
            f"{_cel_guard(self.field)}{_cel_guard(self.other)}"
            f"{d} < 1 || {p} < 1 || {d} % {p} == 0 || {p} % {d} == 0",
            _fmt(
                f"spec.{self.field}: {self._words}must divide or be a multiple of "
                f"spec.{self.other} (%d), got %d",
                p,
                d,
            ),
        )


@dataclass(frozen=True)
class SameOnBothRolesRule:
    """A value prefill and decode must share: the KV cache dtype, since the hand-off moves a
    prefill's blocks byte for byte into the decode's pool (a bf16 block read as FP8 is garbage,
    vLLM's crash in vllm#23587). Only values the field allows are compared, so a misspelt one
    gets the schema's message alone."""

    name: str
    allowed: tuple[str, ...]
    default: str
    reads: tuple[tuple[str, ...], ...] = ()

    @property
    def field(self) -> str:
        return f"decode.{self.name}"

    @property
    def _head(self) -> str:
        return f"spec.{self.field}: must equal spec.prefill.{self.name}"

    def check(self, spec: Mapping[str, Any]) -> str | None:
        p, d = lookup(spec, f"prefill.{self.name}"), lookup(spec, self.field)
        if p not in self.allowed or d not in self.allowed or p == d:
            return None
        return f"{self._head} ({p}), got {d}"

    def cel(self) -> dict[str, str]:
        p, d = (f"(has(self.{r}) && has(self.{r}.{self.name}) ? self.{r}.{self.name} : "
                f"'{self.default}')" for r in ("prefill", "decode"))
        allowed = "[" + ", ".join(f"'{v}'" for v in self.allowed) + "]"
        return _cel(
            self.field,
            f"!({p} in {allowed}) || !({d} in {allowed}) || {p} == {d}",
            _fmt(f"{self._head} (%s), got %s", p, d),
        )


@dataclass(frozen=True)
class NgramOrderRule:
    """The n-gram drafter tries endings from maxN down to minN tokens: minN above maxN tries
    none, and the sidecar's NgramConfig refuses it."""

    field: str = f"{SPECULATIVE}.ngram.minN"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field), _path(f"{SPECULATIVE}.ngram.maxN"))

    def check(self, spec: Mapping[str, Any]) -> str | None:
        if not isinstance(lookup(spec, f"{SPECULATIVE}.ngram"), Mapping):
            return None
        lo, hi = _int(spec, self.field), _int(spec, f"{SPECULATIVE}.ngram.maxN")
        if lo is None or hi is None or lo <= hi:
            return None
        return f"spec.{self.field}: must not exceed maxN ({hi}), got {lo}"

    def cel(self) -> dict[str, str]:
        n = f"self.{SPECULATIVE}.ngram"
        lo = f"(has({n}.minN) ? {n}.minN : {DEFAULT_NGRAM_MIN_N})"
        hi = f"(has({n}.maxN) ? {n}.maxN : {DEFAULT_NGRAM_MAX_N})"
        return _cel(
            self.field,
            f"{_cel_guard(f'{SPECULATIVE}.ngram')}{lo} <= {hi}",
            _fmt(f"spec.{self.field}: must not exceed maxN (%d), got %d", hi, lo),
        )


@dataclass(frozen=True)
class NgramOnlyRule:
    """The n-gram lengths mean nothing to an MTP drafter: said rather than ignored."""

    field: str = f"{SPECULATIVE}.ngram"
    reads: tuple[tuple[str, ...], ...] = ()

    others: tuple[str, ...] = tuple(m for m in SPECULATIVE_METHODS if m != "ngram")

    def check(self, spec: Mapping[str, Any]) -> str | None:
        method = lookup(spec, f"{SPECULATIVE}.method")
        if not isinstance(lookup(spec, self.field), Mapping) or method not in self.others:
            return None  # a misspelt method gets the schema's message alone
        return f"spec.{self.field}: only with method ngram, got method {method}"

    def cel(self) -> dict[str, str]:
        s = f"self.{SPECULATIVE}"
        others = "[" + ", ".join(f"'{m}'" for m in self.others) + "]"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}!has({s}.method) || !({s}.method in {others})",
            _fmt(f"spec.{self.field}: only with method ngram, got method %s", f"{s}.method"),
        )


_WITHOUT_MTP = without_mtp()
_MODEL_NAME = "self.model.name"


def _lacks_mtp(name: Any) -> bool:
    """A model name the catalog knows to lack an MTP module, with or without an owner."""
    return isinstance(name, str) and any(name == b or name.endswith(f"/{b}")
                                         for b in _WITHOUT_MTP)


def _cel_lacks_mtp() -> str:
    """:func:`_lacks_mtp` of spec.model.name in CEL (false when it is unset)."""
    n, known = _MODEL_NAME, "[" + ", ".join(f"'{b}'" for b in _WITHOUT_MTP) + "]"
    return (f"(has(self.model) && has({n}) && "
            f"{known}.exists(b, {n} == b || {n}.endsWith('/' + b)))")


@dataclass(frozen=True)
class MtpModelRule:
    """mtp drafts with the checkpoint's own multi-token-prediction module: DeepSeek-V3/R1 carry
    one, V2 and V2-Lite none. The validators know a model by its name (models_catalog.py), so
    they refuse the names known to lack it; for a name they do not know only the checkpoint's
    config (num_nextn_predict_layers) can say, which the decode reads when it loads. Both roles
    serve spec.model, so the prefill runs the model whose module the decode drafts with."""

    field: str = f"{SPECULATIVE}.method"
    reads: tuple[tuple[str, ...], ...] = ()

    @staticmethod
    def _words(name: str) -> str:
        return (f"spec.{SPECULATIVE}.method: mtp needs a checkpoint with a multi-token-"
                f"prediction module (DeepSeek-V3/R1: num_nextn_predict_layers 1), and {name} "
                "has none; use ngram")

    def check(self, spec: Mapping[str, Any]) -> str | None:
        name = lookup(spec, "model.name")
        if lookup(spec, self.field) != "mtp" or not _lacks_mtp(name):
            return None
        return self._words(name)

    def cel(self) -> dict[str, str]:
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}self.{self.field} != 'mtp' || !{_cel_lacks_mtp()}",
            _fmt(self._words("%s"), _MODEL_NAME),
        )


@dataclass(frozen=True)
class VllmRouterImageRule:
    """With engine vllm, spec.image is a vLLM image, which has no pdd router in it."""

    field: str = "router.image"
    reads: tuple[tuple[str, ...], ...] = ()
    message: str = ("spec.router.image: required with engine vllm (spec.image is then a vLLM "
                    "image; the router needs a pdd image)")

    def check(self, spec: Mapping[str, Any]) -> str | None:
        if not _vllm(spec) or lookup(spec, "router.enabled") is not True:
            return None
        image = lookup(spec, self.field)
        return self.message if image is None or image == "" else None

    def cel(self) -> dict[str, str]:
        r = "self.router"
        return _cel(
            self.field,
            f"{_CEL_NOT_VLLM}(has({r}) && ((has({r}.enabled) && !{r}.enabled) || "
            f"(has({r}.image) && {r}.image.size() > 0)))",
            f"'{self.message}'", reason="FieldValueRequired",
        )


@dataclass(frozen=True)
class BlockSizeRule:
    field: str = "blockSize"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field),)

    def check(self, spec: Mapping[str, Any]) -> str | None:
        v = _int(spec, self.field)
        if v is None or (0 < v <= MAX_BLOCK_SIZE and v % BLOCK_ALIGN == 0):
            return None
        return (
            f"spec.{self.field}: must be a positive multiple of {BLOCK_ALIGN} and at most "
            f"{MAX_BLOCK_SIZE}, got {v}"
        )

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}({f} > 0 && {f} <= {MAX_BLOCK_SIZE} && "
            f"{f} % {BLOCK_ALIGN} == 0)",
            _fmt(
                f"spec.{self.field}: must be a positive multiple of {BLOCK_ALIGN} and at most "
                f"{MAX_BLOCK_SIZE}, got %d",
                f,
            ),
        )


@dataclass(frozen=True)
class GpuRule:
    """One GPU per TP rank: a GPU count that differs from the ranks of a pod (gpusPerPod, else
    tensorParallelSize) strands GPUs or starves ranks."""

    role: str
    kind: str  # limits | requests

    @property
    def field(self) -> str:
        return f"{self.role}.resources.{self.kind}"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field, GPU_RESOURCE), _path(f"{self.role}.tensorParallelSize"),
                _path(f"{self.role}.gpusPerPod"))

    def check(self, spec: Mapping[str, Any]) -> str | None:
        amounts = lookup(spec, self.field)
        tp = _int(spec, f"{self.role}.tensorParallelSize")
        if not isinstance(amounts, Mapping) or GPU_RESOURCE not in amounts or tp is None:
            return None
        per_pod = _int(spec, f"{self.role}.gpusPerPod")
        want, name = (tp, "tensorParallelSize") if per_pod is None else (per_pod, "gpusPerPod")
        v = amounts[GPU_RESOURCE]
        if str(v) == str(want):
            return None
        return f"spec.{self.field}[{GPU_RESOURCE}]: must equal {name} ({want}), got {v}"

    def cel(self) -> dict[str, str]:
        m, t = f"self.{self.field}", f"self.{self.role}.tensorParallelSize"
        g = f"self.{self.role}.gpusPerPod"
        v = f"{m}['{GPU_RESOURCE}']"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}!has({t}) || !('{GPU_RESOURCE}' in {m}) || "
            f"string({v}) == (has({g}) ? string({g}) : string({t}))",
            _fmt(f"spec.{self.field}[{GPU_RESOURCE}]: must equal %s (%d), got %s",
                 f"has({g}) ? 'gpusPerPod' : 'tensorParallelSize'", f"has({g}) ? {g} : {t}", v),
        )


@dataclass(frozen=True)
class GpusPerPodRule:
    """An instance is cut into equal pods (a LeaderWorkerSet group): pod k holds ranks
    k*g .. k*g+g-1, so g must divide the instance's TP."""

    role: str

    @property
    def field(self) -> str:
        return f"{self.role}.gpusPerPod"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field), _path(f"{self.role}.tensorParallelSize"))

    def check(self, spec: Mapping[str, Any]) -> str | None:
        g, tp = _int(spec, self.field), _int(spec, f"{self.role}.tensorParallelSize")
        if g is None or tp is None or g < 1 or tp < 1 or tp % g == 0:
            return None
        return f"spec.{self.field}: must divide tensorParallelSize ({tp}), got {g}"

    def cel(self) -> dict[str, str]:
        g, t = f"self.{self.field}", f"self.{self.role}.tensorParallelSize"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}!has({t}) || {g} < 1 || {t} < 1 || {t} % {g} == 0",
            _fmt(f"spec.{self.field}: must divide tensorParallelSize (%d), got %d", t, g),
        )


@dataclass(frozen=True)
class VllmOnePodRule:
    """pdd renders vLLM instances as one pod each: vLLM spans nodes with its own launcher
    (Ray or its multi-node flags), which the vLLM builder does not drive."""

    role: str

    @property
    def field(self) -> str:
        return f"{self.role}.gpusPerPod"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field), _path(f"{self.role}.tensorParallelSize"))

    def check(self, spec: Mapping[str, Any]) -> str | None:
        g, tp = _int(spec, self.field), _int(spec, f"{self.role}.tensorParallelSize")
        if not _vllm(spec) or g is None or tp is None or g == tp:
            return None
        return f"spec.{self.field}: with engine vllm, must equal tensorParallelSize ({tp}), got {g}"

    def cel(self) -> dict[str, str]:
        g, t = f"self.{self.field}", f"self.{self.role}.tensorParallelSize"
        return _cel(
            self.field,
            f"{_CEL_NOT_VLLM}{_cel_guard(self.field)}!has({t}) || {g} == {t}",
            _fmt(f"spec.{self.field}: with engine vllm, must equal tensorParallelSize (%d), "
                 "got %d", t, g),
        )


@dataclass(frozen=True)
class NonEmptyRule:
    field: str
    reads: tuple[tuple[str, ...], ...] = ()

    def check(self, spec: Mapping[str, Any]) -> str | None:
        v = lookup(spec, self.field)
        if not isinstance(v, str) or v:
            return None
        return f"spec.{self.field}: must not be empty"

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}{f}.size() > 0",
            f"'spec.{self.field}: must not be empty'", reason="FieldValueRequired",
        )


@dataclass(frozen=True)
class NumberRangeRule:
    """A number (a double in CEL) in [lo, hi], or in (lo, hi] with ``open_low``."""

    field: str
    lo: float
    hi: float
    open_low: bool = False
    reads: tuple[tuple[str, ...], ...] = ()
    open_high: bool = False

    @property
    def _range(self) -> str:
        lo, hi = cel_double(self.lo), cel_double(self.hi)
        if self.open_low or self.open_high:
            return (f"in {'(' if self.open_low else '['}{lo}, {hi}"
                    f"{')' if self.open_high else ']'}")
        return f"between {lo} and {hi}"

    def check(self, spec: Mapping[str, Any]) -> str | None:
        v = _number(spec, self.field)
        if v is None or ((self.lo < v if self.open_low else self.lo <= v)
                         and (v < self.hi if self.open_high else v <= self.hi)):
            return None
        return f"spec.{self.field}: must be {self._range}, got {cel_double(v)}"

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        low = ">" if self.open_low else ">="
        high = "<" if self.open_high else "<="
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}({f} {low} {float(self.lo)!r} && "
            f"{f} {high} {float(self.hi)!r})",
            _fmt(f"spec.{self.field}: must be {self._range}, got %s", f),
        )


@dataclass(frozen=True)
class MinMaxRule:
    """An autoscaled role's bounds: a planner between min and max needs min <= max."""

    role: str

    @property
    def field(self) -> str:
        return f"autoscaling.{self.role}.minReplicas"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(self.field), _path(f"autoscaling.{self.role}.maxReplicas"))

    def check(self, spec: Mapping[str, Any]) -> str | None:
        if not isinstance(lookup(spec, f"autoscaling.{self.role}"), Mapping):
            return None
        lo, hi = _int(spec, self.field), _int(spec, f"autoscaling.{self.role}.maxReplicas")
        if lo is None or hi is None or lo <= hi:
            return None
        return f"spec.{self.field}: must not exceed maxReplicas ({hi}), got {lo}"

    def cel(self) -> dict[str, str]:
        a = f"self.autoscaling.{self.role}"
        lo, hi = f"{a}.minReplicas", f"{a}.maxReplicas"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}!has({hi}) || {lo} <= {hi}",
            _fmt(f"spec.{self.field}: must not exceed maxReplicas (%d), got %d", hi, lo),
        )


@dataclass(frozen=True)
class PrefillTargetRule:
    """Prefill's planner scales up on TTFT or on queued prompt tokens; with neither it could
    only ever scale down."""

    field: str = "autoscaling.prefill"
    reads: tuple[tuple[str, ...], ...] = ()
    message: str = ("spec.autoscaling.prefill: needs a target, ttft, "
                    "queuedPromptTokensPerReplica or promptTokensPerSecondPerReplica, when "
                    "enabled")

    def check(self, spec: Mapping[str, Any]) -> str | None:
        node = lookup(spec, self.field)
        if not isinstance(node, Mapping) or node.get("enabled", True) is False:
            return None
        return None if any(k in node for k in PREFILL_TARGETS) else self.message

    def cel(self) -> dict[str, str]:
        a = f"self.{self.field}"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}(has({a}.enabled) && !{a}.enabled) || "
            + " || ".join(f"has({a}.{k})" for k in PREFILL_TARGETS),
            f"'{self.message}'", reason="FieldValueRequired",
        )


@dataclass(frozen=True)
class UrlRule:
    field: str
    reads: tuple[tuple[str, ...], ...] = ()

    def check(self, spec: Mapping[str, Any]) -> str | None:
        v = lookup(spec, self.field)
        if not isinstance(v, str) or v.startswith(("http://", "https://")):
            return None
        return f"spec.{self.field}: must start with http:// or https://, got {v}"

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        return _cel(
            self.field,
            f"{_cel_guard(self.field)}{f}.startsWith('http://') || {f}.startsWith('https://')",
            _fmt(f"spec.{self.field}: must start with http:// or https://, got %s", f),
        )


@dataclass(frozen=True)
class VllmHostTierRule:
    """The host KV tier is pdd's sidecars' own. vLLM's CPU offloading is a KV connector of its
    own, and the one connector pdd's vLLM pods get is NixlConnector (the P/D hand-off)."""

    role: str
    reads: tuple[tuple[str, ...], ...] = ()

    @property
    def field(self) -> str:
        return f"{self.role}.hostKVCacheGiB"

    @property
    def _words(self) -> str:
        return (f"spec.{self.field}: with engine vllm, must be 0 (the host KV cache tier is "
                "served by pdd sidecars only), got")

    def check(self, spec: Mapping[str, Any]) -> str | None:
        v = _number(spec, self.field)
        if not _vllm(spec) or v is None or v == 0:
            return None
        return f"{self._words} {cel_double(v)}"

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        return _cel(self.field, f"{_CEL_NOT_VLLM}{_cel_guard(self.field)}{f} == 0.0",
                    _fmt(f"{self._words} %s", f))


@dataclass(frozen=True)
class HostKVMemoryRule:
    """The host tier is pinned memory in the sidecar's container: the operator adds
    hostKVCacheGiB x ranks per pod to the memory the spec gives it. A memory limit below the
    tier alone is refused: it was written as the pod's total, tier included, and would leave
    the tier room only with the rest of the container squeezed out. Quantities are compared
    as the API server's CEL compares them (quantity.py)."""

    role: str

    @property
    def field(self) -> str:
        return f"{self.role}.resources.limits.memory"

    @property
    def reads(self) -> tuple[tuple[str, ...], ...]:
        return (_path(f"{self.role}.tensorParallelSize"), _path(f"{self.role}.gpusPerPod"))

    def _head(self) -> str:
        return f"spec.{self.field}:"

    def reads_in(self, spec: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
        """The memory limit is read only where there is a host tier (the rule's first
        clauses): only there does an integral float in it fail CEL (`pdd validate` then keeps
        it a float, which the models refuse, as for every integer a rule reads)."""
        gib = _number(spec, f"{self.role}.hostKVCacheGiB")
        return (_path(self.field),) if gib is not None and gib > 0 else ()

    def check(self, spec: Mapping[str, Any]) -> str | None:
        gib = _number(spec, f"{self.role}.hostKVCacheGiB")
        limits = lookup(spec, f"{self.role}.resources.limits")
        if gib is None or not gib > 0 or not isinstance(limits, Mapping):
            return None
        raw = limits.get("memory")
        per_pod = _int(spec, f"{self.role}.gpusPerPod")
        ranks = per_pod if per_pod is not None else _int(
            spec, f"{self.role}.tensorParallelSize")
        if isinstance(raw, bool) or not isinstance(raw, int | str) or ranks is None:
            return None
        limit = parse_quantity(str(raw))
        if limit is None or limit.approximate_float() >= gib * float(ranks) * float(GIB):
            return None
        return (f"{self._head()} {raw} is less than the host KV cache needs (hostKVCacheGiB "
                f"{cel_double(gib)} × {ranks} {'rank' if ranks == 1 else 'ranks'} per pod = "
                f"{cel_double(gib * float(ranks))}Gi)")

    def cel(self) -> dict[str, str]:
        r = f"self.{self.role}"
        limits = f"{r}.resources.limits"
        memory = f"string({limits}['memory'])"
        ranks = f"(has({r}.gpusPerPod) ? {r}.gpusPerPod : {r}.tensorParallelSize)"
        need = f"{r}.hostKVCacheGiB * double({ranks})"
        return _cel(
            self.field,
            f"!has({r}) || !has({r}.hostKVCacheGiB) || {r}.hostKVCacheGiB <= 0.0 || "
            f"!has({r}.resources) || !has({limits}) || !('memory' in {limits}) || "
            f"!has({r}.tensorParallelSize) || !isQuantity({memory}) || "
            f"quantity({memory}).asApproximateFloat() >= {need} * {float(GIB)!r}",
            _fmt(f"{self._head()} %s is less than the host KV cache needs (hostKVCacheGiB %s "
                 "× %d %s per pod = %sGi)", memory, f"{r}.hostKVCacheGiB", ranks,
                 f"{ranks} == 1 ? 'rank' : 'ranks'", need),
        )


def conditional_reads(spec: Mapping[str, Any]) -> frozenset[tuple[str, ...]]:
    """Integers a CEL rule reads in this spec beyond every rule's `reads`."""
    return frozenset(p for role in ROLES for p in HostKVMemoryRule(role).reads_in(spec))


TEMPLATE_ROLES = (*ROLES, "router")
MAIN_CONTAINER = {"prefill": "sidecar", "decode": "sidecar", "router": "router"}
_LABEL_PREFIXES = ("app.kubernetes.io/", f"{API_GROUP}/")


def _template_part(spec: Mapping[str, Any], role: str, part: str) -> Mapping[str, Any] | None:
    node = lookup(spec, f"{role}.template.{part}")
    return node if isinstance(node, Mapping) else None


@dataclass(frozen=True)
class TemplateOwnedRule:
    """A template adds to the pods; it cannot change what makes them the operator's (the DNS
    name the side channel is found by, the restart policy, the sidecar's image, command and
    ports, the labels the Services, the router and status select by)."""

    role: str
    part: str  # "pod" | "container" | "metadata"
    reads: tuple[tuple[str, ...], ...] = ()

    @property
    def field(self) -> str:
        return f"{self.role}.template.{'metadata' if self.part == 'metadata' else 'spec'}"

    @property
    def message(self) -> str:
        main = MAIN_CONTAINER[self.role]
        if self.part == "pod":
            return (f"spec.{self.field}: {', '.join(OWNED_POD_FIELDS)} are set by the operator "
                    "and cannot be overridden")
        if self.part == "container":
            return (f"spec.{self.field}.containers[{main}]: "
                    f"{', '.join(OWNED_CONTAINER_FIELDS)} are set by the operator and cannot be "
                    "overridden")
        return (f"spec.{self.field}: labels app.kubernetes.io/* and {API_GROUP}/* and "
                f"annotations {API_GROUP}/* are set by the operator")

    def check(self, spec: Mapping[str, Any]) -> str | None:
        node = _template_part(spec, self.role, "metadata" if self.part == "metadata"
                              else "spec")
        if node is None:
            return None
        if self.part == "pod":
            bad = any(f in node for f in OWNED_POD_FIELDS)
        elif self.part == "container":
            containers = node.get("containers")
            bad = isinstance(containers, list) and any(
                isinstance(c, Mapping) and c.get("name") == MAIN_CONTAINER[self.role]
                and any(f in c for f in OWNED_CONTAINER_FIELDS) for c in containers)
        else:
            labels, annotations = node.get("labels"), node.get("annotations")
            bad = (isinstance(labels, Mapping) and any(
                str(k).startswith(_LABEL_PREFIXES) for k in labels)) or (
                isinstance(annotations, Mapping) and any(
                    str(k).startswith(f"{API_GROUP}/") for k in annotations))
        return self.message if bad else None

    def cel(self) -> dict[str, str]:
        f = f"self.{self.field}"
        guard = _cel_guard(self.field)
        if self.part == "pod":
            rule = " && ".join(f"!has({f}.{o})" for o in OWNED_POD_FIELDS)
        elif self.part == "container":
            owned = " && ".join(f"!has(c.{o})" for o in OWNED_CONTAINER_FIELDS)
            rule = (f"!has({f}.containers) || {f}.containers.all(c, "
                    f"c.name != '{MAIN_CONTAINER[self.role]}' || ({owned}))")
        else:
            lp = " && ".join(f"!k.startsWith('{p}')" for p in _LABEL_PREFIXES)
            rule = (f"(!has({f}.labels) || {f}.labels.all(k, {lp})) && "
                    f"(!has({f}.annotations) || {f}.annotations.all(k, "
                    f"!k.startsWith('{API_GROUP}/')))")
        return _cel(self.field, f"{guard}({rule})", f"'{self.message}'",
                    reason="FieldValueForbidden")


def _rules() -> tuple[Rule, ...]:
    rules: list[Rule] = [NonEmptyRule("model.name"), NonEmptyRule("image"), BlockSizeRule()]
    for role in ROLES:
        rules += [
            RangeRule(f"{role}.replicas", 1, MAX_REPLICAS),
            RangeRule(f"{role}.tensorParallelSize", 1, MAX_TP),
            DcpRule(role),
            RangeRule(f"{role}.gpusPerPod", 1, MAX_TP),
            GpusPerPodRule(role),
            VllmOnePodRule(role),
            GpuRule(role, "limits"),
            GpuRule(role, "requests"),
            NumberRangeRule(f"{role}.gpuMemoryUtilization", 0, 1, open_low=True),
            RangeRule(f"{role}.kvCacheBlocks", 1, MAX_KV_CACHE_BLOCKS),
            NumberRangeRule(f"{role}.hostKVCacheGiB", 0, MAX_HOST_KV_CACHE_GIB),
            RangeRule(f"{role}.drainSeconds", 1, MAX_DRAIN_SECONDS),
            VllmHostTierRule(role),
            HostKVMemoryRule(role),
        ]
    rules += [
        DivideEitherWayRule("decode.decodeContextParallelSize",
                            "prefill.decodeContextParallelSize"),
        DivideEitherWayRule("decode.tensorParallelSize", "prefill.tensorParallelSize",
                            vllm_only=True),
        SameOnBothRolesRule("kvCacheDtype", KV_CACHE_DTYPES, DEFAULT_KV_CACHE_DTYPE),
        RangeRule(f"{SPECULATIVE}.tokens", 1, MAX_SPECULATIVE_TOKENS),
        RangeRule(f"{SPECULATIVE}.ngram.maxN", 1, MAX_NGRAM_N),
        RangeRule(f"{SPECULATIVE}.ngram.minN", 1, MAX_NGRAM_N),
        NgramOrderRule(),
        NgramOnlyRule(),
        MtpModelRule(),
        VllmRouterImageRule(),
        RangeRule("kvTransfer.sideChannelPort", 1024, 65535 - MAX_TP),
        RangeRule("router.replicas", 1, 16),
        RangeRule("router.workers", 1, MAX_ROUTER_WORKERS),
        RangeRule("router.localPrefillTokens", 0, MAX_LOCAL_PREFILL_TOKENS),
        RangeRule("rollout.maxUnavailable", 1, MAX_REPLICAS),
    ]
    for role in ROLES:
        a = f"autoscaling.{role}"
        rules += [
            RangeRule(f"{a}.minReplicas", 1, MAX_REPLICAS),
            RangeRule(f"{a}.maxReplicas", 1, MAX_REPLICAS),
            MinMaxRule(role),
        ]
    for latency in ("prefill.ttft", "decode.tpot"):
        rules += [
            NumberRangeRule(f"autoscaling.{latency}.percentile", 0, 100, open_low=True,
                            open_high=True),
            NumberRangeRule(f"autoscaling.{latency}.seconds", 0, MAX_LATENCY_TARGET_SECONDS,
                            open_low=True),
        ]
    rules += [
        PrefillTargetRule(),
        RangeRule("autoscaling.prefill.queuedPromptTokensPerReplica", 1, MAX_QUEUED_TOKENS),
        RangeRule("autoscaling.prefill.promptTokensPerSecondPerReplica", 1, MAX_QUEUED_TOKENS),
        RangeRule("autoscaling.decode.sequencesPerReplica", 1, MAX_QUEUED_TOKENS),
        NumberRangeRule("autoscaling.decode.kvCacheUtilization", 0, 1, open_low=True),
        RangeRule("autoscaling.intervalSeconds", 1, 3600),
        RangeRule("autoscaling.scaleDownStabilizationSeconds", 0, 86400),
        UrlRule("autoscaling.prometheusURL"),
        UrlRule("tracing.endpoint"),
        NumberRangeRule("tracing.samplingRatio", 0, 1),
    ]
    rules += [TemplateOwnedRule(role, part) for role in TEMPLATE_ROLES
              for part in ("pod", "container", "metadata")]
    return tuple(rules)


RULES: tuple[Rule, ...] = _rules()


# A PDDRoleScale's spec.replicas: the range of a role's, said the same way by its CRD (as
# minimum and maximum) and by `pdd validate`.
ROLE_SCALE_REPLICAS = RangeRule("replicas", 1, MAX_REPLICAS)


def check_rules(spec: Mapping[str, Any]) -> list[str]:
    """Trimmed as the API server trims a messageExpression (`got ''` ends in `got`)."""
    return [m.strip() for m in (r.check(spec) for r in RULES) if m is not None]

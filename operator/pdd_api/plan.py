"""The routing plan (contract: docs/architecture.md "Plan JSON"), shared by the operator and
the sidecars."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from pdd_api.models import DEFAULT_KV_CACHE_DTYPE, KvCacheDtype

RoutingCase = Literal[
    "replicated-to-replicated",
    "replicated-to-sharded",
    "sharded-to-replicated",
    "sharded-to-sharded",
]


class _Camel(BaseModel):
    """JSON speaks camelCase (the contract); Python speaks snake_case."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class SidePlan(_Camel):
    tensor_parallel_size: int = Field(ge=1)
    decode_context_parallel_size: int = Field(ge=1)

    @property
    def sharded(self) -> bool:
        return self.decode_context_parallel_size > 1


class ChunkRead(_Camel):
    """Chunks g with g % chunk_modulus == chunk_residue, read from one prefill rank."""

    prefill_rank: int = Field(ge=0)
    chunk_modulus: int = Field(ge=1)
    chunk_residue: int = Field(ge=0)

    def covers(self, chunk: int) -> bool:
        return chunk % self.chunk_modulus == self.chunk_residue


class DecodeRankPlan(_Camel):
    rank: int = Field(ge=0)
    reads: list[ChunkRead]
    notifies: list[int]


class PrefillRankPlan(_Camel):
    rank: int = Field(ge=0)
    expected_notifications: int = Field(ge=1)


class RoutingPlan(_Camel):
    version: Literal[1] = 1
    case: RoutingCase
    block_size: int = Field(ge=1)
    # What both sides' KV cache keeps a token in (spec.<role>.kvCacheDtype, which the validators
    # hold equal): the plan hash then tells an FP8 pod from a bf16 one, so the router never
    # pairs them. Left out of the JSON for auto, so plans of specs without it stay as they were.
    kv_cache_dtype: KvCacheDtype = DEFAULT_KV_CACHE_DTYPE
    prefill: SidePlan
    decode: SidePlan
    decode_ranks: list[DecodeRankPlan]
    prefill_ranks: list[PrefillRankPlan]

    def to_json(self) -> str:
        auto = self.kv_cache_dtype == DEFAULT_KV_CACHE_DTYPE
        return self.model_dump_json(by_alias=True, exclude={"kv_cache_dtype"} if auto else None)

    @classmethod
    def from_json(cls, text: str | bytes) -> RoutingPlan:
        """Parse a routing file; a sidecar must refuse a plan it cannot follow exactly."""
        try:
            plan = cls.model_validate_json(text)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ValueError(f"malformed routing plan: {problems}") from None
        if len(plan.decode_ranks) != plan.decode.tensor_parallel_size:
            raise ValueError(
                f"malformed routing plan: decodeRanks has {len(plan.decode_ranks)} entries, "
                f"decode.tensorParallelSize is {plan.decode.tensor_parallel_size}"
            )
        if len(plan.prefill_ranks) != plan.prefill.tensor_parallel_size:
            raise ValueError(
                f"malformed routing plan: prefillRanks has {len(plan.prefill_ranks)} entries, "
                f"prefill.tensorParallelSize is {plan.prefill.tensor_parallel_size}"
            )
        return plan

    def reads_of(self, decode_rank: int) -> list[ChunkRead]:
        return self.decode_ranks[decode_rank].reads

    def summary(self) -> str:
        """One line a person reads in `kubectl get/describe`: `D0 <- P0,P2; D1 <- P1,P3`."""
        return "; ".join(
            f"D{d.rank} <- " + ",".join(f"P{r.prefill_rank}" for r in d.reads)
            for d in self.decode_ranks
        )

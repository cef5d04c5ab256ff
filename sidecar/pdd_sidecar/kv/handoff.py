"""The P->D hand-off parameters (`kv_transfer_params`): one typed record, written and signed by a
prefill, verified and parsed once by a decode, and carried as is to every decode rank.

The wire format is the grant of kv/grants.py (its JSON keys, signed with the deployment's key)
plus `version`, so a later change of meaning is refused by name instead of misread. `version` is
signed whenever present and required here, so no v1 grant verifies without it.

Errors are this module's own (kv knows nothing of HTTP): `MalformedGrant` (the caller's input is
no grant: 400), `GrantError` (not signed by this deployment: 403) and `GrantExpired` (410), both
from kv/grants.py; the HTTP layers map them at the edge. RequestError, which carries a status,
stays in engine/worker.py: kv importing it would point an import back up the layers.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pdd_sidecar.kv.grants import sign, verify

VERSION = 1


class MalformedGrant(ValueError):
    """`kv_transfer_params` that are not a grant at all (wrong shape or types, unknown version)."""


DRAFT_STATE_DTYPES = {"float32": 4, "bfloat16": 2}  # name -> bytes per value


@dataclass(frozen=True)
class DraftState:
    """What a decode's first MTP draft needs from the prefill (issue 47): the main model's final
    normed hidden state at the prompt's last position ``position``, as raw little-endian
    ``dtype`` values (base64 on the wire, ``draft_state: {position, dtype, hidden}``;
    engine/speculative/draft_state.py converts it to and from a tensor).

    Optional and outside the signature: a decode of version 1 without this field ignores it
    and still verifies the grant, a decode given a grant without it drafts from its next step,
    and a forged one can cost acceptance but never change a token (drafts are kept only while
    they equal the decode's own draws, engine/speculative/verify.py)."""

    position: int
    dtype: str
    data: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"position": self.position, "dtype": self.dtype,
                "hidden": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def parse(cls, value: Any, num_tokens: int) -> DraftState:
        """The wire form of a grant of ``num_tokens`` tokens; MalformedGrant naming the field."""
        field = "kv_transfer_params.draft_state"
        if not isinstance(value, Mapping):
            raise MalformedGrant(f"{field}: must be an object, got {value!r:.60}")
        position, dtype, hidden = value.get("position"), value.get("dtype"), value.get("hidden")
        if position != num_tokens - 1 or isinstance(position, bool):
            raise MalformedGrant(f"{field}.position: must be the prompt's last position "
                                 f"({num_tokens - 1}), got {position!r}")
        if dtype not in DRAFT_STATE_DTYPES:
            raise MalformedGrant(f"{field}.dtype: must be one of "
                                 f"{', '.join(DRAFT_STATE_DTYPES)}, got {dtype!r:.40}")
        try:
            if not isinstance(hidden, str):
                raise TypeError
            data = base64.b64decode(hidden, validate=True)
        except (TypeError, binascii.Error):
            raise MalformedGrant(f"{field}.hidden: must be base64 text, got {hidden!r:.40}"
                                 ) from None
        if not data or len(data) % DRAFT_STATE_DTYPES[dtype]:
            raise MalformedGrant(f"{field}.hidden: {len(data)} bytes is no whole number of "
                                 f"{dtype} values")
        return cls(position, dtype, data)


@dataclass(frozen=True)
class TransferParams:
    """Where and what a decode reads: a prefill instance's granted blocks of one request.

    Frozen and made of plain fields, so it pickles into the step command every rank runs."""

    request_id: str
    instance_id: str
    host: str
    side_channel_port: int
    tp: int
    dcp: int
    block_size: int
    block_ids: tuple[int, ...]
    num_tokens: int
    plan_digest: str
    epoch: int
    expires_at: float  # kept as written: the signature covers its JSON spelling
    rank_endpoints: tuple[tuple[str, int], ...] | None = None  # an instance spanning pods
    lease_seconds: float | None = None  # informational, unsigned
    version: int = VERSION
    draft_state: DraftState | None = None  # for the decode's first MTP draft; unsigned

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The side channel of each prefill rank."""
        if self.rank_endpoints is not None:
            return list(self.rank_endpoints)
        return [(self.host, self.side_channel_port + p) for p in range(self.tp)]

    @property
    def label(self) -> str:
        return f"prefill instance {self.host}:{self.side_channel_port}"

    def to_grant(self, key: bytes) -> dict[str, Any]:
        """The wire form, signed with ``key``."""
        fields: dict[str, Any] = {
            "version": self.version,
            "request_id": self.request_id,
            "host": self.host,
            "side_channel_port": self.side_channel_port,
            "instance_id": self.instance_id,
            "tp": self.tp,
            "dcp": self.dcp,
            "block_size": self.block_size,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "plan_digest": self.plan_digest,
            "epoch": self.epoch,
            "expires_at": self.expires_at,
        }
        if self.lease_seconds is not None:
            fields["lease_seconds"] = self.lease_seconds
        if self.rank_endpoints is not None:
            fields["rank_endpoints"] = [list(e) for e in self.rank_endpoints]
        if self.draft_state is not None:  # beside the signed fields, not under the signature
            fields["draft_state"] = self.draft_state.to_wire()
        return sign(fields, key)

    @classmethod
    def from_grant(cls, params: Any, key: bytes, margin_s: float,
                   now: float | None = None) -> TransferParams:
        """Parse, then verify: the shape first (MalformedGrant), then the signature
        (GrantError) and the expiry less ``margin_s`` (GrantExpired)."""
        parsed = cls.parse(params)
        verify(params, key, now=now, margin_s=margin_s)
        return parsed

    @classmethod
    def from_own_grant(cls, params: Any, key: bytes) -> TransferParams:
        """A grant coming back to the prefill that issued it (a claim, a release): the
        signature first, so anything unsigned is forbidden rather than malformed; its expiry is
        the lease table's business, not checked here."""
        verify(params, key, margin_s=-math.inf)
        return cls.parse(params)

    @classmethod
    def parse(cls, params: Any) -> TransferParams:
        """The shape checks alone; a grant that verifies is still checked, since the plan
        indexes its block ids."""
        if not isinstance(params, Mapping):
            raise MalformedGrant("kv_transfer_params: must be an object")
        version = params.get("version")
        if version != VERSION or isinstance(version, bool):
            raise MalformedGrant(f"kv_transfer_params.version: this instance reads version "
                                 f"{VERSION}, got {version!r}")
        try:
            endpoints = params.get("rank_endpoints")
            out = cls(
                request_id=_str(params["request_id"]),
                instance_id=_str(params["instance_id"]),
                host=_str(params["host"]),
                side_channel_port=_int(params["side_channel_port"]),
                tp=_int(params["tp"]),
                dcp=_int(params["dcp"]),
                block_size=_int(params["block_size"]),
                block_ids=tuple(_int(b) for b in _list(params["block_ids"])),
                num_tokens=_int(params["num_tokens"]),
                plan_digest=_str(params["plan_digest"]),
                epoch=_int(params["epoch"]),
                expires_at=_number(params["expires_at"]),
                rank_endpoints=None if endpoints is None else tuple(
                    parse_endpoints(endpoints, _int(params["tp"]))),
                lease_seconds=_optional_number(params.get("lease_seconds")),
            )
        except KeyError as exc:
            raise MalformedGrant(f"kv_transfer_params: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise MalformedGrant(f"kv_transfer_params: malformed: {exc}") from None
        if params.get("draft_state") is not None:
            out = replace(out, draft_state=DraftState.parse(params["draft_state"],
                                                             out.num_tokens))
        if (out.num_tokens < 1 or not 0 < out.side_channel_port < 65536 or out.tp < 1
                or out.dcp < 1 or out.block_size < 1):
            raise MalformedGrant("kv_transfer_params: num_tokens, tp, dcp, block_size and "
                                 "side_channel_port must be positive")
        chunks = -(-out.num_tokens // out.block_size)
        per_rank = -(-chunks // out.dcp)
        if len(out.block_ids) < per_rank or any(b < 0 for b in out.block_ids):
            raise MalformedGrant(f"kv_transfer_params: {out.num_tokens} tokens in blocks of "
                                 f"{out.block_size} over dcp {out.dcp} need {per_rank} block "
                                 f"ids >= 0 per rank, got {len(out.block_ids)}")
        return out


def parse_endpoints(value: Any, tp: int) -> list[tuple[str, int]]:
    """``[[host, port], ...]``, one per rank, as a prefill's info and grants list them."""
    if not isinstance(value, list) or len(value) != tp:
        raise ValueError(f"rank_endpoints: must list {tp} [host, port] pairs, got {value!r}")
    out = []
    for item in value:
        if (not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], str)
                or not item[0] or not 0 < _int(item[1]) < 65536):
            raise ValueError(f"rank_endpoints: {item!r} is no [host, port] pair")
        out.append((item[0], int(item[1])))
    return out


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    return value


def _optional_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expires_at: expected a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expires_at: must be a finite time, got {value!r}")
    return value

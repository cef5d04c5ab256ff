"""Errors of the block allocators, kept free of torch so pure modules can raise them."""

from __future__ import annotations


class KVCacheFullError(RuntimeError):
    """Not enough free blocks for a request; raised instead of overwriting live KV."""


# Why a KV hand-off failed, as `pdd_kv_handoff_failures_total{role, cause}` counts it on each
# side (docs/tracing.md, Failure metrics):
# - transport_error: the READ or its set-up failed on the wire (NIXL, the claim's HTTP);
# - peer_gone: the other side is not there any more (unreachable, restarted: its KV is gone;
#   on the prefill, a decode that claimed the blocks and never said it had read them);
# - lease_expired: the prefill's hold on the blocks ran out before the decode read them;
# - grant_refused: the grant was refused (not this deployment's, its blocks released or reused);
# - incompatible: the two sides disagree (layout, block size, plan, transport).
TRANSPORT_ERROR = "transport_error"
PEER_GONE = "peer_gone"
LEASE_EXPIRED = "lease_expired"
GRANT_REFUSED = "grant_refused"
INCOMPATIBLE = "incompatible"
HANDOFF_FAILURE_CAUSES = (TRANSPORT_ERROR, PEER_GONE, LEASE_EXPIRED, GRANT_REFUSED, INCOMPATIBLE)

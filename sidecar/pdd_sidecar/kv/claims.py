"""A decode rank's claim on a prefill's blocks, made right before it READs them.

The prefill answers 200 once it has pinned the blocks for ``hold_s`` (so neither its lease nor
a release can hand them to another request while the READ runs), or 410 when the grant's epoch
is gone: the blocks were released, expired or reused, and reading them would copy someone else's
KV. Any other failure is the prefill being unreachable.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from pdd_sidecar.kv.transfer import TransferError

CLAIM_MARGIN_S = 5.0  # pinned beyond the READ's own time bound


class ClaimRefused(RuntimeError):
    """The prefill no longer holds the granted blocks."""


def claim(url: str, grant: dict[str, Any], hold_s: float, timeout_s: float) -> None:
    request = urllib.request.Request(
        f"{url}/v1/claim",
        data=json.dumps({"kv_transfer_params": grant, "hold_s": hold_s}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            err = json.loads(detail)["error"]
            detail = err["message"] if isinstance(err, dict) else str(err)
        except (ValueError, KeyError, TypeError):
            pass
        if exc.code in (403, 410):
            raise ClaimRefused(f"prefill {url} refused the claim: {detail}") from None
        raise TransferError(f"prefill {url}: claim answered {exc.code}: {detail}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TransferError(f"prefill {url} unreachable for the claim: {reason}") from None

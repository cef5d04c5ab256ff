"""How long a sequence whose drafts keep missing waits before it drafts again.

A sequence whose acceptance fell too low stops drafting for a pause, then verifies one step of
drafts (a probe) to see whether its text turned predictable again. With a fixed pause the
probes of a sequence that never gets a draft right cost a verify step every ``base + 1`` steps
for ever: on one H100 at batch 1 and k = 2, 3 that kept TPOT 5-8 % above plain decoding (a
verify step of k + 1 rows costs 1.6x a plain one there, docs/speculative.md). So each probe
that fails doubles the pause, up to ``cap`` steps, and a probe that succeeds puts it back to
``base``: the probing of a hopeless sequence costs about one verify step per ``cap`` steps,
and a text that turns repetitive is found again within ``cap`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PauseBackoff:
    """Pauses of ``base`` steps, doubled per consecutive failed probe, at most ``cap``."""

    base: int
    cap: int

    def __post_init__(self) -> None:
        if self.base < 0:
            raise ValueError(f"speculative.pause_steps: must be >= 0, got {self.base}")
        if self.cap < self.base:
            raise ValueError(f"speculative.pause_max_steps: must be >= pause_steps "
                             f"({self.base}), got {self.cap}")

    def steps(self, failed_probes: int) -> int:
        """The pause after the ``failed_probes``-th failed probe in a row (0: the first pause,
        from drafting)."""
        pause = self.base
        for _ in range(failed_probes):
            if pause >= self.cap:
                break
            pause *= 2
        return min(pause, self.cap)


__all__ = ["PauseBackoff"]

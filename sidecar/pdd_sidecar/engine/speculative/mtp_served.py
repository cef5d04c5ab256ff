"""MTP drafts in a serving instance: the driver's side (``ServedMTPDrafts``, rank 0) and each
rank's (``RankMTP``), the two meeting through the lockstep commands of engine/worker.py.

The module needs, at each position whose next token became known, the main model's final
normed hidden state there; every rank has its own (the module's layer is TP-sharded and its
collectives meet the other ranks'), so the hidden states stay on the ranks and the commands
carry only positions and tokens:

- **decode**: a step keeps the hidden states of its decode rows (``RankMTP.keep``, per
  sequence). After sampling, the driver knows which of them are now followed by a known token
  (the fed one's and the kept drafts', ``verified``). Before the next step, one ``mtp_draft``
  command runs the module there on every rank (writing its KV) and drafts what follows: the
  same drafts on every rank, rank 0's returned. A sequence pulled from a prefill starts from
  the prefill's ``draft_state`` (the prompt's last hidden state; its first draft follows the
  prefill's first token); without one its first step drafts nothing and is counted
  (``pdd_spec_decode_draft_state_missing_total``), and it drafts from its next step.
- **prefill**: a step keeps its chunks' hidden states and runs the module over their positions
  up to the prompt's second-to-last (``prefill``), so the module's latents (the cache's last
  layer) move with the prompt's blocks; the prompt's last position waits for the first token,
  which the decode has: it runs the module there from the ``draft_state`` the prefill sends.
  A prompt the decode prefills itself (scheduler.py: Local prefill) is run so too, its last
  position's hidden state kept on the ranks instead of sent.

Drafts are greedy guesses: a missing or stale latent of the module (the last prompt position
of a prefix-cache entry) can lower acceptance, never change a token (the verify step's keep
rule, engine/speculative/verify.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdd_sidecar.engine.seq_chunk import SeqChunk
from pdd_sidecar.engine.speculative.draft_state import decode_draft_state, encode_draft_state
from pdd_sidecar.engine.speculative.mtp import MTPDrafter
from pdd_sidecar.kv.handoff import DraftState

DRAFT_HIDDEN = "mtp_draft_hidden"  # Sequence.extra (prefill): the last hidden state, on device
DRAFT_STATE = "mtp_draft_state"  # Sequence.extra (prefill): the DraftState sent to the decode


@dataclass(frozen=True)
class _Pending:
    """Positions ``start ..`` whose next tokens ``after`` are known and where the module has not
    run yet; their hidden states are the rank's kept ones, or ``state`` (the prefill's)."""

    start: int
    after: tuple[int, ...]
    state: DraftState | None = None


class ServedMTPDrafts:
    """The driver's MTP drafter (engine/speculative/speculator.py ``BatchDrafter``): ``run``
    sends a command to every rank and returns their answers."""

    def __init__(self, run: Callable[[dict[str, Any]], list[Any]]) -> None:
        self.run = run
        self._pending: dict[str, _Pending] = {}
        self._tables: dict[str, list[int]] = {}
        self._known: set[str] = set()
        self._copies: list[tuple[int, int]] = []

    def carry(self, copies: list[tuple[int, int]]) -> None:
        """Block copies the step must run before anything writes the copies (a forked
        choice's own unit, scheduler.py: Choices): sent with this step's module command, which
        runs before the step's and writes the choice's first latent into that unit."""
        self._copies = list(copies)

    def uncarried(self) -> list[tuple[int, int]]:
        """The copies no module command took (it did not run): the step's command runs them."""
        copies, self._copies = self._copies, []
        return copies

    def begin(self, sid: str, blocks: list[int], context: int, first_token: int | None,
              state: DraftState | None, pulled: bool) -> bool:
        """A decode sequence about to step (``blocks`` its table, ``context`` the prompt's
        tokens whose KV it holds); for a new one pulled from a prefill, its first draft's
        input. Returns True for a new pulled sequence that came without a draft state."""
        self._tables[sid] = blocks
        if sid in self._known:
            return False
        self._known.add(sid)
        if not pulled or first_token is None:
            return False  # prefilled here: drafts from its next step (module docstring)
        if state is None:
            return True
        self._pending[sid] = _Pending(context - 1, (first_token,), state)
        return False

    def verified(self, sid: str, position: int, tokens: Sequence[int]) -> None:
        """A step fed ``sid`` at ``position`` and emitted ``tokens`` (the kept drafts and the
        token after them): the module runs at the positions the step fed whose next token is
        now known."""
        if tokens:
            self._pending[sid] = _Pending(position, tuple(tokens))

    def propose(self, asks: Sequence[tuple[str, int]]) -> list[list[int]]:
        """One ``mtp_draft`` command for the step: every asked sequence with pending positions
        runs the module there; up to ``k`` drafts each."""
        work = []
        where: list[int] = []
        for i, (sid, k) in enumerate(asks):
            p = self._pending.pop(sid, None)
            if p is None:
                continue
            work.append((sid, p.start, list(p.after), k, self._tables[sid], p.state))
            where.append(i)
        out: list[list[int]] = [[] for _ in asks]
        if not work:
            return out
        cmd: dict[str, Any] = {"op": "mtp_draft", "seqs": work}
        if self._copies:
            cmd["copies"], self._copies = self._copies, []
        results = self.run(cmd)
        failed = next((r for r in results if r.get("error")), None)
        if failed:  # the step still runs, without drafts (and makes the copies again)
            self._copies = cmd.get("copies", [])
            return out
        for i, drafts in zip(where, results[0]["drafts"], strict=True):
            out[i] = list(drafts)
        return out

    def retain(self, live: Iterable[str]) -> None:
        keep = set(live)
        for d in (self._pending, self._tables):
            for sid in [s for s in d if s not in keep]:
                del d[sid]
        self._known &= keep


class RankMTP:
    """One rank's side: the module (``drafter``) and the hidden states its steps kept."""

    def __init__(self, drafter: MTPDrafter, hidden_size: int) -> None:
        self.drafter = drafter
        self.hidden_size = hidden_size
        self._kept: dict[str, torch.Tensor] = {}

    def keep(self, kept: dict[int, torch.Tensor], rows: Sequence[tuple[str, int, int]]) -> None:
        """After a decode step: sequence ``sid``'s rows are the last positions of the step's
        chunks ``first .. first + n - 1`` (decode rows: one token each; a prompt prefilled on
        the decode: its last chunk), their hidden states in ``kept``."""
        self._kept = {sid: torch.cat([kept[i][-1:] for i in range(first, first + n)])
                      for sid, first, n in rows}

    def draft(self, seqs: Sequence[tuple[str, int, list[int], int, list[int],
                                         DraftState | None]]) -> list[list[int]]:
        """``mtp_draft``: per sequence ``(sid, start, after, k, blocks, state)``."""
        w = self.drafter.w
        work = []
        ks = []
        for sid, start, after, k, blocks, state in seqs:
            if state is not None:
                hidden = decode_draft_state(state, self.hidden_size, w.embed.device,
                                            w.embed.dtype)[None]
            else:
                hidden = self._kept[sid][:len(after)]
            work.append((SeqChunk(after, start, blocks), hidden))
            ks.append(k)
        return self.drafter.draft(work, ks)

    def prefill(self, kept: dict[int, torch.Tensor],
                chunks: Sequence[tuple[int, int, list[int], list[int]]]) -> None:
        """After a prefill step: per chunk ``(index, start, after, blocks)`` the module runs
        over the chunk's first ``len(after)`` positions (``after``: the tokens that follow
        them), writing its latents."""
        work = [(SeqChunk(after, start, blocks), kept[i][:len(after)])
                for i, start, after, blocks in chunks if after]
        if work:
            self.drafter.draft(work, [0] * len(work))


def prefill_after(prompt: Sequence[int], start: int, length: int) -> list[int]:
    """The tokens following a prompt chunk's positions ``start .. start + length - 1`` that are
    known before the first token: up to the prompt's second-to-last position."""
    return list(prompt[start + 1:min(start + length, len(prompt) - 1) + 1])


def draft_state_of(hidden: torch.Tensor, prompt_len: int) -> DraftState:
    """The hand-off's draft state: the prompt's last position's final normed hidden state."""
    return encode_draft_state(hidden.to("cpu"), prompt_len - 1)


__all__ = ["DRAFT_HIDDEN", "DRAFT_STATE", "RankMTP", "ServedMTPDrafts", "draft_state_of",
           "prefill_after"]

"""Rank 0's scheduling policy: which sequences run in the next step, and when blocks come and go.

Policy (one place, pure Python, no torch):
- **Admission reserves** every block a sequence can need up front (prefill: the prompt; decode:
  prompt + max_tokens), so a running sequence never runs out of KV and nothing is preempted. A
  sequence waits in a bounded FIFO queue until its blocks fit and a running slot is free; the
  head of the queue is never overtaken, so a long request cannot starve. More waiting than
  ``max_waiting``, past those the next step admits, is refused (HTTP 429). A request that
  could never fit is refused at once (400).
- **Decode** sequences first pull their KV from the prefill (``PULLING``, vLLM's
  WAITING_FOR_REMOTE_KVS) without holding up the running batch; they join at the next step
  boundary once every rank has its chunks, and leave the moment they finish, freeing their blocks.
- **Prefill** packs prompt chunks into a step of at most ``step_tokens`` tokens, several prompts
  per forward pass. A prompt runs in chunks of at most ``chunk_tokens``, each attending over the
  cached latent of the earlier ones. While a prompt that fits one chunk waits, a prompt longer
  than a chunk (which needs several steps anyway) runs every other step only, cut to
  ``long_chunk_tokens``: the short prompt's step is its own (a step's host cost grows with each
  kind of chunk in it: on one H200 a 1k prompt's step took 112-140 ms beside a chunk of a 32k
  prompt, 1,024 or 2,048 tokens alike, against 47-68 ms alone), and the long one is never
  held up two steps in a row. The prompts
  with the fewest tokens left go first, so a short prompt is not stuck behind a long one; the
  longest-running prompt always keeps a quarter of the budget, so short prompts arriving
  without pause cannot starve it either. While a long step is still being launched (the
  driver serves between its layers, engine/launch_pacing.py), only a step of fresh prompts
  that one chunk holds is planned (``plan_fresh``): it may overtake the long step on the
  device, and it leaves the long prompts' turn-taking as it was.
- **Budgets follow the device** (``step_budget``): a GPU runs an 8,192-token step in about the
  time a CPU runs a few hundred tokens, and a step's fixed costs (launches, host work) only pay
  off in large steps; small budgets stay on the CPU, where one step of 8k tokens would hold a
  decode's running batch for seconds.

- **Prefix cache** (prefill, when on): admission looks the prompt's whole units up; the cached
  ones join the table shared (``seq.computed`` starts after them) and only the rest is reserved
  and computed. At least the prompt's last token always runs: its logits give the first token.
  Each finished chunk caches the whole units it completed, never before: until then the units
  an admitted prompt will compute are *pending* under it. A prompt whose cached run ends at a
  pending unit (its requests arrived together, or while the prefix was mid-prefill) waits in
  the queue, without holding up those behind it, until that unit is computed, then takes it as
  a hit: a prefix is computed once. Units it loads from the host tier are pending alike, so a
  prefix held in host memory is loaded once. A prompt that is cancelled or fails takes its
  pending units with it, and whoever waited on them computes (or loads) them itself.
- **Prefix cache** (decode, when on and the request names its prompt): admission shares the
  cached whole units of the prompt (all of it may be) and adopts the cached partial unit after
  them when the prompt continues it (kv/prefix_cache.py, tails); the pull reads only the tokens
  after those. A sequence that finishes (stop or length) caches the whole units of everything
  it holds KV for (prompt, first token and the generated tokens it fed) and keeps its last
  partial unit as a tail. A follow-up turn whose prompt extends that conversation then pulls
  only its new tokens' KV (and the previous answer's last token, which was never fed).
- **Local prefill** (decode, a sequence with no ``source``): the decode runs the prompt
  itself, as a prefill would (the same chunking and packing, its prefix cache looked up and
  filled the same way, the last prompt token always run), in its own steps beside the running
  batch; the first token is sampled from the last chunk's logits into ``output`` and the
  sequence then decodes with the others. A short prompt costs the running batch one longer
  step instead of a hand-off; the router sends only those here (serve/router/prefill_path.py).

- **Frees wait for the device** (``fence``, engine/free_fence.py): a sequence that finishes
  or is cancelled gives its blocks back through the fence, which holds them while a queued
  step the driver registered still references one; a prompt leaving before the command that
  carries its host-tier loads takes those loads with it.

- **Choices** (decode, a request with ``n`` > 1): one sequence pulls the prompt's KV, reserving
  at admission the blocks of every choice (the prompt's whole units once, the rest per choice)
  and a running slot for each; once its pull is done it forks into one sequence per choice. The
  forks share the prompt's whole units (counted references, freed by the last one to finish)
  and each gets its own copy of the unit the prompt ends in, which every choice writes its own
  tokens into (the copy runs on every rank before the step that first feeds them). The
  request ends when its last choice does.

With DCP the reserve is counted in table blocks (``ceil(chunks / dcp)`` per rank), so at the same
per-rank block count an instance with dcp = N admits N times the tokens of dcp = 1.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple, Protocol

from pdd_sidecar.engine.free_fence import FreeFence
from pdd_sidecar.kv.cache import num_table_blocks
from pdd_sidecar.kv.host_tier import HostTier, load_from_host
from pdd_sidecar.kv.prefix_cache import PrefixCache, unit_keys

UNIT_KEYS = "prefix_unit_keys"  # seq.extra: the prompt's prefix-cache keys, computed once
PENDING = "prefix_pending"  # seq.extra: the units [first, end) pending under this prefill
CACHED_TOKENS = "cached_tokens"  # seq.extra: prompt tokens whose KV came from the cache
# seq.extra: a decode's prompt ids where seq.prompt is empty (its prefix cache is off), for its
# repetition_penalty and its n-gram drafts
PENALTY_PROMPT = "penalty_prompt"
# seq.extra: the log-probabilities of the generated tokens, and of the prompt's tokens from its
# second on (engine/sampling.py's ``Logprob`` entries), for a sequence that asks for them
LOGPROBS = "logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"
# seq.extra (decode): the request's other choices, forked once its pull is done: a list of
# ``Fork``; and the blocks admission reserved for them.
FORKS = "forks"
FORK_BLOCKS = "fork_blocks"
GROUP = "choice_group"  # seq.extra: the ChoiceGroup a forked sequence belongs to
ENDED_CHOICES = "ended_choices"  # seq.extra (decode): choices ended before the fork (end_choice)
CHOICES = "choices"  # seq.extra (prefill): how many first tokens to choose (n), when > 1
FIRST_TOKENS = "first_tokens"  # seq.extra (prefill): the first token of each choice
FIRST_FINISHES = "first_finishes"  # seq.extra (prefill): each choice's, "stop" if it ended
CHOICE_GRAMMARS = "choice_grammars"  # seq.extra (prefill): each choice's own grammar matcher


class State(enum.Enum):
    WAITING = "waiting"
    PULLING = "pulling"
    RUNNING = "running"
    FINISHED = "finished"


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the client should retry later (429)."""


class NeverFits(ValueError):
    """The request needs more KV blocks than the instance has at all (400)."""


class Allocator(Protocol):
    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, ids: list[int]) -> None: ...


@dataclass
class Sequence:
    """One request on one instance. ``context`` is the prompt length whose KV exists before the
    first generated token is fed (decode: pulled from the prefill)."""

    id: str
    prompt: list[int]
    max_tokens: int
    kv_tokens: int  # tokens whose KV this instance stores: what admission reserves
    sampling: Any = None
    stop_ids: frozenset[int] = frozenset()
    source: Any = None  # decode: where to pull from
    first_token: int | None = None  # decode: chosen by the prefill
    state: State = State.WAITING
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # prefill: prompt tokens already run
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    cancelled: bool = False
    pulled_ranks: set[int] = field(default_factory=set)
    on_token: Callable[[int], None] | None = None
    on_done: Callable[[Sequence], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    grammar: Any = None  # structured output: engine/grammar_mask.Constrained
    # The top count of the log-probabilities asked for each generated token, and (prefill)
    # each prompt token; None: none asked.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def context(self) -> int:
        return len(self.prompt) if self.source is None else int(self.source.num_tokens)


class Fork(NamedTuple):
    """One more choice of a decode request: its index, the first token the prefill chose for
    it, its sampling (its own seed), where its tokens go."""

    choice: int
    first_token: int
    sampling: Any
    on_token: Callable[[int], None] | None = None
    grammar: Any = None  # structured output: its own matcher, advanced by its first token


@dataclass
class ChoiceGroup:
    """The sequences of one request's choices (the one that pulled first): the request is done
    when the last of them is."""

    members: list[Sequence]
    live: int
    on_done: Callable[[Sequence], None] | None


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    tokens: list[int]

    @property
    def last(self) -> bool:
        return self.start + len(self.tokens) == len(self.seq.prompt)


@dataclass
class DecodeEntry:
    """A decode sequence's part of a step: ``token`` fed at ``position``, then ``drafts`` (the
    driver's, engine/speculative/) at the positions after it, verified in the same step; the
    grammar's state at each of those positions in ``states`` (structured output)."""

    seq: Sequence
    token: int
    position: int
    drafts: list[int] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return 1 + len(self.drafts)


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[DecodeEntry] = field(default_factory=list)
    pulls: list[Sequence] = field(default_factory=list)

    @property
    def has_forward(self) -> bool:
        return bool(self.prefill or self.decode)


# Step token budget and longest chunk per device type, when the instance is not told otherwise.
# Peers default their chunked-prefill budget to 8,192 on H100/H200-class GPUs.
class StepBudget(NamedTuple):
    step: int  # prompt tokens in one forward pass
    chunk: int  # the longest piece of one prompt in a step
    long_chunk: int  # that of a longer prompt while shorter ones share its steps


DEVICE_BUDGETS: dict[str, StepBudget] = {"cuda": StepBudget(8192, 8192, 1024),
                                         "cpu": StepBudget(2048, 512, 512)}


def step_budget(device_type: str, step_tokens: int | None, chunk_tokens: int | None,
                long_chunk_tokens: int | None = None) -> StepBudget:
    """What was set, else the device's default (CPU's for an unknown device). A long chunk
    set larger than the chunk is capped at it."""
    d = DEVICE_BUDGETS.get(device_type, DEVICE_BUDGETS["cpu"])
    chunk = chunk_tokens or d.chunk
    return StepBudget(step_tokens or d.step, chunk, min(long_chunk_tokens or d.long_chunk, chunk))


def whole_chunk(tokens: int, block_size: int) -> int:
    """A chunk budget in whole blocks (at least one), so each chunk's KV lands in whole
    blocks."""
    return max(block_size, tokens // block_size * block_size)


class Scheduler:
    def __init__(self, role: str, allocator: Allocator, block_size: int, dcp: int,
                 tp: int, max_running: int = 256, max_waiting: int = 256,
                 step_tokens: int = 2048, chunk_tokens: int = 512,
                 prefix_cache: PrefixCache | None = None,
                 long_chunk_tokens: int | None = None,
                 host_tier: HostTier | None = None) -> None:
        self.role = role
        self.host_tier = host_tier if prefix_cache is not None else None
        self.allocator: Allocator = prefix_cache if prefix_cache is not None else allocator
        self.prefix_cache = prefix_cache
        # Every block a sequence gives back goes through here: the driver registers the steps
        # it enqueues, and a block one of them still references is held until it ran.
        self.fence = FreeFence(self.allocator.free)
        self.block_size = block_size
        self.dcp = dcp
        self.tp = tp
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.step_tokens = step_tokens
        self.chunk_tokens = whole_chunk(chunk_tokens, block_size)
        long_chunk = min(long_chunk_tokens or chunk_tokens, chunk_tokens)
        self.long_chunk_tokens = whole_chunk(long_chunk, block_size)
        self.waiting: deque[Sequence] = deque()
        self.pulling: dict[str, Sequence] = {}
        self.running: dict[str, Sequence] = {}
        self.by_id: dict[str, Sequence] = {}
        self._long_ran: set[str] = set()  # prompts longer than a chunk in the last step
        self._long_ran_before: set[str] = set()
        # Blocks the driver keeps for itself (engine/graphed_hits.py's scratch): never a
        # sequence's, so a request needing them would wait for good.
        self.reserved_blocks = 0
        # prefill: unit key -> id of the running prompt that will compute it (not cached yet)
        self._pending: dict[bytes, str] = {}
        self.computed_tokens = 0  # prefill: prompt tokens run (not taken from the cache)
        self._shared: dict[int, int] = {}  # block -> references forked choices add to it
        # (src, dst, the fork) blocks the next step copies while the fork still runs
        self._copies: list[tuple[int, int, Sequence]] = []
        self._groups: dict[str, ChoiceGroup] = {}  # request id -> its forked choices, running

    # -- intake

    def blocks_needed(self, kv_tokens: int) -> int:
        return num_table_blocks(max(kv_tokens, 1), self.block_size, self.dcp)

    def shared_units(self, seq: Sequence) -> int:
        """Table entries a decode's choices share: the prompt's whole units."""
        return min(seq.context // (self.block_size * self.dcp),
                   self.blocks_needed(seq.kv_tokens))

    def _fork_need(self, seq: Sequence, need: int) -> int:
        forks = seq.extra.get(FORKS)
        return len(forks) * (need - self.shared_units(seq)) if forks else 0

    def _need(self, seq: Sequence) -> int:
        """Blocks admission reserves for ``seq``, its forked choices' included."""
        need = self.blocks_needed(seq.kv_tokens)
        return need + self._fork_need(seq, need)

    @staticmethod
    def _slots(seq: Sequence) -> int:
        """Running slots ``seq`` takes: one per choice."""
        return 1 + len(seq.extra.get(FORKS) or ())

    def submit(self, seq: Sequence) -> None:
        need = self._need(seq)
        usable = self.allocator.num_blocks - self.reserved_blocks
        if need > usable:
            raise NeverFits(
                f"the request needs {need} KV blocks of {self.block_size} tokens per rank "
                f"({seq.kv_tokens} tokens, dcp {self.dcp}, {self._slots(seq)} choices); this "
                f"instance has {usable}"
            )
        if self._slots(seq) > self.max_running:
            raise NeverFits(f"the request's {self._slots(seq)} choices need as many running "
                            f"slots; this instance runs at most {self.max_running} sequences")
        if seq.id in self.by_id or seq.id in self._groups:
            raise ValueError(f"request_id {seq.id!r} is already in flight on this instance")
        # Below the limit nothing can be refused: the walk stays off a burst's path.
        if len(self.waiting) >= self.max_waiting:
            queued = self._queued_beyond_next_step(need, self._slots(seq))
            if queued > self.max_waiting:
                raise QueueFull(f"{queued - 1} requests already waiting (limit "
                                f"{self.max_waiting})")
        self.waiting.append(seq)
        self.by_id[seq.id] = seq

    def cancel(self, seq_id: str) -> Sequence | None:
        """Mark a sequence cancelled; it leaves at the next step (or once its pull is done)."""
        group = self._groups.get(seq_id)
        if group is not None:  # the request: every choice still running
            for member in group.members:
                if member.state is State.RUNNING:
                    member.cancelled = True
                    self._finish(member, "cancelled")
            return group.members[0]
        seq = self.by_id.get(seq_id)
        if seq is None or seq.state is State.FINISHED:
            return None
        seq.cancelled = True
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled")
        elif seq.state is State.RUNNING:
            self._finish(seq, "cancelled")
        return seq

    def end_choice(self, seq_id: str, choice: int) -> Sequence | None:
        """End one choice of a request of several, the others running on: the router found a
        stop string in its text (text is the router's to judge), so every token it would still
        generate is thrown away. Before the fork, the choice is noted and ends as it forks."""
        group = self._groups.get(seq_id)
        if group is None:
            seq = self.by_id.get(seq_id)
            if seq is not None and seq.state is not State.FINISHED and "choice" in seq.extra:
                seq.extra.setdefault(ENDED_CHOICES, set()).add(choice)
            return None
        for member in group.members:
            if member.extra.get("choice") == choice and member.state is State.RUNNING:
                self._finish(member, "stop")
                return member
        return None

    def first_step_full(self) -> bool:
        """The waiting prompts fill a step's budget or its running slots: an idle instance
        gathering a burst (engine/driver.py) starts at once."""
        tokens = accumulate(min(len(s.prompt), self.chunk_tokens) for s in self.waiting)
        return (len(self.waiting) >= self.max_running
                or any(n >= self.step_tokens for n in tokens))

    def prompts_waiting(self) -> bool:
        """Prompts this instance runs itself wait in the queue (a prefill's; a decode's local
        ones): an idle instance gathers their burst before its first step (engine/driver.py),
        so a burst is one step, not a first few prompts alone while the rest queue."""
        return any(self.role == "prefill" or s.source is None for s in self.waiting)

    def _queued_beyond_next_step(self, need: int, slots_needed: int = 1) -> int:
        """How many of the waiting, with a newcomer needing ``need`` blocks at the back, the
        next step could not admit: only those count against ``max_waiting``. A burst that
        arrives between two steps is not refused for the places it is about to take."""
        free = self.allocator.num_free
        slots = self.max_running - len(self.running) - self._pulling_slots()
        needs = [*((self._need(s), self._slots(s)) for s in self.waiting),
                 (need, slots_needed)]
        for i, (n, k) in enumerate(needs):
            if slots < k or n > free:
                return len(needs) - i
            free -= n
            slots -= k
        return 0

    def _pulling_slots(self) -> int:
        return sum(self._slots(s) for s in self.pulling.values())

    # -- planning

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.pulling or self.running)

    def _admit(self) -> list[Sequence]:
        """The head of the queue first, and nobody past one that does not fit; a prompt
        waiting for a pending prefix keeps its place but holds nobody up."""
        admitted: list[Sequence] = []
        deferred: list[Sequence] = []
        pc = self.prefix_cache
        taken = len(self.running) + (self._pulling_slots() if self.pulling else 0)
        while self.waiting:
            seq = self.waiting[0]
            if taken + self._slots(seq) > self.max_running:
                break
            need = self.blocks_needed(seq.kv_tokens)
            extra = self._fork_need(seq, need)
            if pc is not None:
                if self._awaits_pending(seq, pc):
                    deferred.append(self.waiting.popleft())
                    continue
                if not self._reserve_cached(seq, pc, need, extra):
                    break
            elif need + extra > self.allocator.num_free:
                break
            else:
                seq.blocks = self.allocator.allocate(need)
                if extra:
                    seq.extra[FORK_BLOCKS] = self.allocator.allocate(extra)
            self.waiting.popleft()
            admitted.append(seq)
            taken += self._slots(seq)
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def _unit_keys(self, seq: Sequence, pc: PrefixCache) -> list[bytes]:
        keys = seq.extra.get(UNIT_KEYS)
        if keys is None:
            keys = seq.extra[UNIT_KEYS] = pc.keys(seq.prompt)
        return keys  # type: ignore[no-any-return]

    def _usable_units(self, seq: Sequence, pc: PrefixCache) -> int:
        """Whole units a hit may cover: a prompt run here always runs its last token (its
        logits give the first token); a pulled decode feeds the first token itself."""
        if seq.prompt_logprobs is not None:
            return 0  # every prompt position's logits are needed: the cache is bypassed
        usable = len(seq.prompt) if self._pulls(seq) else len(seq.prompt) - 1
        return max(usable, 0) // pc.unit_tokens

    def _awaits_pending(self, seq: Sequence, pc: PrefixCache) -> bool:
        """The prompt's cached run ends at a unit a running prefill is computing now."""
        if not self._pending:
            return False
        keys = self._unit_keys(seq, pc)[:self._usable_units(seq, pc)]
        n = len(pc.lookup(keys))
        return n < len(keys) and keys[n] in self._pending

    def _mark_pending(self, seq: Sequence, keys: list[bytes], first: int) -> None:
        """The units from ``first`` on, which ``seq`` is about to compute, are pending under it
        (those another prompt computes already stay that one's)."""
        for k in keys[first:]:
            self._pending.setdefault(k, seq.id)
        seq.extra[PENDING] = (first, len(keys))

    def _settle_pending(self, seq: Sequence, upto: int | None = None) -> None:
        """Units of ``seq`` no longer pending: computed (those before unit ``upto``), or all of
        them (the prompt finished, was cancelled or failed)."""
        span = seq.extra.get(PENDING)
        if span is None:
            return
        first, end = span
        stop = end if upto is None else min(upto, end)
        keys = seq.extra[UNIT_KEYS]
        for k in keys[first:stop]:
            if self._pending.get(k) == seq.id:
                del self._pending[k]
        if stop >= end:
            del seq.extra[PENDING]
        else:
            seq.extra[PENDING] = (stop, end)

    def _reserve_cached(self, seq: Sequence, pc: PrefixCache, need: int, extra: int = 0
                        ) -> bool:
        """Reserve ``seq``'s table with its cached units shared; False when it does not fit.

        A prefill always runs the prompt's last token (its logits give the first token); a
        decode may share the whole prompt, since it feeds the first token itself, and adopts
        the tail its prompt continues as its next table entry. ``extra``: blocks of its own
        for the choices it forks into."""
        keys = self._unit_keys(seq, pc)
        unit = pc.unit_tokens
        whole = keys[:self._usable_units(seq, pc)]
        hits = pc.lookup(whole)
        ht = self.host_tier  # the chain goes on in host memory (kv/host_tier.py)
        host = ht.lookup(whole[len(hits):]) if ht is not None else []
        found = len(hits) + len(host)
        tail = host_tail = None
        if self._pulls(seq) and found < need:
            start = found * unit
            parent = keys[found - 1] if found else pc.root
            tail = pc.lookup_tail(parent, seq.prompt[start:start + unit])
            if tail is None and ht is not None:
                host_tail = ht.lookup_tail(parent, seq.prompt[start:start + unit])
        n_new = need - len(hits) - (tail is not None)
        if not pc.fits(hits, n_new + extra, tail):
            return False
        if ht is None:
            seq.blocks = pc.acquire(hits, n_new, len(seq.prompt), tail)
        else:
            seq.blocks = load_from_host(pc, ht, seq.prompt, hits, host, n_new, tail, host_tail)
        if extra:
            seq.extra[FORK_BLOCKS] = pc.allocate(extra)
        seq.extra[CACHED_TOKENS] = found * unit + (
            tail.tokens if tail else host_tail.tokens if host_tail else 0)
        if not self._pulls(seq):
            seq.computed = seq.extra[CACHED_TOKENS]
            # Units loaded from the host are pending too: in no index until the chunk after
            # them is done, they are loaded once, and a prompt sharing them waits for that.
            self._mark_pending(seq, keys, len(hits))
        return True

    def _pulls(self, seq: Sequence) -> bool:
        """``seq`` is a decode's that pulls its prompt's KV (else its prompt runs here)."""
        return self.role == "decode" and seq.source is not None

    def start_token(self, seq: Sequence) -> int:
        """The first prompt token a decode pulls: those before it are in its prefix cache."""
        return int(seq.extra.get(CACHED_TOKENS, 0))

    def _cache_decoded(self, seq: Sequence, pc: PrefixCache) -> None:
        """Cache the whole units of a finished decode's KV: the prompt it pulled or shared, the
        first token and every generated token but the last (never fed, so never written); the
        partial unit after them becomes a tail, its block leaving ``seq.blocks``."""
        keys = seq.extra.get(UNIT_KEYS)
        if keys is None or not seq.prompt:
            return
        if seq.source is None:  # prefilled here: its first token is in ``output``
            fed = seq.output[:-1]
        elif seq.first_token is None:
            return
        else:
            fed = [seq.first_token, *seq.output[:-1]] if seq.output else []
        unit = pc.unit_tokens
        rest = seq.prompt[len(keys) * unit:] + fed  # after the prompt's units keyed at admission
        more = unit_keys(keys[-1] if keys else pc.root, rest, unit)
        whole = [*keys, *more]
        pc.insert(whole, seq.blocks)
        partial = rest[len(more) * unit:]
        w = len(whole)
        if partial and w < len(seq.blocks) and pc.insert_tail(
                whole[-1] if whole else pc.root, partial, seq.blocks[w]):
            seq.blocks = seq.blocks[:w] + seq.blocks[w + 1:]

    def plan(self) -> StepPlan:
        plan = StepPlan()
        if self.role == "decode":
            for seq in self._admit():
                if seq.source is None:  # prefilled here (module docstring: Local prefill)
                    seq.state = State.RUNNING
                    self.running[seq.id] = seq
                    continue
                seq.state = State.PULLING
                self.pulling[seq.id] = seq
                plan.pulls.append(seq)
            plan.prefill = self._prefill_chunks(
                [s for s in self.running.values() if s.source is None and self._left(s) > 0])
            for seq in self.running.values():
                entry = self._decode_entry(seq)
                if entry is not None:
                    plan.decode.append(entry)
            return plan
        self._admit_prompts()
        plan.prefill = self._prefill_chunks(
            [s for s in self.running.values() if self._left(s) > 0])
        return plan

    def _decode_entry(self, seq: Sequence) -> DecodeEntry | None:
        """The token ``seq`` feeds next and its position; None for a prompt still running here
        (its chunks, then its first token, come first)."""
        if seq.source is None:
            if self._left(seq) > 0 or not seq.output:
                return None
            return DecodeEntry(seq, seq.output[-1], len(seq.prompt) + len(seq.output) - 1)
        fed = seq.output[-1] if seq.output else seq.first_token
        assert fed is not None
        return DecodeEntry(seq, fed, seq.context + len(seq.output))

    def _admit_prompts(self) -> None:
        for seq in self._admit():
            seq.state = State.RUNNING
            self.running[seq.id] = seq

    def _prefill_chunks(self, running: list[Sequence]) -> list[PrefillChunk]:
        """This step's prompt chunks of ``running`` (the prompts with tokens left; one whose
        last chunk ran waits only for its token): fewest tokens left first, the oldest
        prompt's share kept (module docstring)."""
        # A prompt that one chunk holds shares these steps: long prompts keep them short, and
        # one that ran in the last step sits this one out, never two in a row.
        shared = any(self._fits_chunk(s) for s in running)
        if shared:
            running = [s for s in running if s.id not in self._long_ran]
        chunks = self._pack(running, shared)
        self._long_ran_before = self._long_ran
        self._long_ran = {c.seq.id for c in chunks if not self._fits_chunk(c.seq)}
        return chunks

    def plan_fresh(self, launching: Set[str]) -> StepPlan:
        """A prefill step of prompts one chunk holds that no chunk of has run, for while the
        step of ``launching`` (sequence ids) is still being launched (engine/launch_pacing.py):
        only such a step may overtake it, and that step's chunks are not done yet. The
        turn-taking of long prompts stays as the last plan left it."""
        plan = StepPlan()
        if self.role != "prefill":
            return plan
        self._admit_prompts()
        fresh = [s for s in self.running.values()
                 if s.id not in launching and s.computed == 0 and self._fits_chunk(s)]
        plan.prefill = self._pack(fresh, shared=True)
        return plan

    def hold(self) -> None:
        """The driver did not run the last plan's prompt chunks: the next plan starts from
        where that one did (admissions stand)."""
        self._long_ran = self._long_ran_before

    @property
    def runnable(self) -> bool:
        """A step has something to compute: requests waiting, running decodes, prompts with
        chunks left (not those whose token is still being sampled)."""
        if self.waiting:
            return True
        if self.role == "decode":
            return bool(self.running)
        return any(self._left(s) > 0 for s in self.running.values())

    def _fits_chunk(self, seq: Sequence) -> bool:
        return len(seq.prompt) <= self.chunk_tokens

    def _pack(self, running: list[Sequence], shared: bool) -> list[PrefillChunk]:
        if not running:
            return []
        bs = self.block_size
        budget = self.step_tokens
        oldest = running[0]
        share = max(bs, budget // 4 // bs * bs)
        reserved = min(self._left(oldest), self._chunk_cap(oldest, shared), share, budget)
        budget -= reserved
        chunks: list[PrefillChunk] = []
        for seq in sorted(running[1:], key=self._left):
            n = self._chunk_len(seq, budget, shared)
            if n:
                chunks.append(self._chunk(seq, n))
                budget -= n
        n = self._chunk_len(oldest, budget + reserved, shared)
        if n:
            chunks.insert(0, self._chunk(oldest, n))
        return chunks

    def _left(self, seq: Sequence) -> int:
        return len(seq.prompt) - seq.computed

    def _chunk_cap(self, seq: Sequence, shared: bool) -> int:
        """A prompt longer than a chunk runs in whole chunks while no short prompt waits on
        its steps (alone, or beside other long ones: their TTFT is many steps anyway), in
        long chunks while one does (so its first token comes after a short step)."""
        if shared and not self._fits_chunk(seq):
            return self.long_chunk_tokens
        return self.chunk_tokens

    def _chunk_len(self, seq: Sequence, budget: int, shared: bool) -> int:
        """A chunk that ends a prompt may have any length; any other ends on a block boundary,
        so each chunk's KV lands in whole blocks."""
        n = min(self._chunk_cap(seq, shared), self._left(seq), budget)
        if n < self._left(seq):
            n = n // self.block_size * self.block_size
        return max(n, 0)

    def _chunk(self, seq: Sequence, n: int) -> PrefillChunk:
        return PrefillChunk(seq, seq.computed, seq.prompt[seq.computed:seq.computed + n])

    # -- results

    def on_pulled(self, seq_id: str, rank: int, error: dict[str, Any] | None) -> None:
        seq = self.pulling.get(seq_id)
        if seq is None:
            return
        if error is not None:
            seq.extra.setdefault("pull_errors", {})[rank] = error
        seq.pulled_ranks.add(rank)
        if len(seq.pulled_ranks) < self.tp:
            return
        del self.pulling[seq_id]  # every rank is done writing into its blocks
        errors = seq.extra.get("pull_errors")
        if errors:  # the lowest rank's, whichever finished first
            seq.error = errors[min(errors)]
        if seq.error is not None:
            self._finish(seq, "error")
        elif seq.cancelled:
            self._finish(seq, "cancelled")
        else:
            ended = seq.extra.pop(ENDED_CHOICES, ())
            for member in self._fork(seq):
                if member.max_tokens == 0:
                    self._finish(member, "length")
                elif member.extra.get("choice") in ended:
                    self._finish(member, "stop")
                else:
                    member.state = State.RUNNING
                    self.running[member.id] = member

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """``seq`` and a sequence per fork of it (module docstring: Choices), sharing its
        prompt's whole units; the unit the prompt ends in is copied for each (``take_copies``)."""
        forks: list[Fork] | None = seq.extra.pop(FORKS, None)
        if not forks:
            return [seq]
        own = seq.extra.pop(FORK_BLOCKS)
        shared = self.shared_units(seq)
        per = len(seq.blocks) - shared
        partial = shared < len(seq.blocks) and seq.context % (self.block_size * self.dcp) > 0
        group = ChoiceGroup([seq], 1 + len(forks), seq.on_done)
        seq.extra[GROUP] = group
        self._groups[seq.id] = group
        keep = {k: seq.extra[k] for k in (UNIT_KEYS, PENALTY_PROMPT) if k in seq.extra}
        for i, fork in enumerate(forks):
            child = Sequence(f"{seq.id}#{fork.choice}", seq.prompt, seq.max_tokens,
                             seq.kv_tokens, sampling=fork.sampling, stop_ids=seq.stop_ids,
                             source=seq.source, first_token=fork.first_token,
                             state=State.PULLING, blocks=seq.blocks[:shared]
                             + own[i * per:(i + 1) * per], on_token=fork.on_token,
                             extra={**keep, GROUP: group, "choice": fork.choice},
                             grammar=fork.grammar, logprobs=seq.logprobs)
            group.members.append(child)
            self.by_id[child.id] = child
            if partial:
                self._copies.append((seq.blocks[shared], child.blocks[shared], child))
        for b in seq.blocks[:shared]:
            self._shared[b] = self._shared.get(b, 0) + len(forks)
        return group.members

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies ``(src, dst)`` every rank runs before the next step's forward pass:
        those of forks still running (one that ended at once gave its blocks back)."""
        copies, self._copies = self._copies, []
        return [(a, b) for a, b, fork in copies if fork.state is State.RUNNING]

    def on_chunk_done(self, chunk: PrefillChunk) -> None:
        seq = chunk.seq
        seq.computed = chunk.start + len(chunk.tokens)
        self.computed_tokens += len(chunk.tokens)
        if self.prefix_cache is not None and seq.blocks:
            keys = seq.extra[UNIT_KEYS]
            done = seq.computed // self.prefix_cache.unit_tokens
            self.prefix_cache.insert(keys[:done], seq.blocks)
            self._settle_pending(seq, done)

    def on_token(self, seq: Sequence, token: int, last: bool = False) -> None:
        """A token was chosen for ``seq``; stop on a stop id, when it is the ``last`` (its
        grammar is complete), or at max_tokens."""
        if seq.state is not State.RUNNING:
            return
        seq.output.append(token)
        if seq.on_token is not None:
            seq.on_token(token)
        if token in seq.stop_ids or last:
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.max_tokens:
            self._finish(seq, "length")

    def finish_prefill(self, seq: Sequence, keep_blocks: bool) -> None:
        """The prompt is done; the prefill keeps its blocks for a decode (a lease then owns
        them) unless the sequence already finished."""
        if not keep_blocks:
            self._finish(seq, seq.finish_reason or "length")
            return
        self.running.pop(seq.id, None)
        self.by_id.pop(seq.id, None)
        self._settle_pending(seq)
        seq.state = State.FINISHED
        if seq.on_done is not None:
            seq.on_done(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._settle_pending(seq)
        seq.state = State.FINISHED
        if seq.finish_reason is None or reason in ("error", "cancelled"):
            seq.finish_reason = reason
        self.running.pop(seq.id, None)
        self.by_id.pop(seq.id, None)
        if (self.role == "decode" and self.prefix_cache is not None and seq.blocks
                and seq.error is None and seq.finish_reason in ("stop", "length")):
            self._cache_decoded(seq, self.prefix_cache)
        if seq.blocks:
            own = self._unshared(seq.blocks)
            if self.host_tier is not None:  # left before the command carrying its loads
                self.host_tier.drop_loads(own)
            self.fence.free(own)
            seq.blocks = []
        fork_blocks = seq.extra.pop(FORK_BLOCKS, None)
        if fork_blocks:
            self.fence.free(fork_blocks)
        group = seq.extra.get(GROUP)
        if group is not None:
            group.live -= 1
            if group.live == 0:
                self._groups.pop(group.members[0].id, None)
                if group.on_done is not None:
                    group.on_done(group.members[0])
        elif seq.on_done is not None:
            seq.on_done(seq)

    def _unshared(self, blocks: list[int]) -> list[int]:
        """``blocks`` less those forked choices still reference (one reference each dropped):
        the last sequence holding a shared block frees it."""
        if not self._shared:
            return blocks
        out = []
        for b in blocks:
            n = self._shared.get(b, 0)
            if n == 0:
                out.append(b)
            elif n == 1:
                del self._shared[b]
            else:
                self._shared[b] = n - 1
        return out

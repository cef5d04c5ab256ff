"""The host KV tier on the CPU (a device pool and a host pool apart, the same code paths as on a
GPU): copies are bit-exact both ways, one per run of slots and blocks consecutive on both sides;
a load is never raced by the reuse of its host slot or device block, and prompts that arrive
together load a host-held prefix once; through a running stack,
prompts evicted from the device come back from host memory with the tokens of a run from
scratch, for every layout; and a chat whose KV the decode evicted still pulls only its new
tokens (and the last answer's last token)."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch
from runtime_fixtures import LocalCluster, Proc, http, plan_json, reference_tokens

from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Scheduler, Sequence, State
from pdd_sidecar.kv.cache import PagedKVCache
from pdd_sidecar.kv.host_pool import HostKVPool, pair_runs
from pdd_sidecar.kv.host_tier import HostTier
from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root

pytestmark = pytest.mark.dataplane

BLOCK = 16
ROW_BYTES = 3 * 40 * 4  # one token's KV: the builtin model's layers x latent x float32
BLOCK_BYTES = BLOCK * ROW_BYTES
HOST_GIB = 160 * BLOCK_BYTES / (1 << 30)  # 160 host blocks per rank


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 53 + salt * 29 + 7) % 256 for i in range(n)]


# -- the copies ---------------------------------------------------------------------------


def _random_cache(num_blocks: int, dtype: torch.dtype) -> PagedKVCache:
    cache = PagedKVCache(num_blocks, 3, 4, 8, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(3)))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_then_load_round_trips_bit_exact(dtype: torch.dtype) -> None:
    cache = _random_cache(12, dtype)
    before = cache.kv.clone()
    pool = HostKVPool(cache, 8)
    pool.run([(5, 0), (2, 1), (9, 2), (3, 6), (0, 7)], [])
    assert torch.equal(pool.host[[0, 1, 2, 6, 7]], before[[5, 2, 9, 3, 0]])
    cache.kv.zero_()
    pool.run([], [(6, 11), (0, 4), (1, 1), (7, 8), (2, 10)])
    for slot, block in ((6, 11), (0, 4), (1, 1), (7, 8), (2, 10)):
        assert torch.equal(cache.kv[block], pool.host[slot]), (slot, block)
    untouched = [b for b in range(12) if b not in (11, 4, 1, 8, 10)]
    assert not cache.kv[untouched].any()
    stats = pool.take_stats()
    assert stats["offload"]["bytes"] == stats["load"]["bytes"] == 5 * cache.bytes_per_block
    assert stats["load"]["blocks"] == 5 and stats["load"]["seconds"] >= 0
    assert stats["load"]["copies"] == stats["offload"]["copies"] == 5  # no two runs on
    assert pool.take_stats() == {}  # counted once


def test_a_run_consecutive_on_both_sides_is_one_copy() -> None:
    """Slots 0-3 into blocks 8-11 and slots 4-5 into 2-3 are two copies whatever the order
    the loads were queued in; an offload of blocks 5-7 into slots 9-11 is one."""
    assert pair_runs([(0, 8), (1, 9), (2, 10), (3, 11), (4, 2), (5, 3)]) == [(0, 8, 4),
                                                                             (4, 2, 2)]
    assert pair_runs([(0, 8), (1, 10), (2, 9)]) == [(0, 8, 1), (1, 10, 1), (2, 9, 1)]
    assert pair_runs([(3, 1), (3, 2)]) == [(3, 1, 1), (3, 2, 1)]
    assert pair_runs([]) == []
    cache = _random_cache(16, torch.float32)
    before = cache.kv.clone()
    pool = HostKVPool(cache, 12)
    pool.run([(7, 11), (5, 9), (6, 10)], [])
    assert pool.copies["offload"] == 1
    assert torch.equal(pool.host[9:12], before[5:8])
    pool.host[:6].copy_(torch.arange(6.0).view(6, 1, 1, 1).expand(6, *pool.host.shape[1:]))
    pool.run([], [(5, 3), (2, 10), (0, 8), (4, 2), (3, 11), (1, 9)])
    assert pool.copies["load"] == 2
    for slot, block in ((0, 8), (1, 9), (2, 10), (3, 11), (4, 2), (5, 3)):
        assert bool((cache.kv[block] == slot).all()), (slot, block)


def test_a_block_offloaded_and_loaded_into_in_one_command_is_read_first() -> None:
    """An evicted block is handed out in the same plan: its offload runs before the load that
    fills it for its new owner, and a slot that load reads was written by an earlier command."""
    cache = _random_cache(4, torch.float32)
    pool = HostKVPool(cache, 4)
    pool.run([(1, 0)], [])
    held = cache.kv[1].clone()
    pool.host[3].fill_(7)
    pool.run([(1, 2)], [(3, 1)])
    assert torch.equal(pool.host[2], held) and bool((cache.kv[1] == 7).all())


def test_a_slot_spilled_to_twice_in_one_command_keeps_the_later_block() -> None:
    cache = _random_cache(4, torch.float32)
    pool = HostKVPool(cache, 4)
    pool.run([(2, 1), (0, 0), (3, 1)], [])
    assert torch.equal(pool.host[1], cache.kv[3]) and torch.equal(pool.host[0], cache.kv[0])


# -- the order of the copies, on a stream apart from the host -------------------------------

GUARD_S = 60.0  # a wait that never ends is a failure, not a hang


class _Event:
    """A CUDA event's stand-in: reached when its stream gets to it."""

    def __init__(self) -> None:
        self._reached = threading.Event()
        self.at = 0.0

    def reach(self) -> None:
        self.at = time.perf_counter()
        self._reached.set()

    def query(self) -> bool:
        return self._reached.is_set()

    def synchronize(self) -> None:
        assert self._reached.wait(GUARD_S), "the stream never got to this event"

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0


class _Stream:
    """A device stream's stand-in: what is issued on it runs in order on its own thread, apart
    from the host and from other streams. ``issued`` is its queue as issued: a wait for an
    event, or work."""

    def __init__(self) -> None:
        self.issued: list[tuple[str, Any]] = []
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (fn := self._work.get()) is not None:
            fn()

    def issue(self, fn: Any, what: str = "work") -> None:
        self.issued.append((what, fn))
        self._work.put(fn)

    def wait_event(self, e: _Event) -> None:
        self.issued.append(("wait", e))
        self._work.put(e._reached.wait)

    def event(self, timing: bool = False) -> _Event:
        e = _Event()
        self.issue(e.reach, "event")
        return e

    def synchronize(self) -> None:
        self.event().synchronize()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(GUARD_S)


class _CopyStream(_Stream):
    """The pool's stream, its copies slow: each waits for ``gate`` (open unless given)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.gate = gate

    def copy(self, dst: torch.Tensor, src: torch.Tensor,
             runs: list[tuple[int, int, int]]) -> None:
        def run() -> None:
            if self.gate is not None:
                self.gate.wait()
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n])
        self.issue(run, "copy")


@pytest.fixture
def streams() -> Iterator[list[_Stream]]:
    made: list[_Stream] = []
    yield made
    for st in made:
        if isinstance(st, _CopyStream) and st.gate is not None:
            st.gate.set()
        st.close()


def test_a_load_waits_for_no_compute_queued_before_it(streams: list[_Stream]) -> None:
    """A step queued on the compute stream runs until the test ends; a load issued after it
    still completes: the pool's stream never waits for compute (kv/host_pool.py, Order)."""
    cache = _random_cache(16, torch.float32)
    copier, compute = _CopyStream(), _Stream()
    streams += [copier, compute]
    pool = HostKVPool(cache, 8, stream=copier)
    pool.host.copy_(torch.randn(pool.host.shape))
    step = threading.Event()
    compute.issue(step.wait)  # a queued step that touches none of the blocks
    try:
        pool.run([], [(s, 8 + s) for s in range(8)], [compute])
        pool.wait()  # the host's wait before a KV READ: over with the step still running
        assert torch.equal(cache.kv[8:16], pool.host)
        assert not step.is_set()
        assert pool.take_stats()["load"]["blocks"] == 8
    finally:
        step.set()


def test_the_step_after_a_slow_load_reads_what_it_loaded(streams: list[_Stream]) -> None:
    """The copies are held up on the pool's stream; the compute stream is made to wait for
    them before anything issued after the command, so the step reads the loaded blocks, and
    an offload and a load of one command keep their order (the block is read out first)."""
    cache = _random_cache(16, torch.float32)
    gate = threading.Event()
    copier, compute = _CopyStream(gate), _Stream()
    streams += [copier, compute]
    pool = HostKVPool(cache, 8, stream=copier)
    pool.host[:4].fill_(7.0)
    held = cache.kv[2].clone()
    pool.run([(2, 5)], [(s, s) for s in range(4)], [compute])
    assert [what for what, _ in compute.issued] == ["wait"]
    assert compute.issued[0][1] is pool._last
    seen: list[torch.Tensor] = []
    compute.issue(lambda: seen.append(cache.kv[:4].clone()))
    gate.set()
    compute.synchronize()
    assert bool((seen[0] == 7.0).all()), "the step read the blocks before the load"
    assert torch.equal(pool.host[5], held)


def _settings(**env: str) -> Any:
    from pdd_sidecar.env import InstanceSettings

    return InstanceSettings.from_env({
        "PDD_ROLE": "prefill", "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": str(BLOCK),
        "PDD_ROUTING_FILE": "/r.json", "PDD_GRANT_KEY_FILE": "/k", **env})


def test_a_rank_sizes_its_pool_from_the_setting_and_refuses_one_that_holds_no_block(
        caplog: pytest.LogCaptureFixture) -> None:
    from pdd_sidecar.engine.host_tier import tier_slots

    assert tier_slots(_settings(), BLOCK_BYTES) == 0  # off by default
    assert tier_slots(_settings(PDD_HOST_KV_CACHE_GIB=str(HOST_GIB)), BLOCK_BYTES) == 160
    assert tier_slots(_settings(PDD_HOST_KV_CACHE_GIB="1"), BLOCK_BYTES) == (1 << 30) // 7680
    with pytest.raises(ValueError, match=r"PDD_HOST_KV_CACHE_GIB=1e-06 holds no KV block "
                                         r"\(7680 bytes per rank\)"):
        tier_slots(_settings(PDD_HOST_KV_CACHE_GIB="0.000001"), BLOCK_BYTES)
    off = _settings(PDD_HOST_KV_CACHE_GIB="1", PDD_PREFIX_CACHE="0")
    assert tier_slots(off, BLOCK_BYTES) == 0
    assert "PDD_HOST_KV_CACHE_GIB=1.0 is ignored: the prefix cache is off" in caplog.text


def test_the_log_says_what_identical_copies_cost_with_dcp_1() -> None:
    from pdd_sidecar.engine.host_tier import describe_tier

    per_rank = "host KV tier: 160 blocks of 7680 bytes per rank (0.00 GiB)"
    assert describe_tier(160, BLOCK_BYTES, 1, 1) == per_rank
    assert describe_tier(160, BLOCK_BYTES, 4, 4) == per_rank  # each rank its own tokens
    assert describe_tier(32768, 1 << 21, 8, 1) == (
        "host KV tier: 32768 blocks of 2097152 bytes per rank (64.00 GiB); the 8 ranks hold "
        "the same blocks (dcp=1): 512.00 GiB of host memory for 64.00 GiB of capacity")


# -- the scheduler, the index and a pool together ------------------------------------------


class _Prefill:
    """A prefill scheduler over a real cache, prefix cache, host index and pool; a step runs
    the command's copies, then checks every row a chunk reads and writes its own rows (the KV
    of token t at position p is (t, p, 1, 2)), as a rank does."""

    def __init__(self, num_blocks: int, slots: int) -> None:
        self.cache = PagedKVCache(num_blocks, 1, BLOCK, 4)
        self.pc = PrefixCache(self.cache, BLOCK, chain_root({"dcp": 1}))
        self.tier = HostTier(slots, BLOCK)
        self.pc.on_evict = self.tier.spill
        self.pool = HostKVPool(self.cache, slots)
        self.sched = Scheduler("prefill", self.cache, BLOCK, 1, 1, prefix_cache=self.pc,
                               host_tier=self.tier)

    def submit(self, rid: str, prompt: list[int]) -> Sequence:
        seq = Sequence(rid, prompt, 1, len(prompt))
        self.sched.submit(seq)
        return seq

    def step(self) -> None:
        plan = self.sched.plan()
        ops = self.tier.take()
        self.pool.run(ops.offloads, ops.loads)
        for c in plan.prefill:
            seq = c.seq
            for p in range(c.start + len(c.tokens)):
                b, o = seq.blocks[p // BLOCK], p % BLOCK
                if p < c.start:
                    want = torch.tensor([seq.prompt[p], p, 1, 2], dtype=torch.float32)
                    assert torch.equal(self.cache.kv[b, 0, o], want), (seq.id, p)
                else:
                    self.cache.kv[b, 0, o] = torch.tensor([seq.prompt[p], p, 1, 2])
            self.sched.on_chunk_done(c)
            if c.last:
                self.sched.finish_prefill(seq, keep_blocks=False)

    def run(self, rid: str, prompt: list[int]) -> int:
        seq = self.submit(rid, prompt)
        while seq.state is not State.FINISHED:
            self.step()
        return int(seq.extra[CACHED_TOKENS])


def test_prompts_evicted_from_the_device_come_back_from_host_memory() -> None:
    f = _Prefill(num_blocks=8, slots=32)
    a = _tokens(4 * BLOCK + 3, 1)
    assert f.run("a", a) == 0
    for i in range(3):  # 5 blocks each: a's units leave the device
        f.run(f"x{i}", _tokens(4 * BLOCK + 5, 10 + i))
    assert f.pc.lookup(f.pc.keys(a)) == []
    copies = f.pool.copies["load"]
    assert f.run("a2", a + _tokens(9, 2)) == 4 * BLOCK  # every whole unit, from host memory
    assert f.tier.hit_tokens == 4 * BLOCK
    # a's units left in two evictions (x0's and x1's), each spilled in table order: two runs
    # of slots into one run of fresh blocks, two copies (one per block before)
    assert f.pool.copies["load"] - copies == 2
    assert f.run("a3", a) == 4 * BLOCK  # now on the device again
    assert f.tier.hit_tokens == 4 * BLOCK


def test_a_load_is_not_raced_by_the_reuse_of_its_slot_or_its_block() -> None:
    """The host holds a's four units and has four slots free; the device is full of b's cached
    units. One plan admits a prompt continuing a (four loads into fresh blocks, b's, evicted and
    spilled by that very admission) and a prompt of its own, whose admission evicts five more
    of b's units. b's blocks are copied out before a's KV is loaded into them; the second
    admission's spills find the host full and must not take a's slots while they are being
    loaded (unpinned, a's would be next once b's four spilled ones are taken)."""
    f = _Prefill(num_blocks=10, slots=8)
    a = _tokens(4 * BLOCK + 3, 1)
    f.run("a", a)
    b = _tokens(9 * BLOCK + 1, 2)
    f.run("b", b)  # 10 blocks: evicts all of a into 4 slots; b's 9 units cached
    assert len(f.tier.lookup(f.pc.keys(a))) == 4 and f.tier.used_slots == 4
    x = f.submit("x", a + _tokens(5, 3))
    y = f.submit("y", _tokens(4 * BLOCK + 5, 4))
    f.sched.plan()  # admits both: 2 x 5 fresh blocks, from b's 9 cached units and 1 free
    f.sched.hold()
    assert x.extra[CACHED_TOKENS] == 4 * BLOCK and y.extra[CACHED_TOKENS] == 0
    assert not set(x.blocks) & set(y.blocks)
    table = x.blocks[:4]
    assert f.pc.lookup(f.pc.keys(a)) == []  # being loaded: in no index yet
    assert f.tier.used_slots == 8  # 9 of b's units spilled into 4 slots: a's were pinned
    assert len(f.tier.lookup(f.pc.keys(a))) == 4
    f.step()  # the copies (offloads first), then every loaded row is checked
    for u, key in enumerate(f.pc.keys(b)):
        for slot in f.tier.lookup([key]):  # b's units that made it to host memory
            rows = f.pool.host[slot, 0, :, :2]
            want = [[b[p], p] for p in range(u * BLOCK, (u + 1) * BLOCK)]
            assert rows.tolist() == want, u
    while x.state is not State.FINISHED or y.state is not State.FINISHED:
        f.step()
    assert f.pc.lookup(f.pc.keys(a)) == table  # cached once computed after


def test_prompts_that_arrive_together_load_a_host_prefix_once() -> None:
    """a's four units are in host memory only; four prompts continuing a arrive together. The
    first loads them, the others wait for the step after the load (holding up nobody: c, which
    shares nothing, runs at once) and take them as device hits: four blocks loaded, not
    sixteen, and every row each prompt reads is a's."""
    f = _Prefill(num_blocks=24, slots=16)
    a = _tokens(4 * BLOCK + 3, 1)
    f.run("a", a)
    for i in range(4):  # 4 x 8 blocks turn the device cache over: a's units leave it
        f.run(f"x{i}", _tokens(8 * BLOCK - 3, 10 + i))
    assert f.pc.lookup(f.pc.keys(a)) == [] and len(f.tier.lookup(f.pc.keys(a))) == 4
    loaded, copies = f.tier.loaded_blocks, f.pool.copies["load"]
    seqs = [f.submit(f"s{i}", a + _tokens(5 + i, 20 + i)) for i in range(4)]
    c = f.submit("c", _tokens(2 * BLOCK, 30))
    f.step()
    assert seqs[0].state is State.FINISHED and c.state is State.FINISHED
    assert [s.id for s in f.sched.waiting] == ["s1", "s2", "s3"]
    while any(s.state is not State.FINISHED for s in seqs):
        f.step()
    assert f.tier.loaded_blocks - loaded == 4
    assert f.pool.copies["load"] - copies >= 1
    assert f.tier.hit_tokens == 4 * BLOCK
    assert [s.extra[CACHED_TOKENS] for s in seqs] == [4 * BLOCK] * 4


# -- through a running stack ----------------------------------------------------------------


def _stack(cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int],
           prefill_env: dict[str, Any], decode_env: dict[str, Any]) -> dict[str, Proc]:
    routing = cluster.plan_file(plan_json(p, d, BLOCK), f"routing-{len(cluster.procs)}.json")
    prefill = cluster.instance("prefill", p[0], p[1], routing, BLOCK, **prefill_env)
    decode = cluster.instance("decode", d[0], d[1], routing, BLOCK, PDD_PREFILL_URLS=prefill.url,
                              **decode_env)
    router = cluster.router([prefill], [decode], PDD_BLOCK_SIZE=BLOCK)
    for proc in (prefill, decode, router):
        proc.wait_ready()
    return {"prefill": prefill, "decode": decode, "router": router}


def _complete(router: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    status, body = http("POST", f"{router}/v1/completions",
                        {"prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                         "ignore_eos": True}, timeout=300)
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def _metrics(url: str, name: str) -> float:
    """The sum of a metric's samples (every label)."""
    _, text = http("GET", f"{url}/metrics")
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.parametrize("p,d,graphs", [((1, 1), (1, 1), "eager"), ((2, 2), (2, 2), "eager"),
                                        ((1, 1), (2, 2), "eager"), ((1, 1), (1, 1), "padded")])
def test_prefixes_evicted_on_the_prefill_load_back_with_the_same_tokens(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int], graphs: str) -> None:
    """16 blocks a prefill rank: 12 prompts of 3-5 units turn the device cache over; asked
    again, each oldest prompt's whole units come from host memory, and every answer is the
    one a run from scratch gives (the tier off). With the graphs' padded twin a hit may run
    as its whole prompt in a padded step (engine/graphed_hits.py), its loaded blocks still
    handed off."""
    env: dict[str, Any] = {"PDD_NUM_BLOCKS": 16, "PDD_HOST_KV_CACHE_GIB": HOST_GIB}
    if graphs == "padded":
        env["PDD_CUDA_GRAPHS"] = "padded"
    stack = _stack(cluster, p, d, env, {})
    router, prefill = stack["router"].url, stack["prefill"].url
    unit = BLOCK * p[1]
    prompts = [_tokens(2 * unit + 7 + 9 * (i % 3), 100 + i) for i in range(12)]
    for q in prompts:
        body = _complete(router, q, 3)
        assert body["choices"][0]["token_ids"] == reference_tokens(q, 3, BLOCK)
    assert _metrics(prefill, "pdd_host_kv_offload_bytes_total") > 0
    for q in prompts[:4]:  # the first ones left the device long ago
        body = _complete(router, q, 3)
        assert body["choices"][0]["token_ids"] == reference_tokens(q, 3, BLOCK)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            (len(q) - 1) // unit * unit)
    if graphs == "padded":  # the hits ran as whole prompts, the loads happened anyway
        assert _metrics(prefill, "pdd_prefix_cache_recomputed_total") > 0
    hits = _metrics(prefill, "pdd_host_kv_hits_total")
    assert hits >= 4 * 2 * unit
    assert _metrics(prefill, "pdd_prefix_cache_hits_total") >= hits
    assert _metrics(prefill, "pdd_host_kv_blocks") > 0
    assert _metrics(prefill, "pdd_host_kv_blocks_total") == 160
    loads = re.findall(r'^pdd_host_kv_load_bytes_total\{rank="(\d)"\} (\S+)$',
                       http("GET", f"{prefill}/metrics")[1], re.M)
    assert sorted(int(r) for r, _ in loads) == list(range(p[0]))  # every rank loads its shard
    assert all(float(v) > 0 for _, v in loads)


def test_requests_that_arrive_together_load_a_host_held_prefix_once(
        cluster: LocalCluster) -> None:
    """A document's units leave the prefill's device for host memory; four requests continuing
    it are sent at once: each answer is a run from scratch's, and the prefill loads the
    document's units once (a later arrival finds them on the device, one at the same time waits
    for the first one's load)."""
    stack = _stack(cluster, (1, 1), (1, 1),
                   {"PDD_NUM_BLOCKS": 16, "PDD_HOST_KV_CACHE_GIB": HOST_GIB}, {})
    router, prefill = stack["router"].url, stack["prefill"].url
    doc = _tokens(4 * BLOCK, 7)
    _complete(router, doc + [1], 2)
    for i in range(3):  # 3 x 6 blocks through a 16-block prefill: the document's units leave
        _complete(router, _tokens(5 * BLOCK + 5, 60 + i), 2)
    before = _metrics(prefill, "pdd_host_kv_load_bytes_total")
    prompts = [doc + _tokens(5 + i, 70 + i) for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda q: _complete(router, q, 3), prompts))
    for q, body in zip(prompts, bodies, strict=True):
        assert body["choices"][0]["token_ids"] == reference_tokens(q, 3, BLOCK)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    assert _metrics(prefill, "pdd_host_kv_load_bytes_total") - before == 4 * BLOCK_BYTES


TURNS, FIRST, NEW, MAX_TOKENS = 3, 40, 9, 10


@pytest.mark.parametrize("p,d", [((1, 1), (1, 1)), ((2, 2), (2, 2)), ((1, 1), (2, 2))])
def test_a_chat_after_decode_side_eviction_pulls_only_its_new_tokens(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int]) -> None:
    """Between the turns of a chat, other requests turn the decode's device cache over, the
    chat's units and partial last unit with it: the next turn loads them back from host memory
    and reads from the prefill exactly its new tokens and the last answer's last token."""
    stack = _stack(cluster, p, d, {},
                   {"PDD_NUM_BLOCKS": 12, "PDD_HOST_KV_CACHE_GIB": HOST_GIB})
    router, decode = stack["router"].url, stack["decode"].url
    unit = BLOCK * d[1]
    prompt = _tokens(FIRST, 5)
    for k in range(TURNS):
        body = _complete(router, prompt, MAX_TOKENS)
        done = body["choices"][0]["token_ids"]
        assert done == reference_tokens(prompt, MAX_TOKENS, BLOCK), k
        moved = body["pdd"]["transfer"]["bytes"]
        if k:
            assert moved == (1 + NEW) * ROW_BYTES, (k, moved)
        for j in range(3):  # 3 x ~7 units through a 12-block decode: the chat's leave
            _complete(router, _tokens(5 * unit + 3, 50 + 3 * k + j), 2)
        prompt = prompt + done + _tokens(NEW, 20 + k)
    assert _metrics(decode, "pdd_host_kv_hits_total") >= (TURNS - 1) * FIRST
    assert _metrics(decode, "pdd_host_kv_load_bytes_total") > 0
    assert _metrics(decode, "pdd_host_kv_load_seconds_total") > 0

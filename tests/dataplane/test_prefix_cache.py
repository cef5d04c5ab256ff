"""The prefill's prefix cache through the router: requests sharing prefixes (and identical ones,
at once) get exactly the tokens a from-scratch run gives, for every layout the hand-off takes;
`cached_tokens` is the shared whole units; eviction under pressure stays exact and gives every
block back; off, nothing is cached."""

from __future__ import annotations

import concurrent.futures
import functools
import re
import time
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
from runtime_fixtures import LocalCluster, Proc, http, pd_stack, plan_json, reference_tokens

pytestmark = pytest.mark.dataplane

BLOCK = 16
SHARED = 70  # a system prompt: whole units of 16 or 32 tokens cover its first 64


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 53 + salt * 29 + 7) % 256 for i in range(n)]


def _reference(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_tokens(prompt, max_tokens, BLOCK)


def _stack(cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int],
           **prefill_env: Any) -> dict[str, Proc]:
    return pd_stack(cluster, p, d, BLOCK, prefill_env=prefill_env)


def _run(router: str, prompts: list[list[int]], max_tokens: int) -> list[int]:
    """Every prompt at once; checks each answer against the reference; its cached tokens."""
    def one(prompt: list[int]) -> tuple[int, Any]:
        return http("POST", f"{router}/v1/completions",
                    {"prompt": prompt, "temperature": 0, "max_tokens": max_tokens}, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, prompts))
    cached = []
    for i, (status, body) in enumerate(answers):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _reference(prompts[i], max_tokens), i
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached


def _metric(url: str, name: str) -> float:
    _, text = http("GET", f"{url}/metrics")
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _all_blocks_back(*urls: str, within_s: float = 10.0) -> None:
    """Free (cached but unreferenced counts as free) equals the total on every rank, less the
    blocks the driver keeps for itself."""
    deadline = time.monotonic() + within_s
    while True:
        states = [http("GET", f"{u}/v1/stats")[1] for u in urls]
        if all(r["free_blocks"] + s["reserved_blocks"] == s["num_blocks"]
               for s in states for r in s["ranks"]):
            return
        assert time.monotonic() < deadline, f"blocks still held: {states}"
        time.sleep(0.1)


def _cap(prompt: list[int], unit: int) -> int:
    """Whole units before the prompt's last token: what a hit can cover."""
    return (len(prompt) - 1) // unit * unit


@pytest.mark.parametrize("p,d", [((2, 2), (2, 2)), ((1, 1), (2, 2)), ((2, 2), (2, 1))])
def test_shared_prefixes_give_the_tokens_of_a_run_from_scratch(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int]) -> None:
    stack = _stack(cluster, p, d)
    router, prefill = stack["router"].url, stack["prefill"].url
    unit = BLOCK * p[1]  # one table entry: what the cache keys
    system = _tokens(SHARED, 1)
    shared = SHARED // unit * unit
    assert _run(router, [system + _tokens(9, 2)], 5) == [0]  # caches the system prompt
    distinct = [system + _tokens(5 + 7 * i, 10 + i) for i in range(8)]
    same = system + _tokens(30, 40)
    batch = distinct + [same] * 4 + [_tokens(50, 50)]
    cached = _run(router, batch, 6)
    assert cached[:8] == [shared] * 8, cached
    assert all(shared <= c <= _cap(same, unit) for c in cached[8:12]), cached
    assert cached[12] == 0
    again = _run(router, batch, 6)  # every whole unit of every prompt is cached by now
    assert again == [_cap(q, unit) for q in batch], again
    hits = _metric(prefill, "pdd_prefix_cache_hits_total")
    assert hits == sum(cached) + sum(again)
    assert _metric(prefill, "pdd_prefix_cache_queries_total") >= sum(
        len(q) for q in batch) * 2 + SHARED + 9
    assert _metric(prefill, "pdd_prefix_cache_blocks") > 0
    _all_blocks_back(prefill, stack["decode"].url)


def test_more_distinct_prefixes_than_blocks_evict_and_stay_exact(cluster: LocalCluster) -> None:
    """24 blocks of 16 tokens, 40 prompts of 4-6 blocks: the cache turns over many times, the
    least recently used going first. The first prompts were evicted (they miss when sent
    again); four recent ones of 5 blocks (4 whole units each) fit beside each other, so the
    oldest of them is still cached after the other three came."""
    stack = _stack(cluster, (1, 1), (2, 2), PDD_NUM_BLOCKS=24)
    router, prefill = stack["router"].url, stack["prefill"].url
    prompts = [_tokens(64 + 9 * (i % 3), 100 + i) for i in range(40)]
    for start in range(0, 40, 8):
        assert _run(router, prompts[start:start + 8], 4) == [0] * 8
    assert _run(router, prompts[:3], 4) == [0] * 3  # exact, and computed again: evicted
    recent = [_tokens(73, 200 + i) for i in range(4)]
    for prompt in recent:
        assert _run(router, [prompt], 4) == [0]
    assert _run(router, recent[:1], 4) == [_cap(recent[0], BLOCK)]
    assert _metric(prefill, "pdd_prefix_cache_blocks") >= 4 * 4
    _all_blocks_back(prefill, stack["decode"].url)


def test_off_caches_nothing(cluster: LocalCluster) -> None:
    stack = _stack(cluster, (1, 1), (1, 1), PDD_PREFIX_CACHE="0")
    router, prefill = stack["router"].url, stack["prefill"].url
    prompt = _tokens(80, 3)
    assert _run(router, [prompt], 4) == [0]
    assert _run(router, [prompt, prompt], 4) == [0, 0]
    _, text = http("GET", f"{prefill}/metrics")
    assert "pdd_prefix_cache_hits_total 0.0" in text
    _all_blocks_back(prefill, stack["decode"].url)


@pytest.mark.parametrize("dcp", [1, 2])
def test_scheduler_shares_whole_units_and_computes_only_the_rest(dcp: int) -> None:
    from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Scheduler, Sequence
    from pdd_sidecar.kv.cache import PagedKVCache
    from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root

    unit = BLOCK * dcp
    cache = PagedKVCache(16, 1, BLOCK, 4)
    pc = PrefixCache(cache, unit, chain_root({"dcp": dcp}))
    sched = Scheduler("prefill", cache, BLOCK, dcp, 2, prefix_cache=pc)
    first = _tokens(100, 1)
    a = Sequence("a", first, 4, len(first))
    sched.submit(a)
    (chunk,) = sched.plan().prefill
    assert chunk.start == 0 and a.extra[CACHED_TOKENS] == 0
    sched.on_chunk_done(chunk)
    sched.finish_prefill(a, keep_blocks=True)  # now held for a decode: a lease's reference
    b = Sequence("b", first[:80] + _tokens(20, 2), 4, 100)
    sched.submit(b)
    (chunk,) = sched.plan().prefill
    shared = 80 // unit
    assert chunk.start == shared * unit == b.extra[CACHED_TOKENS] == b.computed
    assert chunk.tokens == b.prompt[shared * unit:]
    assert b.blocks[:shared] == a.blocks[:shared]
    assert not set(b.blocks[shared:]) & set(a.blocks)  # the rest goes into blocks of its own
    sched.cancel("b")
    assert all(pc.refs(x) == 1 for x in a.blocks)
    c = Sequence("c", list(first), 4, 100)  # the same prompt: all but its last unit
    sched.submit(c)
    (chunk,) = sched.plan().prefill
    assert chunk.start == (len(first) - 1) // unit * unit and chunk.last
    sched.cancel("c")
    pc.free(a.blocks)
    assert pc.num_free == cache.num_blocks and cache.num_free + pc.cached_blocks == 16


def test_shared_blocks_keep_the_hand_off_rules(cluster: LocalCluster) -> None:
    """Two grants share cached blocks: releasing one leaves the other readable and exact, and
    the released grant's claim is refused though its blocks are still cached and in use."""
    routing = cluster.plan_file(plan_json((2, 2), (2, 2), BLOCK))
    prefill = cluster.instance("prefill", 2, 2, routing, BLOCK)
    decode = cluster.instance("decode", 2, 2, routing, BLOCK, PDD_PREFILL_URLS=prefill.url)
    prefill.wait_ready()
    decode.wait_ready()
    prompt = _tokens(80, 7)
    grants = []
    for rid in ("a", "b"):
        status, pre = http("POST", f"{prefill.url}/v1/prefill",
                           {"request_id": rid, "prompt_ids": prompt, "max_tokens": 6})
        assert status == 200, pre
        grants.append(pre)
    a, b = grants
    assert (a["cached_tokens"], b["cached_tokens"]) == (0, 64)
    ga, gb = a["kv_transfer_params"], b["kv_transfer_params"]
    assert gb["block_ids"][:2] == ga["block_ids"][:2] and ga["epoch"] != gb["epoch"]
    status, released = http("POST", f"{prefill.url}/v1/release", {"kv_transfer_params": ga})
    assert status == 200 and released == {"released": True}
    status, body = http("POST", f"{prefill.url}/v1/claim", {"kv_transfer_params": ga,
                                                             "hold_s": 5})
    assert status == 410, body
    status, body = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "a", "first_token": a["first_token"], "max_new_tokens": 5,
        "kv_transfer_params": ga})
    assert status == 410, body
    status, body = http("POST", f"{decode.url}/v1/decode", {
        "request_id": "b", "first_token": b["first_token"], "max_new_tokens": 5,
        "kv_transfer_params": gb}, timeout=60)
    assert status == 200, body
    assert [b["first_token"], *body["token_ids"]] == _reference(prompt, 6)
    _all_blocks_back(prefill.url, decode.url)



def _prefill_scheduler(num_blocks: int = 64, chunk: int = 32, dcp: int = 1) -> tuple[Any, Any]:
    """(prefix cache, prefill scheduler over it) with chunks of ``chunk`` tokens."""
    from pdd_sidecar.engine.scheduler import Scheduler
    from pdd_sidecar.kv.cache import PagedKVCache
    from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root

    cache = PagedKVCache(num_blocks, 1, BLOCK, 4)
    pc = PrefixCache(cache, BLOCK * dcp, chain_root({"dcp": dcp}))
    return pc, Scheduler("prefill", cache, BLOCK, dcp, 1, prefix_cache=pc, chunk_tokens=chunk,
                         step_tokens=4 * chunk)


def _step(sched: Any) -> dict[str, tuple[int, int]]:
    """Plan a step and run it: each prompt's chunk (start, end) in it."""
    chunks = sched.plan().prefill
    for c in chunks:
        sched.on_chunk_done(c)
        if c.last:
            sched.finish_prefill(c.seq, keep_blocks=False)
    return {c.seq.id: (c.start, c.start + len(c.tokens)) for c in chunks}


@pytest.mark.parametrize("dcp", [1, 2])
def test_a_prompt_whose_prefix_is_mid_prefill_waits_for_it_and_holds_up_nobody(dcp: int) -> None:
    from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Sequence

    unit = BLOCK * dcp
    pc, sched = _prefill_scheduler(chunk=2 * unit, dcp=dcp)
    long = _tokens(6 * unit + 4, 1)
    a = Sequence("a", long, 2, len(long))
    sched.submit(a)
    assert _step(sched) == {"a": (0, 2 * unit)}
    shared = 5 * unit  # b shares a's first five units, two of them computed by now
    b = Sequence("b", long[:shared] + _tokens(9, 2), 2, shared + 9)
    c = Sequence("c", _tokens(3 * unit, 3), 2, 3 * unit)  # behind b, sharing nothing
    sched.submit(b)
    sched.submit(c)
    ran = _step(sched)
    assert "b" not in ran and ran["c"][0] == 0 and ran["a"] == (2 * unit, 4 * unit)
    assert [s.id for s in sched.waiting] == ["b"] and b.blocks == []
    ran = _step(sched)  # a computes unit 4, the last b shares, in this step
    assert "b" not in ran and ran["a"] == (4 * unit, 6 * unit)
    ran = _step(sched)
    assert ran["b"] == (shared, len(b.prompt)) and b.extra[CACHED_TOKENS] == shared
    computed = len(a.prompt) + len(c.prompt) + len(b.prompt) - shared
    assert sched.computed_tokens == computed
    _step(sched)
    assert not sched.busy and not sched._pending


def test_prompts_that_arrive_together_compute_their_prefix_once() -> None:
    from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Sequence

    pc, sched = _prefill_scheduler(num_blocks=128, chunk=64)
    system = _tokens(3 * BLOCK, 4)
    seqs = [Sequence(f"s{i}", system + _tokens(BLOCK, 10 + i), 2, 4 * BLOCK) for i in range(16)]
    for s in seqs:
        sched.submit(s)
    ran = _step(sched)
    assert list(ran) == ["s0"]  # the others wait for its three shared units
    while sched.busy:
        _step(sched)
    assert [s.extra[CACHED_TOKENS] for s in seqs] == [0] + [3 * BLOCK] * 15
    assert sched.computed_tokens == 3 * BLOCK + 16 * BLOCK  # the distinct tokens
    assert all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_nobody_waits_for_a_prefix_whose_prompt_went_away(how: str) -> None:
    """A prompt cancelled (or failed: the driver cancels it with its error) mid-prefill takes
    its pending units with it: the waiter takes what was computed and computes the rest."""
    from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Sequence

    pc, sched = _prefill_scheduler(chunk=2 * BLOCK)
    long = _tokens(8 * BLOCK, 5)
    a = Sequence("a", long, 2, len(long))
    sched.submit(a)
    _step(sched)
    b = Sequence("b", long[:6 * BLOCK] + [1, 2, 3], 2, 6 * BLOCK + 3)
    sched.submit(b)
    assert "b" not in _step(sched)
    if how == "failed":
        a.error = {"error": "step failed", "status": 500, "kind": "internal_error"}
    sched.cancel("a")
    assert a.finish_reason == "cancelled" and not sched._pending
    ran = _step(sched)
    assert ran["b"] == (4 * BLOCK, 4 * BLOCK + 2 * BLOCK) and b.extra[CACHED_TOKENS] == 4 * BLOCK
    while sched.busy:
        _step(sched)
    assert b.finish_reason == "length" and pc.num_free == pc.num_blocks


def _decode_scheduler(dcp: int, num_blocks: int, tp: int) -> tuple[Any, Any, Any]:
    """(cache, prefix cache, decode scheduler over it) for ``dcp`` and ``tp`` ranks."""
    from pdd_sidecar.engine.scheduler import Scheduler
    from pdd_sidecar.kv.cache import PagedKVCache
    from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root

    cache = PagedKVCache(num_blocks, 1, BLOCK, 4)
    pc = PrefixCache(cache, BLOCK * dcp, chain_root({"dcp": dcp}))
    return cache, pc, Scheduler("decode", cache, BLOCK, dcp, tp, prefix_cache=pc)


def _turn(sched: Any, rid: str, prompt: list[int], max_tokens: int) -> Any:
    """A request the decode admits into its pull at once (the prefill chose token 99)."""
    from types import SimpleNamespace

    from pdd_sidecar.engine.scheduler import Sequence

    seq = Sequence(rid, prompt, max_tokens, len(prompt) + max_tokens,
                   source=SimpleNamespace(num_tokens=len(prompt)), first_token=99)
    sched.submit(seq)
    assert sched.plan().pulls == [seq]
    return seq


def _decode_to_the_end(sched: Any, seq: Any, tp: int) -> None:
    """Pull (every rank done), then feed tokens 1, 2, ... until the sequence finishes."""
    for rank in range(tp):
        sched.on_pulled(seq.id, rank, None)
    while seq.state.value == "running":
        plan = sched.plan()
        for entry in plan.decode:
            sched.on_token(entry.seq, len(entry.seq.output) + 1)


@pytest.mark.parametrize("dcp", [1, 2])
def test_decode_scheduler_shares_what_a_finished_turn_fed_and_pulls_the_rest(dcp: int) -> None:
    from pdd_sidecar.engine.scheduler import CACHED_TOKENS

    unit = BLOCK * dcp
    cache, pc, sched = _decode_scheduler(dcp, 32, 2)
    turn = functools.partial(_turn, sched)

    a = turn("a", _tokens(100, 1), 20)
    assert a.extra[CACHED_TOKENS] == 0 and sched.start_token(a) == 0
    a_blocks = list(a.blocks)
    _decode_to_the_end(sched, a, 2)
    assert a.finish_reason == "length" and a.output == list(range(1, 21))
    fed = a.prompt + [99] + a.output[:-1]  # the last token was never fed: no KV
    shared = len(fed) // unit
    assert len(fed) % unit  # the last unit is partial: kept as a tail
    assert pc.cached_blocks == shared and pc.tail_blocks == 1
    assert pc.num_free == cache.num_blocks  # cached, yet nobody holds them

    b = turn("b", fed + a.output[-1:] + _tokens(7, 2), 5)  # the next turn of the chat
    assert b.extra[CACHED_TOKENS] == len(fed)  # the whole units and the tail it continues
    assert sched.start_token(b) == len(fed)  # pulls the unfed last token and the new ones
    assert b.blocks[:shared + 1] == a_blocks[:shared + 1] and pc.tail_blocks == 0
    assert pc.refs(b.blocks[shared]) == 1  # the tail is b's alone
    assert not set(b.blocks[shared + 1:]) & set(a_blocks)  # written into its own only
    c = turn("c", fed[:shared * unit], 3)  # a prompt the cache holds whole: nothing to read
    assert c.extra[CACHED_TOKENS] == len(c.prompt)
    assert sched.start_token(c) == len(c.prompt)
    assert all(pc.refs(x) == 2 for x in a_blocks[:shared])  # b and c share them
    sched.cancel("c")
    _decode_to_the_end(sched, c, 2)  # cancelled while pulling: caches nothing new
    assert c.finish_reason == "cancelled" and pc.cached_blocks == shared
    d = turn("d", _tokens(40, 3), 4)
    sched.on_pulled("d", 0, {"error": "x", "status": 502, "kind": "transfer"})
    sched.on_pulled("d", 1, None)
    assert d.finish_reason == "error" and pc.cached_blocks == shared  # failed pull: not cached
    _decode_to_the_end(sched, b, 2)
    assert pc.cached_blocks == (len(b.prompt) + 1 + 4 - 1) // unit
    assert pc.tail_blocks == (1 if (len(b.prompt) + 1 + 4 - 1) % unit else 0)
    assert pc.num_free == cache.num_blocks and not sched.busy
    pc.clear()
    assert cache.num_free == cache.num_blocks


@pytest.mark.parametrize("dcp", [1, 2])
def test_decode_scheduler_adopts_a_tail_once_for_the_tokens_a_prompt_shares_with_it(
        dcp: int) -> None:
    """A turn regenerated from the middle of the last answer shares part of the tail: it
    adopts the block and pulls from the first token that differs; a second such turn at the
    same time finds no tail (one adopter) and pulls from the unit boundary."""
    from pdd_sidecar.engine.scheduler import CACHED_TOKENS

    unit = BLOCK * dcp
    cache, pc, sched = _decode_scheduler(dcp, 16, 1)
    turn = functools.partial(_turn, sched)

    a = turn("a", _tokens(40, 4), 5)
    a_blocks = list(a.blocks)
    _decode_to_the_end(sched, a, 1)
    fed = a.prompt + [99] + a.output[:-1]
    shared = len(fed) // unit
    assert pc.tail_blocks == 1 and pc.num_free == cache.num_blocks
    cut = shared * unit + 3
    regen = fed[:cut] + [(fed[cut] + 1) % 256] + _tokens(6, 5)
    x = turn("x", regen, 4)
    y = turn("y", list(regen), 4)
    assert x.extra[CACHED_TOKENS] == sched.start_token(x) == cut
    assert y.extra[CACHED_TOKENS] == sched.start_token(y) == shared * unit
    assert x.blocks[:shared] == y.blocks[:shared] and x.blocks[shared] != y.blocks[shared]
    assert x.blocks[shared] == a_blocks[shared]
    assert pc.tail_blocks == 0 and pc.refs(x.blocks[shared]) == 1
    sched.cancel("y")
    _decode_to_the_end(sched, y, 1)
    _decode_to_the_end(sched, x, 1)
    assert x.finish_reason == "length" and pc.tail_blocks == 1
    assert pc.num_free == cache.num_blocks and not sched.busy
    pc.clear()
    assert cache.num_free == cache.num_blocks


def test_decode_without_a_prompt_pulls_everything_and_caches_nothing() -> None:
    from types import SimpleNamespace

    from pdd_sidecar.engine.scheduler import Sequence

    cache, pc, sched = _decode_scheduler(1, 16, 1)
    seq = Sequence("a", [], 6, 70, source=SimpleNamespace(num_tokens=64), first_token=5)
    sched.submit(seq)
    sched.plan()
    assert sched.start_token(seq) == 0
    _decode_to_the_end(sched, seq, 1)
    assert seq.finish_reason == "length" and pc.cached_blocks == 0
    assert cache.num_free == cache.num_blocks


ROW_BYTES = 3 * 40 * 4  # one token's KV: the builtin model's layers x latent x float32
TURNS, FIRST, NEW, MAX_TOKENS = 4, 40, 9, 10


def _both_stack(cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int],
                **env: Any) -> dict[str, Proc]:
    routing = cluster.plan_file(plan_json(p, d, BLOCK), f"routing-{len(cluster.procs)}.json")
    prefill = cluster.instance("prefill", p[0], p[1], routing, BLOCK, **env)
    decode = cluster.instance("decode", d[0], d[1], routing, BLOCK, PDD_PREFILL_URLS=prefill.url,
                              **env)
    router = cluster.router([prefill], [decode], PDD_BLOCK_SIZE=BLOCK)
    for proc in (prefill, decode, router):
        proc.wait_ready()
    return {"prefill": prefill, "decode": decode, "router": router}


def _chat(router: str, salt: int) -> list[tuple[list[int], list[int], int]]:
    """A chat of TURNS turns, each prompt the one before, its completion and NEW tokens; per turn
    (prompt, completion, bytes the decode read)."""
    turns = []
    prompt = _tokens(FIRST, salt)
    for k in range(TURNS):
        status, body = http("POST", f"{router}/v1/completions",
                            {"prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS,
                             "ignore_eos": True}, timeout=300)
        assert status == 200, body
        completion = body["choices"][0]["token_ids"]
        turns.append((prompt, completion, body["pdd"]["transfer"]["bytes"]))
        prompt = prompt + completion + _tokens(NEW, salt + 10 + k)
    return turns


def _decode_bytes(url: str) -> float:
    _, text = http("GET", f"{url}/metrics")
    return sum(float(v) for v in re.findall(r"^pdd_kv_transfer_bytes_total\{[^}]*\} (\S+)$",
                                            text, re.M))


@pytest.mark.parametrize("p,d", [((1, 1), (1, 1)), ((2, 2), (2, 2)), ((1, 1), (2, 2))])
def test_a_follow_up_turn_pulls_only_the_kv_its_decode_lacks(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int]) -> None:
    """Each turn after the first reads exactly the KV after what the turn before fed (its
    prompt, first token and completion but the last token): the decode kept the whole units and
    the partial last one, which the turn adopts. So it moves its new tokens and the previous
    answer's last token, nothing more: the byte counter says so, and the tokens are those of the
    same chat with the prefix cache off, which reads every prompt whole."""
    on = _both_stack(cluster, p, d)
    off = _both_stack(cluster, p, d, PDD_PREFIX_CACHE="0")
    unit = BLOCK * d[1]  # the decode's table entry
    before = _decode_bytes(on["decode"].url)
    chat = _chat(on["router"].url, 5)
    assert _decode_bytes(on["decode"].url) - before == sum(b for _, _, b in chat)
    plain = _chat(off["router"].url, 5)
    assert [c for _, c, _ in chat] == [c for _, c, _ in plain]
    assert [b for _, _, b in plain] == [len(q) * ROW_BYTES for q, _, _ in plain]
    assert chat[0][2] == FIRST * ROW_BYTES
    for (prev, done, _), (prompt, _, moved) in zip(chat, chat[1:], strict=False):
        fed = len(prev) + len(done) - 1
        assert fed % unit  # these turns end mid-unit: without the tail, part of it moves again
        assert moved == (len(prompt) - fed) * ROW_BYTES == (1 + NEW) * ROW_BYTES, (
            len(prompt), fed, moved)
    for proc in (on, off):
        _all_blocks_back(proc["prefill"].url, proc["decode"].url)


def test_decode_prompt_ids_are_checked_against_the_grant_and_the_vocabulary(
        cluster: LocalCluster) -> None:
    stack = _stack(cluster, (1, 1), (1, 1))
    prefill, decode = stack["prefill"].url, stack["decode"].url
    prompt = _tokens(40, 9)
    status, pre = http("POST", f"{prefill}/v1/prefill",
                       {"request_id": "q", "prompt_ids": prompt, "max_tokens": 4})
    assert status == 200, pre
    body = {"request_id": "q", "first_token": pre["first_token"], "max_new_tokens": 3,
            "kv_transfer_params": pre["kv_transfer_params"]}
    for bad_ids, says in ((prompt[:-1], "39 token ids"), (prompt[:-1] + [1 << 30], "1073741824"),
                          ("abc", "list of token ids")):
        status, err = http("POST", f"{decode}/v1/decode", {**body, "prompt_ids": bad_ids})
        assert status == 400, err
        message = err["error"]["message"]
        assert message.startswith("prompt_ids") and says in message, message
    _, stats = http("GET", f"{decode}/v1/stats")
    assert stats["running"] == 0 and stats["waiting"] == 0  # nothing half-created
    status, out = http("POST", f"{decode}/v1/decode", {**body, "prompt_ids": prompt}, timeout=60)
    assert status == 200, out
    assert [pre["first_token"], *out["token_ids"]] == _reference(prompt, 4)
    assert out["cached_tokens"] == 0 and out["transfer"]["bytes"] == 40 * ROW_BYTES
    _all_blocks_back(prefill, decode)


@pytest.mark.parametrize("p,d", [((1, 1), (1, 1)), ((2, 2), (2, 2))])
def test_hits_recomputed_in_a_prefill_graph_give_the_tokens_of_a_run_from_scratch(
        cluster: LocalCluster, p: tuple[int, int], d: tuple[int, int]) -> None:
    """With the graphs' padded twin (PDD_CUDA_GRAPHS=padded), a short prompt that hits runs as
    its whole prompt in a padded prefill step (engine/graphed_hits.py): the tokens of a run
    from scratch, the hit still reported, the recomputed tokens counted, every block back."""
    stack = _stack(cluster, p, d, PDD_CUDA_GRAPHS="padded")
    router, prefill = stack["router"].url, stack["prefill"].url
    unit = BLOCK * p[1]
    system = _tokens(SHARED, 1)
    shared = SHARED // unit * unit
    assert _run(router, [system + _tokens(9, 2)], 5) == [0]
    prompts = [system + _tokens(5 + 7 * i, 20 + i) for i in range(4)]
    assert _run(router, prompts, 5) == [shared] * 4
    recomputed = _metric(prefill, "pdd_prefix_cache_recomputed_total")
    assert recomputed == 4 * shared
    assert _metric(prefill, "pdd_prefix_cache_hits_total") == 4 * shared
    _all_blocks_back(prefill, stack["decode"].url)

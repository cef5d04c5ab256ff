"""The host tier's index, without torch: sizing, chain keys and the compatibility digest, LRU
over slots, pins, tails, the prefix cache's spills and the table a host hit builds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from pdd_cli.main import main
from pdd_sidecar.env import ConfigError, InstanceSettings
from pdd_sidecar.kv.host_tier import GIB, HostTier, host_slots, load_from_host
from pdd_sidecar.kv.prefix_cache import PrefixCache, chain_root, unit_keys
from pdd_sidecar.serve.local_stack import (
    InstancePorts,
    Ports,
    StackConfig,
    config_from_args,
    instance_env,
    parser,
    routing_plan_json,
)

UNIT = 4
RECORD = {"model": "tiny:builtin(seed=1)", "dtype": "float32", "block_size": 4,
          "cache_layout": "L2xB4xD8", "plan_version": 1, "plan_digest": "abc", "dcp": 1}


class Blocks:
    """A plain allocator: lowest free ids, strict about double frees."""

    def __init__(self, n: int) -> None:
        self.num_blocks = n
        self.free_ids = set(range(n))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids), f"requested {n}"
        ids = sorted(self.free_ids)[:n]
        self.free_ids -= set(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        assert not set(ids) & self.free_ids, f"double free {ids}"
        self.free_ids |= set(ids)


def keys(n_units: int, salt: int = 0, record: dict | None = None) -> list[bytes]:
    tokens = [(i * 7 + salt) % 97 for i in range(n_units * UNIT)]
    return unit_keys(chain_root(record or RECORD), tokens, UNIT)


def test_slots_are_the_whole_blocks_the_gib_hold() -> None:
    assert host_slots(1, 1 << 20) == 1024
    assert host_slots(0.5, 3 * (1 << 20)) == 170  # floor(512 / 3)
    assert host_slots(0, 100) == 0
    assert host_slots(1e-7, 100) == 1  # 107 bytes
    with pytest.raises(ValueError, match=">= 0 GiB"):
        host_slots(-1, 100)
    with pytest.raises(ValueError, match="bytes per block"):
        host_slots(1, 0)


def test_slots_floor_exactly() -> None:
    assert host_slots(2, GIB // 3) == 6
    assert host_slots(1, GIB + 1) == 0


def test_spills_get_the_lowest_free_slots_and_are_found_by_their_chain() -> None:
    """Evicted later units first (the prefix cache's order), a table's units still get
    ascending slots in the order of their blocks: one run on both sides, one copy each way."""
    tier = HostTier(8, UNIT)
    k = keys(3)
    tier.spill([(k[2], 12), (k[1], 11), (k[0], 10)])
    ops = tier.take()
    assert ops.offloads == [(10, 0), (11, 1), (12, 2)] and ops.loads == []
    assert tier.lookup(k) == [0, 1, 2]
    assert tier.lookup(k[1:]) == [1, 2]  # the chain goes on from any unit
    assert tier.lookup(keys(3, salt=1)) == []  # other tokens
    assert tier.lookup([k[0], keys(2, salt=1)[1], k[2]]) == [0]  # stops at the first miss
    assert not tier.take()  # taken once


def test_a_key_is_never_found_across_weights_dtype_block_size_or_plan() -> None:
    tier = HostTier(8, UNIT)
    k = keys(2)
    tier.spill([(k[0], 1), (k[1], 2)])
    for field, other in (("model", "tiny:builtin(seed=2)"), ("dtype", "bfloat16"),
                         ("block_size", 8), ("plan_digest", "abd"), ("dcp", 2)):
        assert tier.lookup(keys(2, record={**RECORD, field: other})) == [], field
    assert tier.lookup(keys(2)) == [0, 1]


def test_lru_slots_go_first_and_a_held_key_is_only_touched() -> None:
    tier = HostTier(3, UNIT)
    a, b, c, d = (keys(1, salt=s)[0] for s in range(4))
    tier.spill([(a, 1), (b, 2), (c, 3)])
    tier.take()
    tier.spill([(a, 7)])  # held already: refreshed, no copy
    assert not tier.take()
    tier.spill([(d, 4)])  # b is now the least recently used
    assert tier.take().offloads == [(4, 1)]
    assert tier.lookup([b]) == [] and tier.lookup([a]) == [0] and tier.lookup([d]) == [1]
    assert tier.used_slots == 3


def test_a_slot_being_loaded_is_never_overwritten_before_its_command() -> None:
    tier = HostTier(2, UNIT)
    a, b, c = (keys(1, salt=s)[0] for s in range(3))
    tier.spill([(a, 1), (b, 2)])
    tier.take()
    tier.load([0], [9], UNIT)  # a's slot, into block 9
    tier.spill([(c, 3)])  # a is the oldest, but pinned: b's slot goes
    ops = tier.take()
    assert ops.offloads == [(3, 1)] and ops.loads == [(0, 9)]
    assert tier.lookup([a]) == [0] and tier.lookup([b]) == []
    tier.load([0], [8], UNIT)
    tier.load([1], [7], UNIT)
    tier.spill([(b, 5)])  # every slot pinned: dropped, not copied
    assert tier.dropped_blocks == 1
    ops = tier.take()
    assert ops.offloads == [] and sorted(ops.loads) == [(0, 8), (1, 7)]
    tier.spill([(b, 5)])  # pins end with the command: now it takes the oldest
    assert tier.take().offloads == [(5, 0)]
    assert tier.hit_tokens == 3 * UNIT and tier.loaded_blocks == 3


def test_tails_are_kept_per_parent_and_match_a_prefix_of_their_tokens() -> None:
    tier = HostTier(4, UNIT)
    parent = keys(1)[0]
    tier.spill([], [(parent, (5, 6, 7), 3)])
    assert tier.take().offloads == [(3, 0)]
    hit = tier.lookup_tail(parent, [5, 6, 9, 9])
    assert hit is not None and (hit.slot, hit.tokens) == (0, 2)
    assert tier.lookup_tail(parent, [4]) is None
    assert tier.lookup_tail(keys(1, salt=1)[0], [5, 6, 7]) is None
    tier.spill([], [(parent, (5, 6, 7), 8)])  # the same tail again: touched only
    assert not tier.take()
    tier.spill([], [(parent, (5, 6, 7, 1), 9)])  # a newer tail of that chat replaces it
    assert tier.take().offloads == [(9, 0)] and tier.used_slots == 1
    hit = tier.lookup_tail(parent, [5, 6, 7, 1])
    assert hit is not None and hit.tokens == 4


def test_the_prefix_cache_spills_what_it_evicts_and_clear_spills_nothing() -> None:
    blocks = Blocks(4)
    pc = PrefixCache(blocks, UNIT, chain_root(RECORD))
    tier = HostTier(8, UNIT)
    pc.on_evict = tier.spill
    prompt = [(i * 3) % 50 for i in range(4 * UNIT)]
    k = pc.keys(prompt)
    table = pc.acquire([], 4)
    pc.insert(k, table)
    pc.free(table)  # cached, unreferenced: later units first in the eviction line
    assert not tier.take()
    pc.allocate(2)  # evicts two: units 3 and 2 go to host memory, in table order
    ops = tier.take()
    assert ops.offloads == [(table[2], 0), (table[3], 1)]
    assert pc.lookup(k) == table[:2] and tier.lookup(k[2:]) == [0, 1]
    pc.clear()
    assert not tier.take()


def test_a_host_hit_gets_fresh_blocks_after_the_device_hits_and_before_the_tail() -> None:
    blocks = Blocks(8)
    pc = PrefixCache(blocks, UNIT, chain_root(RECORD))
    tier = HostTier(4, UNIT)
    pc.on_evict = tier.spill
    k = keys(4)
    device = pc.acquire([], 1)
    pc.insert(k[:1], device)
    tail_block = pc.acquire([], 1)[0]
    assert pc.insert_tail(k[2], (1, 2), tail_block)
    tier.spill([(k[1], 50), (k[2], 51)])
    tier.take()
    hits = pc.lookup(k)
    host = tier.lookup(k[len(hits):])
    assert hits == device and host == [0, 1]
    tail = pc.lookup_tail(k[2], [1, 2, 3])
    assert tail is not None
    table = load_from_host(pc, tier, [0] * 20, hits, host, 3, tail, None)
    assert table[0] == device[0] and table[3] == tail_block  # the tail after the host units
    fresh = table[1:3] + table[4:]
    assert len(set(table)) == 5 and all(pc.refs(b) == 1 for b in fresh)
    assert pc.lookup(k[1:2]) == []  # a block being loaded is not in the device index
    assert tier.take().loads == [(0, table[1]), (1, table[2])]
    assert tier.hit_tokens == 2 * UNIT


def test_slots_looked_up_are_pinned_while_the_allocation_spills() -> None:
    blocks = Blocks(3)
    pc = PrefixCache(blocks, UNIT, chain_root(RECORD))
    tier = HostTier(1, UNIT)
    pc.on_evict = tier.spill
    k = keys(3)
    tier.spill([(k[0], 40)])
    tier.take()
    other = keys(1, salt=5)
    t = pc.acquire([], 1)
    pc.insert(other, t)
    pc.free(t)  # cached: the allocation below evicts it, and the one slot is k[0]'s
    host = tier.lookup(k)
    table = load_from_host(pc, tier, [0] * 12, [], host, 3, None, None)
    ops = tier.take()
    assert ops.loads == [(0, table[0])] and ops.offloads == []
    assert tier.dropped_blocks == 1 and tier.lookup(k[:1]) == [0]


def test_serve_flag_reaches_both_roles_and_bad_sizes_name_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert config_from_args(parser().parse_args([])).host_kv_cache_gib == 0
    cfg = config_from_args(parser().parse_args(["--host-kv-cache-gib", "2.5"]))
    f = tmp_path / "routing.json"
    f.write_text(routing_plan_json(cfg))
    ports = Ports(router=8000, prefill=(InstancePorts(http=11000, side=12000, dist=13000),),
                  decode=(InstancePorts(http=14000, side=15000, dist=16000),))
    for role in ("prefill", "decode"):
        env = instance_env(cfg, role, ports, str(f), None, "/k")
        assert InstanceSettings.from_env(env).host_kv_cache_gib == 2.5
        assert "PDD_HOST_KV_CACHE_GIB" not in instance_env(
            StackConfig(), role, ports, str(f), None, "/k")
        with pytest.raises(ConfigError, match="PDD_HOST_KV_CACHE_GIB: must be >= 0, got -1"):
            InstanceSettings.from_env({**env, "PDD_HOST_KV_CACHE_GIB": "-1"})
    for bad in ("-1", "nan"):
        assert main(["serve", "--host-kv-cache-gib", bad]) == 2
        err = capsys.readouterr().err
        assert f"pdd serve: --host-kv-cache-gib: must be a number >= 0, got {bad}" in err, err

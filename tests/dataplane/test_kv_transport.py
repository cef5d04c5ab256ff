"""The transport records on the side channel, the CUDA IPC handle's guarded unpickling, the device
copy's block arithmetic (on CPU tensors: torch's copies, and the raw spans with ``memmove``
standing in for ``cudaMemcpyAsync``), and the puller's pull results and wake-up hook."""

from __future__ import annotations

import base64
import ctypes
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from pdd_api.plan import SidePlan
from pdd_api.routing import plan_routing
from pdd_sidecar.env import InstanceSettings
from pdd_sidecar.kv import device_copy
from pdd_sidecar.kv.compat import CompatError, CompatRecord
from pdd_sidecar.kv.device_copy import (
    CudaRuntime,
    Span,
    copy_blocks,
    loaded_cuda_runtime,
    raw_copyable,
    spec_spans,
    waits_holding_gil,
)
from pdd_sidecar.kv.handoff import TransferParams
from pdd_sidecar.kv.puller import KVPuller, PullJob
from pdd_sidecar.kv.side_channel import PeerInfo, SideChannelServer, handshake, publication
from pdd_sidecar.kv.transfer import ReadSpec, RegionInfo, Rows, Run, plan_read_specs
from pdd_sidecar.kv.transport import (
    TransportRecord,
    handle_args,
    local_record,
)

pytestmark = pytest.mark.dataplane

LAYERS, BLOCK, LATENT, NUM_BLOCKS = 2, 4, 3, 12
KEY = b"k" * 32
COMPAT = CompatRecord(model="m", dtype="float32", block_size=BLOCK, cache_layout="l",
                      plan_version=1, plan_digest="d")


def _cache(seed: int | None = None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(NUM_BLOCKS, LAYERS, BLOCK, LATENT)
    return torch.randn(NUM_BLOCKS, LAYERS, BLOCK, LATENT,
                       generator=torch.Generator().manual_seed(seed))


def test_a_cpu_rank_publishes_its_host_and_no_ipc_handle() -> None:
    record = local_record(_cache())
    assert record.device_type == "cpu" and record.cuda_ipc == "" and record.device_uuid == ""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert record.boot_id == boot_id
    assert record.ipc_namespace == os.stat("/proc/self/ns/ipc").st_ino


def test_the_transport_record_crosses_the_side_channel_with_the_rest() -> None:
    kv = _cache()
    record = TransportRecord("boot", "host", 7, "cuda", "GPU-x", "aGFuZGxl")
    for sent in (record, None):
        payload = publication(role="prefill", rank=0, tp=1, dcp=1, instance_id="i0",
                              agent_name="a", metadata=b"\x00meta", region=RegionInfo.of_tensor(kv),
                              compat=COMPAT, transport=sent)
        server = SideChannelServer("127.0.0.1", 0, payload, KEY)
        try:
            info = handshake("127.0.0.1", server.port, COMPAT, "decode rank 0", 5, KEY)
        finally:
            server.close()
        assert info.transport == sent
        assert (info.metadata, info.instance_id) == (b"\x00meta", "i0")


def test_the_ipc_handle_unpickles_only_the_torch_types_it_holds() -> None:
    t = _cache()
    args = (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), torch.bfloat16, 0,
            b"handle", 96, 0, False, b"refs", 0, b"event", True)
    assert handle_args(base64.b64encode(pickle.dumps(args)).decode()) == args

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        handle_args(base64.b64encode(pickle.dumps((Evil(),))).decode())


@pytest.mark.parametrize("slice_runs", [64, 0])  # a slice copy per run; one gather + scatter
def test_a_device_copy_moves_exactly_the_spec_blocks_and_row_ranges(
        slice_runs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_copy, "MAX_SLICE_RUNS", slice_runs)
    src, dst = _cache(1), _cache()
    spec = ReadSpec(prefill_rank=0, runs=[Run(3, 0, 2), Run(8, 5, 1)],
                    partials=[Rows(2, 9, 1, 4), Rows(10, 7, 0, 2), Rows(11, 11, 1, 2)])
    copy_blocks(dst, src, spec)
    want = _cache()
    for remote, local in ((3, 0), (4, 1), (8, 5)):
        want[local] = src[remote]
    want[9, :, 1:] = src[2, :, 1:]
    want[7, :, :2] = src[10, :, :2]
    want[11, :, 1:2] = src[11, :, 1:2]
    assert torch.equal(dst, want)


def _memmove(span: Span) -> None:
    """What ``cudaMemcpy2DAsync`` does with a span (``cudaMemcpyAsync`` for one row)."""
    for row in range(span.height):
        ctypes.memmove(span.dst + row * span.pitch, span.src + row * span.pitch, span.width)


@pytest.mark.parametrize("partials", [[], [Rows(2, 8, 1, 4), Rows(10, 11, 0, 2)]])
def test_a_spec_copied_as_raw_spans_lands_where_torch_s_copies_put_it(
        partials: list[Rows]) -> None:
    src = _cache(1)
    runs = [Run(3, 0, 2), Run(8, 5, 1), Run(0, 9, 2)]
    spec = ReadSpec(prefill_rank=0, runs=runs, partials=partials)
    assert raw_copyable(_cache(), src, spec)
    dst, want = _cache(), _cache()
    spans = spec_spans(dst, src, spec)
    assert [s.height for s in spans] == [1] * len(runs) + [LAYERS] * len(partials)
    for span in spans:
        _memmove(span)
    copy_blocks(want, src, spec)
    assert torch.equal(dst, want)
    assert not torch.equal(dst, _cache())  # something moved


def test_a_chunk_read_in_part_as_a_span_copies_its_rows_of_each_layer_alone() -> None:
    """Rows 1-2 of block 2 onto block 7 in every layer: rows 0 and 3, and every other block,
    keep what the destination held."""
    src, dst = _cache(1), _cache(2)
    before = dst.clone()
    (span,) = spec_spans(dst, src, ReadSpec(prefill_rank=0, partials=[Rows(2, 7, 1, 3)]))
    _memmove(span)
    assert torch.equal(dst[7, :, 1:3], src[2, :, 1:3])
    keep = torch.ones_like(dst, dtype=torch.bool)
    keep[7, :, 1:3] = False
    assert torch.equal(dst[keep], before[keep])


def test_which_specs_go_as_raw_spans() -> None:
    src, dst = _cache(1), _cache()
    runs = [Run(3, 0, 2)]
    assert raw_copyable(dst, src, ReadSpec(prefill_rank=0, runs=runs))
    assert not raw_copyable(dst, src, ReadSpec(prefill_rank=0))  # nothing to copy
    assert raw_copyable(dst, src, ReadSpec(prefill_rank=0, runs=runs,
                                           partials=[Rows(2, 9, 1, 4)]))
    assert raw_copyable(dst, src, ReadSpec(prefill_rank=0, partials=[Rows(2, 9, 1, 4)]))
    wide = [Run(2 * i, 2 * i, 1) for i in range(device_copy.MAX_SLICE_RUNS + 1)]
    assert not raw_copyable(dst, src, ReadSpec(prefill_rank=0, runs=wide))
    assert not raw_copyable(dst.to(torch.float64), src, ReadSpec(prefill_rank=0, runs=runs))
    assert not raw_copyable(dst[:, :1], src[:, :1], ReadSpec(prefill_rank=0, runs=runs))
    other = torch.zeros(NUM_BLOCKS, LAYERS, BLOCK, LATENT + 1)
    assert not raw_copyable(other, src, ReadSpec(prefill_rank=0, runs=runs))


def test_the_cuda_runtime_is_the_library_the_process_mapped(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 42 /usr/lib/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00001000 08:01 43 /opt/x/nvidia/cu13/lib/libcudart.so.13\n")
    assert loaded_cuda_runtime(str(maps)) == "/opt/x/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r--p 00000000 08:01 42 /usr/lib/libc.so.6\n")
    assert loaded_cuda_runtime(str(maps)) is None
    assert loaded_cuda_runtime(str(tmp_path / "absent")) is None


def test_a_failed_runtime_call_raises_naming_it_and_the_cuda_error() -> None:
    path = loaded_cuda_runtime()  # torch, a CUDA build, mapped it on import
    if path is None:
        pytest.skip("this torch maps no CUDA runtime library")
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA device, where the call must fail")
    runtime = CudaRuntime(path)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of 16 bytes failed: .+ \(error \d+\)"):
        runtime.memcpy(0, 0, 16, 0)
    with pytest.raises(RuntimeError, match=r"cudaMemcpy2DAsync of 27 x 16 bytes failed"):
        runtime.memcpy_2d(0, 0, 16, 27, 64, 0)
    with pytest.raises(RuntimeError, match=r"cudaEventRecord failed: .+ \(error \d+\)"):
        runtime.event_record(0, 0)
    with pytest.raises(RuntimeError, match=r"cudaEventSynchronize failed"):
        runtime.event_synchronize(0)
    with pytest.raises(RuntimeError, match=r"cudaEventElapsedTime failed"):
        runtime.event_elapsed_s(0, 0)


def test_a_read_waits_holding_the_gil_only_for_copies_shorter_than_a_switch_interval() -> None:
    eight_k, thirty_two_k = 254_803_968, 1_019_215_872  # DeepSeek-V2-Lite's KV, bf16
    assert waits_holding_gil(eight_k, 500e-6)  # pdd serve's switch interval
    assert not waits_holding_gil(thirty_two_k, 500e-6)
    assert waits_holding_gil(thirty_two_k, 5e-3)  # Python's default


@pytest.mark.parametrize(("prefill", "decode"), [((1, 1), (1, 1)), ((2, 2), (1, 1)),
                                                 ((1, 1), (2, 2))])
def test_device_copies_of_the_plans_specs_rebuild_the_prompt_on_every_decode_rank(
        prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    """Chunk g lives on prefill rank g % dcpP at its block g // dcpP and must land on decode rank
    g % dcpD at block g // dcpD, whichever rank's cache the copy reads."""
    plan = plan_routing(SidePlan(tensor_parallel_size=prefill[0],
                                 decode_context_parallel_size=prefill[1]),
                        SidePlan(tensor_parallel_size=decode[0],
                                 decode_context_parallel_size=decode[1]), BLOCK)
    num_tokens = 5 * BLOCK + 3
    chunks = -(-num_tokens // BLOCK)
    pblocks, dblocks = [9, 2, 7, 4, 11, 0], [1, 6, 3, 10, 5, 8]
    sources = [_cache(10 + p) for p in range(prefill[0])]
    for d in range(decode[0]):
        dst = _cache()
        specs = plan_read_specs(plan.reads_of(d), num_tokens, BLOCK, prefill[1], decode[1],
                                pblocks, dblocks)
        for spec in specs:
            copy_blocks(dst, sources[spec.prefill_rank], spec)
        for g in range(chunks):
            if g % decode[1] != d % decode[1]:
                continue
            rows = num_tokens - g * BLOCK if g == chunks - 1 else BLOCK
            src = sources[g % prefill[1]][pblocks[g // prefill[1]], :, :rows]
            assert torch.equal(dst[dblocks[g // decode[1]], :, :rows], src), g


def _puller(**env: str) -> KVPuller:
    settings = InstanceSettings.from_env({
        "PDD_ROLE": "decode", "PDD_TP_SIZE": "1", "PDD_BLOCK_SIZE": str(BLOCK),
        "PDD_ROUTING_FILE": "/r.json", "PDD_GRANT_KEY_FILE": "/k", **env})
    plan = plan_routing(SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1),
                        SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1), BLOCK)
    return KVPuller(rank=0, who="decode 0 rank 0", settings=settings, plan=plan, compat=COMPAT,
                    key=KEY, agent=None,  # type: ignore[arg-type]  # never reached here
                    transport=local_record(_cache()))


def test_a_pull_result_is_queued_then_the_owner_is_woken() -> None:
    puller = _puller()
    woken = threading.Event()
    seen: list[object] = []
    puller.on_pulled = lambda: (seen.extend(puller.take()), woken.set())  # type: ignore[func-returns-value]
    puller.start(threads=1)
    src = TransferParams(request_id="r", instance_id="i", host="h", side_channel_port=1, tp=1,
                         dcp=1, block_size=BLOCK * 2, block_ids=(0,), num_tokens=3,
                         plan_digest="d", epoch=1, expires_at=4e9)
    puller.submit(PullJob("seq-1", src, [0], "http://nowhere"))
    assert woken.wait(10)
    [(seq_id, error, stats)] = seen  # type: ignore[misc]
    assert seq_id == "seq-1" and stats == {}
    assert error is not None and (error["status"], error["kind"]) == (409, "incompatible")
    assert f"block_size {BLOCK * 2} != local {BLOCK}" in error["error"]


def test_a_forced_device_copy_from_a_cpu_peer_is_refused_at_the_handshake() -> None:
    kv = _cache()
    peer = PeerInfo(key="h:1", role="prefill", rank=0, tp=1, dcp=1, instance_id="i",
                    agent_name="a", metadata=b"", region=RegionInfo.of_tensor(kv), compat=COMPAT,
                    transport=local_record(kv))
    assert _puller()._choose("h:1", peer) == "nixl"
    with pytest.raises(CompatError, match="h:1: PDD_KV_TRANSPORT=cuda_ipc.*not cuda"):
        _puller(PDD_KV_TRANSPORT="cuda_ipc")._choose("h:1", peer)


def test_an_unknown_transport_is_refused_naming_the_variable() -> None:
    from pdd_sidecar.env import ConfigError

    with pytest.raises(ConfigError, match="PDD_KV_TRANSPORT: must be one of auto, nixl, "
                                          "cuda_ipc, got 'rdma'"):
        _puller(PDD_KV_TRANSPORT="rdma")
    assert _puller().settings.kv_transport == "auto"

"""A decode that drafts with the MTP module (PDD_SPECULATIVE_METHOD=mtp, its prefill running
the module too) serves plain decoding's greedy tokens on a checkpoint with the module; the
prefill hands over the draft state, and a decode given a grant without it still serves,
drafting from its next step, and counts it."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from runtime_fixtures import LocalAsk, LocalCluster, http, local_prefills, pd_stack
from test_mtp import mtp_checkpoint  # noqa: F401  (the fixture: a V3 checkpoint with the module)

from pdd_sidecar.engine.generate import generate_result
from pdd_sidecar.engine.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.dataplane

BLOCK = 4
PROMPT = list(range(40, 77))  # 37 tokens: 9 full blocks of 4 and one partial
STEPS = 24
MTP = {"PDD_SPECULATIVE_METHOD": "mtp"}


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def plain(mtp_checkpoint: Any) -> list[int]:  # noqa: F811
    return generate_result(str(mtp_checkpoint[0]), PROMPT, STEPS, block_size=BLOCK).token_ids


# "padded": the decode runs its steps and the module's rows padded to graph buckets (the CPU
# twin of CUDA graphs), warmed up as on a GPU
@pytest.mark.parametrize("p,d,k,graphs", [((1, 1), (1, 1), 1, ""), ((1, 1), (1, 1), 2, ""),
                                          ((2, 2), (2, 2), 1, ""), ((1, 1), (2, 2), 2, ""),
                                          ((1, 1), (1, 1), 2, "padded"),
                                          ((1, 1), (2, 2), 1, "padded")],
                         ids=["p1-d1-k1", "p1-d1-k2", "p2dcp2-d2dcp2-k1", "p1-d2dcp2-k2",
                              "p1-d1-k2-padded", "p1-d2dcp2-k1-padded"])
def test_served_greedy_tokens_are_plain_decodings(tmp_path: Path, mtp_checkpoint: Any,  # noqa: F811
                                                  plain: list[int], p: tuple[int, int],
                                                  d: tuple[int, int], k: int,
                                                  graphs: str) -> None:
    model = {"PDD_MODEL_SOURCE": str(mtp_checkpoint[0])}
    padded = {"PDD_CUDA_GRAPHS": graphs} if graphs else {}
    cluster = LocalCluster(tmp_path)
    try:
        stack = pd_stack(cluster, p, d, BLOCK, prefill_env={**model, **MTP},
                         decode_env={**model, **MTP, **padded, "PDD_SPECULATIVE_TOKENS": str(k),
                                     "PDD_SPECULATIVE_MIN_ACCEPTANCE": "0"})
        status, out = http("POST", f"{stack['router'].url}/v1/completions",
                           {"prompt": PROMPT, "max_tokens": STEPS, "temperature": 0},
                           timeout=120)
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == plain
        url = stack["decode"].url
        drafted = _counter(url, "pdd_spec_decode_num_draft_tokens")
        accepted = _counter(url, "pdd_spec_decode_num_accepted_tokens")
        print(f"{p} -> {d} k{k}: drafted {drafted:.0f}, accepted {accepted:.0f}")
        # the drafts of one process drafting with the module (pdd generate): every step that
        # had room drafted, from the first (the prefill's draft state), and as many were kept
        one = generate_result(str(mtp_checkpoint[0]), PROMPT, STEPS, block_size=BLOCK,
                              speculative=SpeculativeConfig(method="mtp", tokens=k))
        assert (drafted, accepted) == (one.drafted, one.accepted)
        assert accepted > 0  # the fixture's module guesses some right: the keep path ran
        assert _counter(url, "pdd_spec_decode_draft_state_missing") == 0
        # A follow-up turn reads the first one's KV (the module's latents with it) from the
        # decode's prefix cache and pulls the rest: still plain decoding's tokens.
        follow = [*PROMPT, *plain[:10], 5, 6, 7]
        hits = _counter(url, "pdd_prefix_cache_hits")
        status, again = http("POST", f"{stack['router'].url}/v1/completions",
                             {"prompt": follow, "max_tokens": 12, "temperature": 0},
                             timeout=120)
        assert status == 200, again
        assert again["choices"][0]["token_ids"] == generate_result(
            str(mtp_checkpoint[0]), follow, 12, block_size=BLOCK).token_ids
        assert _counter(url, "pdd_prefix_cache_hits") > hits
    finally:
        cluster.close()


def test_a_grant_without_the_draft_state_still_serves_and_is_counted(
        tmp_path: Path, mtp_checkpoint: Any, plain: list[int]) -> None:  # noqa: F811
    model = {"PDD_MODEL_SOURCE": str(mtp_checkpoint[0])}
    cluster = LocalCluster(tmp_path)
    try:
        stack = pd_stack(cluster, (1, 1), (1, 1), BLOCK, prefill_env={**model, **MTP},
                         decode_env={**model, **MTP, "PDD_SPECULATIVE_MIN_ACCEPTANCE": "0"})
        prefill, decode = stack["prefill"].url, stack["decode"].url
        answers = {}
        for send in (True, False):
            status, pre = http("POST", f"{prefill}/v1/prefill",
                               {"prompt_ids": PROMPT, "max_tokens": STEPS}, timeout=60)
            assert status == 200, pre
            grant = pre["kv_transfer_params"]
            state = grant["draft_state"]  # the prefill sent it, outside the signature
            assert state["position"] == len(PROMPT) - 1 and state["dtype"] == "float32"
            if not send:
                del grant["draft_state"]
            drafts = _counter(decode, "pdd_spec_decode_num_drafts")
            status, body = http("POST", f"{decode}/v1/decode", {
                "request_id": f"r-{send}", "first_token": pre["first_token"],
                "max_new_tokens": STEPS - 1, "prompt_ids": PROMPT, "kv_transfer_params": grant},
                timeout=120)
            assert status == 200, body
            answers[send] = (body["token_ids"],
                             _counter(decode, "pdd_spec_decode_num_drafts") - drafts)
            missing = _counter(decode, "pdd_spec_decode_draft_state_missing")
            assert missing == (0 if send else 1)
        assert answers[True][0] == answers[False][0] == plain[1:]
        # a state of another model's width is refused by name, before any step
        status, pre = http("POST", f"{prefill}/v1/prefill",
                           {"prompt_ids": PROMPT, "max_tokens": STEPS}, timeout=60)
        grant = pre["kv_transfer_params"]
        grant["draft_state"]["hidden"] = grant["draft_state"]["hidden"][:16]  # 3 values
        status, body = http("POST", f"{decode}/v1/decode", {
            "request_id": "r-narrow", "first_token": pre["first_token"],
            "max_new_tokens": 4, "kv_transfer_params": grant}, timeout=60)
        assert status == 400, body
        assert "kv_transfer_params.draft_state.hidden: 3 values, this model's hidden size" \
            in str(body), body
        http("POST", f"{prefill}/v1/release", {"kv_transfer_params": pre["kv_transfer_params"]})
        # without the state the first step drafted nothing: one verify step fewer at k = 1
        assert answers[False][1] == answers[True][1] - 1, answers
        # A prompt the decode prefills itself (local_prefill) drafts from its first step too:
        # the module ran over the prompt and at its last position from the kept hidden state.
        drafted = _counter(decode, "pdd_spec_decode_num_draft_tokens")
        status, body = http("POST", f"{decode}/v1/decode", {
            "request_id": "r-local", "local_prefill": True, "max_new_tokens": STEPS - 1,
            "prompt_ids": PROMPT}, timeout=120)
        assert status == 200, body
        assert body["token_ids"] == plain
        one = generate_result(str(mtp_checkpoint[0]), PROMPT, STEPS, block_size=BLOCK,
                              speculative=SpeculativeConfig(method="mtp", tokens=1))
        assert _counter(decode, "pdd_spec_decode_num_draft_tokens") - drafted == one.drafted
        assert _counter(decode, "pdd_spec_decode_draft_state_missing") == 1  # not counted
    finally:
        cluster.close()


@pytest.mark.parametrize("k,send_state", [(1, True), (2, True), (1, False)],
                         ids=["k1", "k2", "k1-without-state"])
def test_the_served_drafters_drafts_are_one_processes(mtp_checkpoint: Any,  # noqa: F811
                                                      k: int, send_state: bool) -> None:
    """The served pieces (each rank's RankMTP, the driver's ServedMTPDrafts behind the
    Speculator) stepped as the instances step them, in one process: a prefill in two chunks
    runs the module over the prompt and gives the draft state, the decode gets the prompt's
    blocks; its drafts are then pdd generate's, position by position (without the state: none
    in the first step, the rest the same)."""
    import torch

    from pdd_sidecar.engine.comm import SingleComm
    from pdd_sidecar.engine.rank_engine import RankEngine, allocate_request, new_cache
    from pdd_sidecar.engine.seq_chunk import SeqChunk
    from pdd_sidecar.engine.speculative.mtp import MTPDrafter
    from pdd_sidecar.engine.speculative.mtp_served import (
        RankMTP,
        ServedMTPDrafts,
        draft_state_of,
        prefill_after,
    )
    from pdd_sidecar.engine.speculative.speculator import Speculator, draft_room
    from pdd_sidecar.engine.speculative.verify import accepted_tokens
    from pdd_sidecar.model.rank_model import load_rank_model

    path = str(mtp_checkpoint[0])
    cfg = SpeculativeConfig(method="mtp", tokens=k, min_acceptance=0.0)
    one = generate_result(path, PROMPT, STEPS, block_size=BLOCK, speculative=cfg)
    model = load_rank_model(path)
    h, t = model.config.hidden_size, len(PROMPT)

    def side() -> tuple[Any, RankEngine, RankMTP]:
        cache = new_cache(model, 64, BLOCK, extra_layers=1)
        engine = RankEngine(model, cache, SingleComm(), extra_layers=1, decode_mode="eager")
        return cache, engine, RankMTP(MTPDrafter.load(path, model, cache, SingleComm()), h)

    cache_p, engine_p, mtp_p = side()
    table_p = allocate_request(cache_p, t, 1)
    for a, b in ((0, 22), (22, t)):  # a chunk boundary inside a block
        logits = engine_p.step([SeqChunk(PROMPT[a:b], a, table_p)], keep=[0])
        mtp_p.prefill(engine_p.kept, [(0, a, prefill_after(PROMPT, a, b - a), table_p)])
    assert logits is not None
    first = int(torch.argmax(logits[0]))
    state = draft_state_of(engine_p.kept[0][-1], t)

    cache_d, engine_d, mtp_d = side()
    table_d = allocate_request(cache_d, t + STEPS, 1)
    cache_d.kv[table_d[:len(table_p)]] = cache_p.kv[table_p]  # the hand-off, every layer
    served = ServedMTPDrafts(lambda cmd: [{"drafts": mtp_d.draft(cmd["seqs"])}])
    spec = Speculator(cfg, batch=served)
    assert served.begin("a", table_d, t, first, state if send_state else None, True) \
        is not send_state
    out, pos, log = [first], t, []
    while len(out) < STEPS:
        (drafts,) = spec.plan([("a", (), draft_room(STEPS, len(out)))])
        log.append((pos, drafts))
        feed = [out[-1], *drafts]
        rows = engine_d.step([SeqChunk([x], pos + j, table_d) for j, x in enumerate(feed)],
                             keep=range(len(feed)))
        assert rows is not None
        mtp_d.keep(engine_d.kept, [("a", 0, len(feed))])
        kept = accepted_tokens(drafts, torch.argmax(rows, -1).tolist())
        spec.record("a", len(drafts), len(kept) - 1)
        served.verified("a", pos, kept)
        out += kept
        pos += len(kept)
    assert out[:STEPS] == one.token_ids
    if send_state:
        assert log == one.drafts
    else:
        assert log[0] == (t, []) and log[1:] == one.drafts[1:len(log)], (log, one.drafts)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory, mtp_checkpoint: Any) -> Any:  # noqa: F811
    """One MTP prefill, a decode that runs the module but never drafts (max batch 0) and one
    that drafts at every step (self-disable off), a router in front of each."""
    from runtime_fixtures import plan_json

    cluster = LocalCluster(tmp_path_factory.mktemp("mtp-twins"))
    model = {"PDD_MODEL_SOURCE": str(mtp_checkpoint[0]), **MTP}
    try:
        routing = cluster.plan_file(plan_json((1, 1), (1, 1), BLOCK))
        prefill = cluster.instance("prefill", 1, 1, routing, BLOCK, **model)
        plain = cluster.instance("decode", 1, 1, routing, BLOCK, PDD_PREFILL_URLS=prefill.url,
                                 PDD_SPECULATIVE_MAX_BATCH="0", **model)
        spec = cluster.instance("decode", 1, 1, routing, BLOCK, replica=1,
                                PDD_PREFILL_URLS=prefill.url, PDD_SPECULATIVE_TOKENS="2",
                                PDD_SPECULATIVE_MIN_ACCEPTANCE="0", **model)
        routers = [cluster.router([prefill], [plain]), cluster.router([prefill], [spec])]
        for proc in (prefill, plain, spec, *routers):
            proc.wait_ready()
        yield [r.url for r in routers], plain.url, spec.url
    finally:
        cluster.close()


CASES = {
    "sampled": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
    "hot": {"temperature": 1.5, "top_k": 20, "seed": 11},
    "penalties": {"temperature": 0.3, "seed": 3, "frequency_penalty": 0.1,
                  "repetition_penalty": 1.05, "min_tokens": 5},
    "logprobs": {"temperature": 0.5, "seed": 5, "logprobs": 3},
    "stop_ids": {"temperature": 0, "stop_token_ids": [PROMPT[5]]},
    "choices": {"temperature": 0.7, "seed": 9, "n": 3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_served_sampling_is_plain_decodings(twins: Any, case: str) -> None:
    """Seeded sampling, penalties, log-probabilities, stops and choices through MTP drafts:
    what the decode that never drafts serves, token for token."""
    (plain_router, spec_router), plain_url, spec_url = twins
    body = {"prompt": PROMPT, "max_tokens": STEPS, **CASES[case]}
    drafts = _counter(spec_url, "pdd_spec_decode_num_drafts")
    status_a, a = http("POST", f"{plain_router}/v1/completions", body, timeout=120)
    status_b, b = http("POST", f"{spec_router}/v1/completions", body, timeout=120)
    assert status_a == status_b == 200, (a, b)
    assert _counter(spec_url, "pdd_spec_decode_num_drafts") > drafts
    assert _counter(plain_url, "pdd_spec_decode_num_drafts") == 0
    assert len(a["choices"]) == len(b["choices"]) == body.get("n", 1)
    for ca, cb in zip(a["choices"], b["choices"], strict=True):
        assert cb["token_ids"] == ca["token_ids"]
        assert cb["finish_reason"] == ca["finish_reason"]
        if "logprobs" in body:
            assert cb["logprobs"]["token_logprobs"] == pytest.approx(
                ca["logprobs"]["token_logprobs"], abs=1e-4)
    # (the second request's prompt is a prefix-cache hit on the shared prefill: cached_tokens)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [b["usage"][k] for k in counts] == [a["usage"][k] for k in counts]


@pytest.mark.parametrize("graphs", ["", "padded"])
def test_prompts_prefilled_on_the_drafting_decode_mid_stream_are_plain_decodings(
        tmp_path: Path, mtp_checkpoint: Any, graphs: str) -> None:  # noqa: F811
    """Short prompts the decode prefills itself arrive while longer ones draft with the
    module: steps that prefill a prompt (the module over its positions) and verify drafts at
    once give every request plain decoding's tokens."""
    ckpt = str(mtp_checkpoint[0])
    padded = {"PDD_CUDA_GRAPHS": graphs} if graphs else {}
    cluster = LocalCluster(tmp_path)
    try:
        stack = pd_stack(cluster, (1, 1), (1, 1), BLOCK,
                         prefill_env={"PDD_MODEL_SOURCE": ckpt, **MTP},
                         decode_env={"PDD_MODEL_SOURCE": ckpt, **MTP, **padded,
                                     "PDD_SPECULATIVE_TOKENS": "2",
                                     "PDD_SPECULATIVE_MIN_ACCEPTANCE": "0"})
        url = stack["decode"].url
        asks: list[LocalAsk] = [(f"long-{i}", [*PROMPT[i:], *PROMPT], 40, 0.0)
                                for i in range(2)]
        asks += [(f"short-{i}", PROMPT[3 * i: 3 * i + 7], 6, 0.05 * (i + 1)) for i in range(6)]
        got = local_prefills(url, asks)
        for (rid, prompt, n, _), tokens in zip(asks, got, strict=True):
            assert tokens == generate_result(ckpt, prompt, n, block_size=BLOCK).token_ids, rid
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            assert 'reason="prefill"' not in resp.read().decode()
        assert _counter(url, "pdd_spec_decode_num_accepted_tokens") > 0
    finally:
        cluster.close()

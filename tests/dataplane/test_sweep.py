"""The data-plane sweep: every valid P/D pair with tp in {1, 2, 4}, through the real path.

For each configuration one prefill instance, one decode instance (rank processes, real NIXL over
UCX between them) and a router are started; four prompts (shorter than one block to several
blocks) are completed with 16 greedy tokens each and must equal the single-process reference.
Every decode rank must receive exactly the plan's minimum bytes. The table is printed at the end,
like the reference sweep's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch  # noqa: F401  (the tier needs it; never skip)
from runtime_fixtures import LocalCluster, http  # noqa: E402

from pdd_api.plan import SidePlan  # noqa: E402
from pdd_api.routing import bytes_per_decode_rank, plan_routing  # noqa: E402

pytestmark = pytest.mark.dataplane

BLOCK = 16
MAX_TOKENS = 16
PROMPT_LENGTHS = (5, 16, 37, 70)  # < 1 block, exactly 1, partial 3rd, 5 blocks
REFERENCE_SWEEP = [((4, 1), (4, 1)), ((2, 1), (4, 1)), ((4, 4), (4, 4)), ((4, 1), (4, 4)),
                   ((4, 4), (4, 1)), ((2, 2), (4, 4)), ((2, 1), (4, 4))]
SIDES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4)]
CONFIGS = REFERENCE_SWEEP + [c for c in itertools.product(SIDES, SIDES) if c not in REFERENCE_SWEEP]

ROWS: list[tuple[str, str, str, str]] = []


def _prompt(n: int) -> list[int]:
    return [(i * 37 + 11) % 256 for i in range(n)]


def _label(cfg: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (tp_p, dcp_p), (tp_d, dcp_d) = cfg
    return f"P TP{tp_p}/DCP{dcp_p} -> D TP{tp_d}/DCP{dcp_d}"


@pytest.fixture(scope="module")
def references() -> dict[int, list[int]]:
    from pdd_sidecar.engine.generate import generate

    return {n: generate("builtin", _prompt(n), MAX_TOKENS, block_size=BLOCK)
            for n in PROMPT_LENGTHS}


@pytest.fixture(scope="module", autouse=True)
def sweep_table(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not ROWS:
        return
    header = ("Configuration", "Status", "Tokens matched", "Bytes moved / minimum")
    widths = [max(len(r[i]) for r in [header, *ROWS]) for i in range(4)]
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(
            "Data-plane sweep (router -> prefill -> NIXL/UCX -> decode, "
            f"blockSize {BLOCK}, {len(PROMPT_LENGTHS)} prompts x {MAX_TOKENS} greedy tokens)"
        )
        for row in [header, *ROWS]:
            reporter.write_line("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


IDS = [f"P{p[0]}{p[1]}-D{d[0]}{d[1]}" for p, d in CONFIGS]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_sweep(cfg: Any, cluster: LocalCluster, references: dict[int, list[int]]) -> None:
    from pdd_sidecar.model.config import builtin_config

    _sweep_row(cfg, cluster, references, builtin_config(), {}, _label(cfg))


V3_CONFIG = ((2, 2), (4, 4))  # resharding on both sides: P TP2/DCP2 -> D TP4/DCP4


@pytest.fixture(scope="module")
def v3_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small DeepSeek-V3 checkpoint (group-limited sigmoid routing), written by transformers."""
    from model_fixtures import V3_GROUPED, write_v3_checkpoint

    path: Path = tmp_path_factory.mktemp("v3-sweep")
    write_v3_checkpoint(path, V3_GROUPED, seed=7)
    return path


def test_sweep_v3(cluster: LocalCluster, v3_source: Path) -> None:
    from pdd_sidecar.engine.generate import generate
    from pdd_sidecar.model.config import ModelConfig

    refs = {n: generate(v3_source, _prompt(n), MAX_TOKENS, block_size=BLOCK)
            for n in PROMPT_LENGTHS}
    _sweep_row(V3_CONFIG, cluster, refs, ModelConfig.from_pretrained(v3_source),
               {"PDD_MODEL_SOURCE": str(v3_source)}, f"{_label(V3_CONFIG)} (DeepSeek-V3)")


def _sweep_row(cfg: Any, cluster: LocalCluster, references: dict[int, list[int]],
               model: Any, model_env: dict[str, str], label: str) -> None:
    (tp_p, dcp_p), (tp_d, dcp_d) = cfg
    plan = plan_routing(SidePlan(tensor_parallel_size=tp_p, decode_context_parallel_size=dcp_p),
                        SidePlan(tensor_parallel_size=tp_d, decode_context_parallel_size=dcp_d),
                        BLOCK)
    routing = cluster.plan_file(plan.to_json())
    # Every prompt's whole KV moves, so the bytes can be held to the plan's minimum; the prompts
    # share prefixes, which the prefix cache would reuse (tests/dataplane/test_prefix_cache.py).
    prefill = cluster.instance("prefill", tp_p, dcp_p, routing, BLOCK, PDD_PREFIX_CACHE="0",
                               **model_env)
    decode = cluster.instance("decode", tp_d, dcp_d, routing, BLOCK,
                              PDD_PREFILL_URLS=prefill.url, PDD_PREFIX_CACHE="0", **model_env)
    router = cluster.router([prefill], [decode], **model_env)
    for p in (prefill, decode, router):
        p.wait_ready()
    bytes_per_token = model.num_hidden_layers * model.latent_dim * 4  # float32
    matched = moved = minimum = 0
    problems = []
    for n in PROMPT_LENGTHS:
        status, body = http("POST", f"{router.url}/v1/completions",
                            {"prompt": _prompt(n), "max_tokens": MAX_TOKENS, "temperature": 0})
        if status != 200:
            problems.append(f"prompt {n}: HTTP {status}: {body}")
            continue
        got = body["choices"][0]["token_ids"]
        want = references[n]
        matched += sum(a == b for a, b in zip(got, want, strict=False))
        if got != want:
            problems.append(f"prompt {n}: tokens {got} != reference {want}")
        per_rank = [r["bytes"] for r in body["pdd"]["transfer"]["ranks"]]
        need = bytes_per_decode_rank(plan, n, bytes_per_token)
        moved += sum(per_rank)
        minimum += sum(need)
        if per_rank != need:
            problems.append(f"prompt {n}: bytes per decode rank {per_rank} != minimum {need}")
    total = len(PROMPT_LENGTHS) * MAX_TOKENS
    ROWS.append((label, "PASS" if not problems else "FAIL", f"{matched}/{total}",
                 f"{moved}/{minimum}"))
    assert not problems, "\n".join(problems)
    # The prefill side freed every request on its notifications, not by the lease.
    status, stats = http("GET", f"{prefill.url}/v1/stats")
    assert status == 200 and stats["leases"]["expired_total"] == 0

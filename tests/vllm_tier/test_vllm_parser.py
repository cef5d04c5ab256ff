"""What the operator renders for `engine: vllm`, read by vLLM itself: every rendered `vllm serve`
command line goes through vLLM's own CLI parser (the `serve` subcommand as `vllm` builds it) and
its engine arguments, vLLM's ParallelConfig agrees with pdd's DCP rule, and vLLM's NIXL
rank mapping (compute_tp_mapping) reads from the same prefill ranks as pdd's plan for every
layout both accept. No GPU, no model: nothing here starts an engine."""

from __future__ import annotations

import argparse
import copy
import itertools
from typing import Any

import pytest
from spec_cases import VLLM

from pdd_api.validation import parse_spec, validate_spec
from pdd_operator.builders import Owner, build

OWNER = Owner("demo", "ns", "uid")
MAX_TP = 16


def serve_parser() -> Any:
    """The parser `vllm serve` parses with (vllm.entrypoints.cli.main builds it this way).
    Argument defaults ask the platform for its device type; with no GPU here the platform is
    vLLM's CPU one, as `vllm bench` does on such machines."""
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    return parser, cmd


def vllm_spec(p: tuple[int, int], d: tuple[int, int], **more: Any) -> dict[str, Any]:
    spec = copy.deepcopy(VLLM)
    spec["prefill"] = {"tensorParallelSize": p[0], "decodeContextParallelSize": p[1]}
    spec["decode"] = {"tensorParallelSize": d[0], "decodeContextParallelSize": d[1]}
    spec.update(more)
    return spec


def parse(argv: list[str]) -> argparse.Namespace:
    parser, cmd = serve_parser()
    assert argv[0] == "vllm"
    args = parser.parse_args(argv[1:])
    cmd.validate(args)
    return args  # type: ignore[no-any-return]


LAYOUTS = [((4, 4), (2, 2), 64), ((2, 2), (4, 4), 16), ((2, 1), (8, 8), 128),
           ((8, 8), (4, 1), 32), ((1, 1), (1, 1), 64)]


@pytest.mark.parametrize(("p", "d", "block"), LAYOUTS)
@pytest.mark.parametrize("source", [None, "/models/DeepSeek-V2-Lite-Chat"])
def test_rendered_command_lines_parse_as_vllm_reads_them(
        p: tuple[int, int], d: tuple[int, int], block: int, source: str | None) -> None:
    from vllm.engine.arg_utils import EngineArgs

    model = {**VLLM["model"], **({"source": source} if source else {})}
    raw = vllm_spec(p, d, blockSize=block, model=model)
    raw["decode"]["extraArgs"] = ["--max-model-len", "8192"]
    raw["decode"].update({"gpuMemoryUtilization": 0.8, "kvCacheBlocks": 4096})
    fp8 = source is not None  # FP8 KV on half the cases, on both roles (they must agree)
    if fp8:
        for side in ("prefill", "decode"):
            raw[side]["kvCacheDtype"] = "fp8"
    spec = parse_spec(raw)
    for role, (tp, dcp) in (("prefill", p), ("decode", d)):
        argv = build(OWNER, spec).pods[role][0]["spec"]["containers"][0]["command"]
        args = parse(argv)
        assert args.subparser == "serve"
        assert args.model_tag == (source or spec.model.name)
        assert args.port == 8000
        engine = EngineArgs.from_cli_args(args)
        assert engine.tensor_parallel_size == tp
        assert engine.decode_context_parallel_size == dcp
        assert engine.block_size == block
        assert engine.dtype == spec.model.dtype
        assert engine.cp_kv_cache_interleave_size == (block if dcp > 1 else None)
        kv = engine.kv_transfer_config
        assert kv is not None
        assert (kv.kv_connector, kv.kv_role) == ("NixlConnector", "kv_both")
        if source:
            assert list(engine.served_model_name or []) == [spec.model.name]
        assert engine.max_model_len == (8192 if role == "decode" else None)
        assert engine.gpu_memory_utilization == (0.8 if role == "decode" else 0.9)
        assert engine.num_gpu_blocks_override == (4096 if role == "decode" else None)
        assert engine.kv_cache_dtype == ("fp8" if fp8 else "auto")


@pytest.mark.parametrize("speculative", [
    {"method": "mtp", "tokens": 2},
    {"method": "ngram", "tokens": 3, "ngram": {"maxN": 5, "minN": 2}},
])
def test_the_decodes_speculative_config_is_what_vllm_reads(speculative: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    raw = vllm_spec((2, 2), (2, 2), model={"name": "deepseek-ai/DeepSeek-V3"})
    raw["decode"]["speculative"] = speculative
    argv = build(OWNER, parse_spec(raw)).pods["decode"][0]["spec"]["containers"][0]["command"]
    config = EngineArgs.from_cli_args(parse(argv)).speculative_config
    assert config is not None
    assert config["method"] == speculative["method"]
    assert config["num_speculative_tokens"] == speculative["tokens"]
    if speculative["method"] == "ngram":
        assert (config["prompt_lookup_max"], config["prompt_lookup_min"]) == (5, 2)


def test_a_misspelt_flag_is_what_the_parser_refuses() -> None:
    """The check above can fail: vLLM's parser refuses what it does not know."""
    argv = build(OWNER, parse_spec(vllm_spec((2, 2), (2, 2)))).pods["decode"][0]["spec"][
        "containers"][0]["command"]
    with pytest.raises(SystemExit):
        parse([*argv, "--decode-context-paralel-size", "2"])


@pytest.mark.parametrize("tp", range(1, MAX_TP + 1))
def test_vllm_parallel_config_accepts_what_pdd_accepts(tp: int) -> None:
    from vllm.config import ParallelConfig

    for dcp in range(1, tp + 1):
        pdd_ok = validate_spec(vllm_spec((tp, dcp), (tp, 1))) == []
        try:
            ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
            vllm_ok = True
        except ValueError:
            vllm_ok = False
        assert not pdd_ok or vllm_ok, (tp, dcp)  # pdd is never looser than vLLM
        assert vllm_ok == (tp % dcp == 0), (tp, dcp)


def vllm_sources(p: tuple[int, int], d: tuple[int, int], rank: int) -> list[int]:
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topo = TransferTopology(tp_rank=rank, tp_size=d[0], block_size=64, engine_id="decode",
                            is_mla=True, is_mamba=False, total_num_kv_heads=1,
                            attn_backends=[], dcp_size=d[1])
    mapping = compute_tp_mapping(topo, remote_tp_size=p[0],
                                 group_spec_types=(FullAttentionSpec,), remote_dcp_size=p[1])
    return sorted(mapping.source_ranks_per_group[0])


def test_vllm_nixl_mapping_reads_the_ranks_pdd_plans() -> None:
    sides = [(tp, dcp) for tp in range(1, MAX_TP + 1) for dcp in sorted({1, tp})]
    checked = 0
    for p, d in itertools.product(sides, sides):
        # vLLM's NIXL DCP rules: the DCP sizes divide one another, and so do the TP sizes.
        vllm_accepts = (p[1] % d[1] == 0 or d[1] % p[1] == 0) and (
            p[0] % d[0] == 0 or d[0] % p[0] == 0)
        assert (validate_spec(vllm_spec(p, d)) == []) == vllm_accepts, (p, d)
        if not vllm_accepts:
            continue
        plan = build(OWNER, parse_spec(vllm_spec(p, d))).plan
        for rank in range(d[0]):
            pdd_sources = sorted({r.prefill_rank for r in plan.decode_ranks[rank].reads})
            assert vllm_sources(p, d, rank) == pdd_sources, (p, d, rank)
        checked += 1
    print(f"layouts compared: {checked}")
    assert checked > 100

"""`pdd serve` before it starts anything: argument errors, the plan, env, ports and GPUs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdd_api.routing import load_plan
from pdd_cli.main import main
from pdd_sidecar.env import (
    DEFAULT_GIL_SWITCH_INTERVAL_US,
    ConfigError,
    InstanceSettings,
    RouterSettings,
)
from pdd_sidecar.processes import usable_cpus
from pdd_sidecar.routing_file import load_routing_file
from pdd_sidecar.serve.local_stack import (
    InstancePorts,
    Ports,
    StackConfig,
    auto_router_workers,
    check_config,
    config_from_args,
    deployment_spec,
    gpu_lists,
    instance_env,
    memory_utilizations,
    parser,
    pick_ports,
    problems,
    router_env,
    router_sees,
    routing_plan_json,
    stack_gpus,
    stack_memory,
)

PORTS = Ports(router=8000, prefill=(InstancePorts(http=11000, side=12000, dist=13000),),
              decode=(InstancePorts(http=14000, side=15000, dist=16000),))


@pytest.mark.parametrize(
    ("argv", "flag", "says"),
    [
        (["--decode-tp", "2", "--decode-dcp", "3"], "--decode-dcp",
         "spec.decode.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (2), "
         "got 3"),
        (["--prefill-tp", "4", "--prefill-dcp", "2"], "--prefill-dcp", "tensorParallelSize (4)"),
        (["--prefill-tp", "4", "--prefill-dcp", "4", "--decode-tp", "3", "--decode-dcp", "3"],
         "--decode-dcp", "must divide or be a multiple of spec.prefill.decodeContextParallelSize"),
        (["--prefill-tp", "0"], "--prefill-tp", "got 0"),
        (["--block-size", "8"], "--block-size", "got 8"),
        (["--prefill-tp", "3"], "--prefill-tp", "num_attention_heads (8), got 3"),
        (["--num-blocks", "0"], "--num-blocks", "got 0"),
        (["--decode-num-blocks", "-1"], "--decode-num-blocks", "got -1"),
        (["--model", "/no/such/checkpoint"], "--model", "/no/such/checkpoint"),
        (["--port", "70000"], "--port", "got 70000"),
        (["--max-num-seqs", "0"], "--max-num-seqs", "got 0"),
        (["--max-step-tokens", "0"], "--max-step-tokens", "got 0"),
        (["--chunk-tokens", "-4"], "--chunk-tokens", "got -4"),
        (["--router-workers", "0"], "--router-workers", "between 1 and 64, got 0"),
        (["--router-workers", "65"], "--router-workers", "got 65"),
        (["--api-key", "a,b"], "--api-key", "without spaces or commas"),
        (["--api-key", ""], "--api-key", "must be non-empty"),
        (["--api-key-file", "/no/such/keys"], "--api-key-file", "cannot read /no/such/keys"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization",
         "must be in (0, 1], got 0.0"),
        (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization", "got 1.2"),
        (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization", "got nan"),
        (["--prefill-memory-share", "1"], "--prefill-memory-share", "must be in (0, 1)"),
        (["--prefill-memory-share", "0"], "--prefill-memory-share", "got 0.0"),
        (["--prefill-replicas", "-1"], "--prefill-replicas", "between 0 and 16, got -1"),
        (["--decode-replicas", "17"], "--decode-replicas", "between 1 and 16, got 17"),
        (["--speculative", '{"method": "ngram", "tokens": 9}'], "--speculative",
         "spec.decode.speculative.tokens: must be between 1 and 8, got 9"),
        (["--speculative", '{"method": "eagle"}'], "--speculative",
         "spec.decode.speculative.method: must be one of 'mtp' or 'ngram', got 'eagle'"),
        (["--speculative", '{"method": "mtp", "ngram": {"maxN": 2}}'], "--speculative",
         "spec.decode.speculative.ngram: only with method ngram, got method mtp"),
        (["--speculative", "3"], "--speculative",
         "spec.decode.speculative: must be an object, got 3"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(
    argv: list[str], flag: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("pdd serve: "))
    assert line.startswith(f"pdd serve: {flag}"), err
    assert says in line, err


def test_messages_are_the_ones_pdd_validate_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = StackConfig(prefill_tp=4, prefill_dcp=4, decode_tp=3, decode_dcp=3)
    doc = {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
           "metadata": {"name": "x"}, "spec": deployment_spec(cfg)}
    f = tmp_path / "x.yaml"
    f.write_text(json.dumps(doc))
    assert main(["validate", "-f", str(f)]) == 1
    validate_err = capsys.readouterr().err
    (mine,) = problems(cfg)
    assert mine.startswith("--decode-dcp: ")
    assert mine.removeprefix("--decode-dcp: ") in validate_err


def test_unknown_device_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "tpu"])
    assert exc.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_cuda_without_gpus_and_too_few_gpus() -> None:
    cfg = StackConfig(device="cuda", prefill_tp=1, decode_tp=4, decode_dcp=4)
    assert any(p.startswith("--device cuda: no GPU visible")
               for p in check_config(cfg, {"CUDA_VISIBLE_DEVICES": ""}))
    (p,) = check_config(cfg, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert p == "--decode-tp: 4 ranks need 4 distinct GPUs, 2 visible"
    assert check_config(StackConfig(device="cuda", decode_tp=2, port=0),
                        {"CUDA_VISIBLE_DEVICES": "0,1"}) == []


@pytest.mark.parametrize(
    ("ptp", "dtp", "gpus", "want_p", "want_d"),
    [
        (1, 2, ["0", "1"], ["0"], ["1", "0"]),  # 2 GPUs host P TP1 + D TP2
        (2, 2, ["0", "1", "2", "3"], ["0", "1"], ["2", "3"]),
        (2, 4, ["4", "5", "6", "7"], ["4", "5"], ["6", "7", "4", "5"]),
        (1, 1, ["3"], ["3"], ["3"]),
    ],
)
def test_gpus_prefill_first_then_decode_wrapping(
    ptp: int, dtp: int, gpus: list[str], want_p: list[str], want_d: list[str]
) -> None:
    p, d = gpu_lists(ptp, dtp, gpus)
    assert (p, d) == (want_p, want_d)
    assert len(set(p)) == ptp and len(set(d)) == dtp


def test_gpu_lists_refuse_an_instance_wider_than_the_gpus() -> None:
    with pytest.raises(ValueError, match="tp 4"):
        gpu_lists(1, 4, ["0", "1"])


@pytest.mark.parametrize(("p", "d"), [((2, 2), (2, 2)), ((2, 1), (4, 4)), ((4, 4), (2, 1))])
def test_plan_and_env_are_what_the_instances_accept(
    tmp_path: Path, p: tuple[int, int], d: tuple[int, int]
) -> None:
    cfg = StackConfig(prefill_tp=p[0], prefill_dcp=p[1], decode_tp=d[0], decode_dcp=d[1],
                      block_size=32, num_blocks=64, decode_num_blocks=9)
    plan_text = routing_plan_json(cfg)
    plan = load_plan(plan_text)
    assert (plan.decode.tensor_parallel_size, plan.decode.decode_context_parallel_size) == d
    f = tmp_path / "routing.json"
    f.write_text(plan_text)
    for role, (tp, dcp), blocks in (("prefill", p, 64), ("decode", d, 9)):
        env = instance_env(cfg, role, PORTS, str(f), None, "/run/grant.key")
        assert env["PDD_GRANT_KEY_FILE"] == "/run/grant.key"
        s = InstanceSettings.from_env(env)
        assert (s.role, s.tp, s.dcp, s.block_size, s.num_blocks) == (role, tp, dcp, 32, blocks)
        assert s.device == "cpu" and s.dtype == "float32" and s.model_source == "builtin"
        load_routing_file(s.routing_file, role, s.tp, s.dcp, s.block_size)  # raises on mismatch
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert (s.max_step_tokens, s.chunk_tokens) == (None, None)  # the device decides
        assert s.prefix_cache and "PDD_PREFIX_CACHE" not in env  # on by default
        off = instance_env(replace(cfg, prefix_cache=False), role, PORTS, str(f), None, "/k")
        assert off["PDD_PREFIX_CACHE"] == "0"
        assert not InstanceSettings.from_env(off).prefix_cache
    budget = StackConfig(max_step_tokens=4096, chunk_tokens=1024)
    s = InstanceSettings.from_env(instance_env(budget, "prefill", PORTS, str(f), None, "/k"))
    assert (s.max_step_tokens, s.chunk_tokens) == (4096, 1024)
    dec = InstanceSettings.from_env(instance_env(cfg, "decode", PORTS, str(f), None, "/k"))
    assert dec.prefill_urls == ["http://127.0.0.1:11000"]
    assert (dec.http_port, dec.side_channel_port, dec.dist_port) == (14000, 15000, 16000)
    renv = router_env(cfg, PORTS, "/run/grant.key")
    assert (renv["PDD_GRANT_KEY_FILE"], renv["PDD_BLOCK_SIZE"]) == ("/run/grant.key", "32")
    r = RouterSettings.from_env(renv)
    assert (r.port, r.prefill, r.decode) == (8000, ["http://127.0.0.1:11000"],
                                             ["http://127.0.0.1:14000"])


def test_no_prefix_cache_flag_and_its_env(tmp_path: Path) -> None:
    assert config_from_args(parser().parse_args([])).prefix_cache
    cfg = config_from_args(parser().parse_args(["--no-prefix-cache"]))
    assert not cfg.prefix_cache
    f = tmp_path / "routing.json"
    f.write_text(routing_plan_json(cfg))
    for role in ("prefill", "decode"):
        env = instance_env(cfg, role, PORTS, str(f), None, "/k")
        assert env["PDD_PREFIX_CACHE"] == "0"
        for bad in ("2", "on", "true"):
            with pytest.raises(ConfigError, match=f"PDD_PREFIX_CACHE: must be 0 or 1, got '{bad}'"):
                InstanceSettings.from_env({**env, "PDD_PREFIX_CACHE": bad})


def test_router_workers_flag_and_its_env() -> None:
    auto = auto_router_workers(usable_cpus())
    assert config_from_args(parser().parse_args([])).router_workers == auto
    assert config_from_args(parser().parse_args(["--router-workers", "auto"])).router_workers \
        == auto
    cfg = config_from_args(parser().parse_args(["--router-workers", "4"]))
    env = router_env(cfg, PORTS)
    assert env["PDD_ROUTER_WORKERS"] == "4"
    settings = RouterSettings.from_env(env)
    assert (settings.workers, settings.worker) == (4, None)
    assert RouterSettings.from_env({**env, "PDD_ROUTER_WORKER": "2"}).worker == 2
    for bad, says in (("0", "must be >= 1, got 0"), ("65", "must be <= 64, got 65"),
                      ("two", "must be an integer, got 'two'")):
        with pytest.raises(ConfigError, match=f"PDD_ROUTER_WORKERS: {says}"):
            RouterSettings.from_env({**env, "PDD_ROUTER_WORKERS": bad})


def test_api_key_flags_reach_the_router_alone(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-file\n")
    cfg = config_from_args(parser().parse_args(
        ["--api-key", "sk-1", "--api-key", "sk-2", "--api-key-file", str(keys)]))
    assert check_config(replace(cfg, port=0)) == []
    settings = RouterSettings.from_env(router_env(cfg, PORTS))
    assert settings.api_keys == ("sk-1", "sk-2") and settings.api_key_file == str(keys)
    for role in ("prefill", "decode"):
        env = instance_env(cfg, role, PORTS, "/r.json", "/k")
        assert not any(k.startswith("PDD_API_KEY") for k in env), role
    plain = router_env(config_from_args(parser().parse_args([])), PORTS)
    assert RouterSettings.from_env(plain).api_keys == ()


def test_gil_switch_interval_env(tmp_path: Path) -> None:
    cfg = StackConfig()
    f = tmp_path / "routing.json"
    f.write_text(routing_plan_json(cfg))
    env = instance_env(cfg, "decode", PORTS, str(f), None, "/k")
    assert InstanceSettings.from_env(env).gil_switch_interval_us == DEFAULT_GIL_SWITCH_INTERVAL_US
    s = InstanceSettings.from_env({**env, "PDD_GIL_SWITCH_INTERVAL_US": "250"})
    assert s.gil_switch_interval_us == 250.0
    for bad, why in (("0", "must be > 0, got 0.0"), ("-5", "must be >= 0"),
                     ("fast", "must be a number, got 'fast'"),
                     ("nan", "must be a finite number, got 'nan'"),
                     ("inf", "must be a finite number, got 'inf'")):
        with pytest.raises(ConfigError, match=f"PDD_GIL_SWITCH_INTERVAL_US: {why}"):
            InstanceSettings.from_env({**env, "PDD_GIL_SWITCH_INTERVAL_US": bad})
    with pytest.raises(ConfigError, match="PDD_LEASE_SECONDS: must be a finite number"):
        InstanceSettings.from_env({**env, "PDD_LEASE_SECONDS": "inf"})


def test_cuda_env_and_wildcard_host() -> None:
    cfg = StackConfig(device="cuda", decode_tp=2, host="0.0.0.0")
    env = instance_env(cfg, "decode", PORTS, "/r.json", ["1", "0"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert env["PDD_DTYPE"] == "bfloat16" and env["PDD_DEVICE"] == "cuda"
    assert env["PDD_BIND_HOST"] == "0.0.0.0" and env["POD_IP"] == "127.0.0.1"
    assert "PDD_NUM_BLOCKS" not in env and "PDD_MAX_NUM_SEQS" not in env  # instance defaults
    env = instance_env(StackConfig(max_num_seqs=8, max_waiting=0), "prefill", PORTS, "/r.json")
    assert (env["PDD_MAX_NUM_SEQS"], env["PDD_MAX_WAITING"]) == ("8", "0")


def test_ports_do_not_overlap_and_skip_busy_ones() -> None:
    busy = set(range(10000, 32000, 10))
    cfg = StackConfig(prefill_tp=4, decode_tp=8, decode_dcp=8, port=0, prefill_replicas=3,
                      decode_replicas=2)
    ports = pick_ports(cfg, lambda port: port not in busy, random.Random(7))
    assert (len(ports.prefill), len(ports.decode)) == (3, 2)
    spans = [range(ports.router, ports.router + 1)]
    for role, tp in (("prefill", 4), ("decode", 8)):
        for inst in ports.of(role):
            spans += [range(inst.http, inst.http + 1), range(inst.side, inst.side + tp),
                      range(inst.dist, inst.dist + 1)]
    used = [port for span in spans for port in span]
    assert len(used) == len(set(used)) == 1 + 3 * (4 + 2) + 2 * (8 + 2)
    assert not busy.intersection(used)
    assert pick_ports(StackConfig(port=8123), lambda port: True).router == 8123


def test_pdd_help_lists_serve_without_importing_torch() -> None:
    code = ("import sys; from pdd_cli.main import main; import pdd_sidecar.serve.local_stack; "
            "assert 'torch' not in sys.modules and 'aiohttp' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'aiohttp'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "pdd_cli.main", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "serve" in out


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4),
                                               (128, 4)])
def test_auto_router_workers_by_usable_cpus(cpus: int, workers: int) -> None:
    assert auto_router_workers(cpus) == workers


def test_router_workers_neither_auto_nor_a_number_exits_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--router-workers", "many"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--router-workers: must be auto or a number of processes, got 'many'" in err, err


@pytest.mark.parametrize(
    ("share", "instances", "want"),
    [
        # P TP1 + D TP1 on one GPU: the split
        (0.5, [("prefill", ["0"]), ("decode", ["0"])], [0.45, 0.45]),
        (0.25, [("prefill", ["0"]), ("decode", ["0"])], [0.225, 0.675]),
        # each alone on its GPU: all of it
        (0.5, [("prefill", ["0"]), ("decode", ["1"])], [0.9, 0.9]),
        # P TP1 + D TP2 on 2 GPUs: the decode's rank on GPU 0 shares it, so the decode takes
        # its smaller part on every rank
        (0.5, [("prefill", ["0"]), ("decode", ["1", "0"])], [0.45, 0.45]),
        # two prefills beside a decode split the prefills' part
        (0.5, [("prefill", ["0"]), ("prefill", ["0"]), ("decode", ["0"])], [0.225, 0.225, 0.45]),
        # two decodes alone on a GPU split all of it
        (0.5, [("decode", ["0"]), ("decode", ["0"])], [0.45, 0.45]),
    ],
)
def test_memory_split_between_instances_on_a_gpu(
        share: float, instances: list[tuple[str, list[str]]], want: list[float]) -> None:
    got = memory_utilizations(0.9, share, instances)
    assert got == pytest.approx(want)
    per_gpu: dict[str, float] = {}
    for (_, gpus), u in zip(instances, got, strict=True):
        for g in gpus:
            per_gpu[g] = per_gpu.get(g, 0.0) + u
    assert all(total <= 0.9 + 1e-9 for total in per_gpu.values()), per_gpu


def test_memory_flags_reach_the_instances_on_cuda_only() -> None:
    a = parser().parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.8",
                             "--prefill-memory-share", "0.3"])
    cfg = config_from_args(a)
    assert (cfg.gpu_memory_utilization, cfg.prefill_memory_share) == (0.8, 0.3)
    p_util, d_util = memory_utilizations(0.8, 0.3, [("prefill", ["0"]), ("decode", ["0"])])
    env = instance_env(cfg, "prefill", PORTS, "/r.json", ["0"], "/k", p_util)
    s = InstanceSettings.from_env(env)
    assert s.gpu_memory_utilization == pytest.approx(0.24) and s.num_blocks is None
    env = instance_env(cfg, "decode", PORTS, "/r.json", ["0"], "/k", d_util)
    assert InstanceSettings.from_env(env).gpu_memory_utilization == pytest.approx(0.56)
    cpu = config_from_args(parser().parse_args([]))
    assert "PDD_GPU_MEMORY_UTILIZATION" not in instance_env(cpu, "decode", PORTS, "/r.json")
    assert (cpu.gpu_memory_utilization, cpu.prefill_memory_share) == (0.9, 0.5)


def test_block_size_defaults_by_device_and_the_flag_wins() -> None:
    cuda = config_from_args(parser().parse_args(["--device", "cuda"]))
    cpu = config_from_args(parser().parse_args([]))
    assert (cuda.resolved_block_size, cpu.resolved_block_size) == (64, 16)
    assert deployment_spec(cuda)["blockSize"] == 64
    assert instance_env(cuda, "decode", PORTS, "/r.json")["PDD_BLOCK_SIZE"] == "64"
    assert router_env(cpu, PORTS)["PDD_BLOCK_SIZE"] == "16"
    explicit = config_from_args(parser().parse_args(["--device", "cuda", "--block-size", "32",
                                                     "--num-blocks", "3000"]))
    env = instance_env(explicit, "prefill", PORTS, "/r.json")
    assert (env["PDD_BLOCK_SIZE"], env["PDD_NUM_BLOCKS"]) == ("32", "3000")
    text = parser().format_help()
    for words in ("default 64 on cuda", "16 on cpu", "--gpu-memory-utilization F",
                  "--prefill-memory-share S", "F x S", "F x (1 - S)"):
        assert words in " ".join(text.split()), words


def test_replicas_each_their_own_ports_and_replica_index_every_decode_reads_every_prefill(
        tmp_path: Path) -> None:
    cfg = config_from_args(parser().parse_args(["--prefill-replicas", "2", "--decode-replicas",
                                                "3", "--prefill-tp", "2"]))
    assert (cfg.prefill_replicas, cfg.decode_replicas) == (2, 3)
    assert config_from_args(parser().parse_args([])).prefill_replicas == 1
    assert cfg.layout() == "2 x prefill tp2/dcp1, 3 x decode tp1/dcp1"
    assert cfg.names("prefill") == ["prefill-0", "prefill-1"]
    assert StackConfig().names("decode") == ["decode"]  # one: the names and logs of before
    f = tmp_path / "routing.json"
    f.write_text(routing_plan_json(cfg))
    ports = pick_ports(cfg, lambda port: True, random.Random(3))
    prefills = [f"http://127.0.0.1:{p.http}" for p in ports.prefill]
    decodes = [f"http://127.0.0.1:{p.http}" for p in ports.decode]
    seen = set()
    for role, n in (("prefill", 2), ("decode", 3)):
        for i in range(n):
            s = InstanceSettings.from_env(instance_env(cfg, role, ports, str(f), None, "/k",
                                                       replica=i))
            own = ports.of(role)[i]
            assert (s.replica, s.http_port, s.side_channel_port, s.dist_port) == (
                i, own.http, own.side, own.dist)
            seen.add(s.http_port)
            if role == "decode":
                assert s.prefill_urls == prefills
    assert len(seen) == 5
    r = RouterSettings.from_env(router_env(cfg, ports))
    assert (r.prefill, r.decode) == (prefills, decodes)


def test_replicas_take_the_next_gpus_in_turn() -> None:
    cfg = StackConfig(device="cuda", prefill_replicas=2, decode_replicas=2, decode_tp=2)
    assert stack_gpus(cfg, [str(g) for g in range(8)]) == (
        [["0"], ["1"]], [["2", "3"], ["4", "5"]])
    assert stack_gpus(cfg, ["0", "1"]) == ([["0"], ["1"]], [["0", "1"], ["0", "1"]])
    one = StackConfig(device="cuda", prefill_replicas=3, decode_replicas=2)
    assert stack_gpus(one, ["7"]) == ([["7"]] * 3, [["7"]] * 2)  # all share the one GPU
    with pytest.raises(ValueError, match="tp 2"):
        stack_gpus(cfg, ["0"])


def test_replicas_sharing_a_gpu_split_its_memory() -> None:
    cfg = StackConfig(device="cuda", prefill_replicas=2, decode_replicas=1,
                      gpu_memory_utilization=0.9, prefill_memory_share=0.5)
    p_util, d_util = stack_memory(cfg, *stack_gpus(cfg, ["0"]))
    assert (p_util, d_util) == (pytest.approx([0.225, 0.225]), pytest.approx([0.45]))
    p_util, d_util = stack_memory(cfg, *stack_gpus(cfg, ["0", "1", "2"]))  # each on its own
    assert (p_util, d_util) == (pytest.approx([0.9, 0.9]), pytest.approx([0.9]))


def test_the_stack_is_ready_once_its_router_sees_every_instance_ready() -> None:
    p, d = ["http://h:1", "http://h:2"], ["http://h:3"]
    seen = {"ready": True, "prefill": {p[0]: True, p[1]: True}, "decode": {d[0]: True}}
    assert router_sees(seen, p, d)
    assert not router_sees({**seen, "prefill": {p[0]: True, p[1]: False}}, p, d)
    assert not router_sees({**seen, "prefill": {p[0]: True}}, p, d)  # not probed yet
    assert not router_sees({**seen, "ready": False}, p, d)
    assert not router_sees(None, p, d)


def test_kv_cache_dtype_and_speculative_flags_reach_their_instances(tmp_path: Path) -> None:
    default = config_from_args(parser().parse_args([]))
    assert (default.kv_cache_dtype, default.speculative) == ("auto", None)
    cfg = config_from_args(parser().parse_args([
        "--kv-cache-dtype", "fp8", "--speculative",
        '{"method": "ngram", "tokens": 2, "ngram": {"maxN": 3}}']))
    assert problems(cfg) == []
    plan_text = routing_plan_json(cfg)
    assert load_plan(plan_text).kv_cache_dtype == "fp8"
    f = tmp_path / "routing.json"
    f.write_text(plan_text)
    for role in ("prefill", "decode"):
        s = InstanceSettings.from_env(instance_env(cfg, role, PORTS, str(f), None, "/k"))
        assert s.kv_cache_dtype == "fp8"
        spec = s.speculative
        if role == "prefill":
            assert spec is None
        else:
            assert spec is not None
            assert (spec.method, spec.tokens, spec.ngram_max, spec.ngram_min) == (
                "ngram", 2, 3, 1)
    env = instance_env(default, "decode", PORTS, str(f), None, "/k")
    assert not [k for k in env if k.startswith(("PDD_SPECULATIVE_", "PDD_KV_CACHE_DTYPE"))]
    # mtp: the prefill runs the module too (its cache holds the module's latents, as the
    # decode's; it sends the draft state), told by the method alone
    mtp = config_from_args(parser().parse_args(["--speculative", '{"method": "mtp"}']))
    for role, tokens in (("prefill", None), ("decode", "1")):
        env = instance_env(mtp, role, PORTS, str(f), None, "/k")
        assert env["PDD_SPECULATIVE_METHOD"] == "mtp"
        assert env.get("PDD_SPECULATIVE_TOKENS") == tokens
        assert InstanceSettings.from_env(env).cache_extra_layers == 1


def test_mtp_on_a_checkpoint_without_the_module_names_the_flag() -> None:
    cfg = StackConfig(model="/models/DeepSeek-V2-Lite-Chat", speculative={"method": "mtp"})
    assert problems(cfg) == [
        "--speculative: spec.decode.speculative.method: mtp needs a checkpoint with a "
        "multi-token-prediction module (DeepSeek-V3/R1: num_nextn_predict_layers 1), and "
        "DeepSeek-V2-Lite-Chat has none; use ngram"]


def test_speculative_that_is_not_json_exits_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--speculative", "method=ngram"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("--speculative: must be JSON such as '{\"method\": \"ngram\", \"tokens\": 2}', "
            "got 'method=ngram'") in err, err

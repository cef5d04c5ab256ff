"""`spec.engine: vllm`: the rendered vLLM pods, the router in front, vLLM's extra rules, and
vLLM's published routing cases against pdd's planner."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_cases import INVALID, VLLM, VLLM_ROUTER_IMAGE

from pdd_api import keys
from pdd_api.rules import check_rules
from pdd_api.validation import parse_spec, validate_spec
from pdd_operator import builders_vllm
from pdd_operator.builders import Owner, build, configmap_name, grant_secret_name

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "vllm-engine.yaml"
OWNER = Owner("demo", "ns1", "uid-1")


def vllm_spec(p: tuple[int, int], d: tuple[int, int], **more: Any) -> dict[str, Any]:
    spec = copy.deepcopy(VLLM)
    spec["prefill"] = {"tensorParallelSize": p[0], "decodeContextParallelSize": p[1]}
    spec["decode"] = {"tensorParallelSize": d[0], "decodeContextParallelSize": d[1]}
    spec.update(more)
    return spec


def main_container(pod: dict[str, Any]) -> dict[str, Any]:
    c = pod["spec"]["containers"][0]
    assert c["name"] == keys.CONTAINER_NAME
    return c


def flag(argv: list[str], name: str) -> str | None:
    """The value after `name`, None when absent; a flag given twice is a rendering bug."""
    hits = [i for i, a in enumerate(argv) if a == name]
    assert len(hits) <= 1, f"{name} given {len(hits)} times: {argv}"
    return argv[hits[0] + 1] if hits else None


@pytest.mark.parametrize(("p", "d", "block"), [((4, 4), (2, 2), 64), ((2, 1), (8, 8), 16),
                                               ((1, 1), (1, 1), 128), ((8, 8), (4, 1), 32)])
def test_command_line_per_role(p: tuple[int, int], d: tuple[int, int], block: int) -> None:
    spec = parse_spec(vllm_spec(p, d, blockSize=block))
    desired = build(OWNER, spec)
    for role, (tp, dcp) in (("prefill", p), ("decode", d)):
        argv = main_container(desired.pods[role][0])["command"]
        assert argv[:3] == ["vllm", "serve", spec.model.name]
        assert flag(argv, "--tensor-parallel-size") == str(tp)
        assert flag(argv, "--decode-context-parallel-size") == str(dcp)
        assert flag(argv, "--block-size") == str(block)
        assert flag(argv, "--port") == str(keys.HTTP_PORT)
        assert flag(argv, "--dtype") == spec.model.dtype
        kv = flag(argv, "--kv-transfer-config")
        assert kv is not None
        assert json.loads(kv) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        # vLLM's NIXL DCP change: interleave at block granularity, only when DCP > 1.
        assert flag(argv, "--cp-kv-cache-interleave-size") == (str(block) if dcp > 1 else None)
        assert flag(argv, "--served-model-name") is None


def test_model_source_is_served_under_the_model_name_and_extra_args_come_last() -> None:
    raw = vllm_spec((2, 2), (2, 1), model={"name": "deepseek-ai/DeepSeek-V2-Lite-Chat",
                                           "source": "/models/v2-lite", "dtype": "float32"})
    raw["decode"]["extraArgs"] = ["--max-model-len", "4096"]
    desired = build(OWNER, parse_spec(raw))
    argv = main_container(desired.pods["decode"][0])["command"]
    assert argv[2] == "/models/v2-lite"
    assert flag(argv, "--served-model-name") == "deepseek-ai/DeepSeek-V2-Lite-Chat"
    assert flag(argv, "--dtype") == "float32"
    assert argv[-2:] == ["--max-model-len", "4096"]
    assert "--max-model-len" not in main_container(desired.pods["prefill"][0])["command"]


def test_prefix_cache_off_is_vllms_flag_on_that_role_only() -> None:
    raw = vllm_spec((2, 2), (2, 1))
    raw["decode"]["prefixCache"] = False
    desired = build(OWNER, parse_spec(raw))
    assert "--no-enable-prefix-caching" in main_container(desired.pods["decode"][0])["command"]
    assert "--no-enable-prefix-caching" not in main_container(
        desired.pods["prefill"][0])["command"]


def test_gpu_memory_share_and_a_fixed_pool_are_vllms_flags_on_that_role_only() -> None:
    desired = build(OWNER, parse_spec(vllm_spec((2, 2), (2, 1))))
    for role in ("prefill", "decode"):  # vLLM's default share is pdd's: nothing written
        argv = main_container(desired.pods[role][0])["command"]
        assert flag(argv, "--gpu-memory-utilization") is None
        assert flag(argv, "--num-gpu-blocks-override") is None
    raw = vllm_spec((2, 2), (2, 1))
    raw["decode"].update({"gpuMemoryUtilization": 0.75, "kvCacheBlocks": 5000,
                          "extraArgs": ["--max-num-seqs", "64"]})
    desired = build(OWNER, parse_spec(raw))
    argv = main_container(desired.pods["decode"][0])["command"]
    assert flag(argv, "--gpu-memory-utilization") == "0.75"
    assert flag(argv, "--num-gpu-blocks-override") == "5000"
    assert argv[-2:] == ["--max-num-seqs", "64"]
    assert flag(main_container(desired.pods["prefill"][0])["command"],
                "--gpu-memory-utilization") is None
    # pdd's sidecar env means nothing to vLLM and is not rendered.
    names = {e["name"] for e in main_container(desired.pods["decode"][0])["env"]}
    assert not names & {keys.ENV_GPU_MEMORY_UTILIZATION, keys.ENV_NUM_BLOCKS}


def test_a_host_tier_is_refused_with_engine_vllm_and_zero_is_not() -> None:
    raw = vllm_spec((2, 2), (2, 1))
    raw["prefill"]["hostKVCacheGiB"] = 0.5
    assert validate_spec(raw) == [
        "spec.prefill.hostKVCacheGiB: with engine vllm, must be 0 (the host KV cache tier is "
        "served by pdd sidecars only), got 0.5"]
    raw["prefill"]["hostKVCacheGiB"] = 0
    assert validate_spec(raw) == []
    raw["engine"] = "pdd"
    raw["prefill"]["hostKVCacheGiB"] = 0.5
    assert validate_spec(raw) == []


def test_env_probes_ports_and_what_is_not_mounted() -> None:
    raw = vllm_spec((4, 4), (2, 2), kvTransfer={"sideChannelPort": 6100})
    raw["decode"]["env"] = [{"name": "UCX_TLS", "value": "tcp"},
                            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "1"}]
    desired = build(OWNER, parse_spec(raw))
    for role in ("prefill", "decode"):
        pod = desired.pods[role][0]
        c = main_container(pod)
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "6100"
        assert [e["name"] for e in c["env"]].count("VLLM_NIXL_SIDE_CHANNEL_PORT") == 1
        assert not any(n.startswith("PDD_") for n in env)  # pdd's sidecar contract is not vLLM's
        assert ("UCX_TLS" in env) == (role == "decode")
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[kind]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": keys.HTTP_PORT, "side-channel": 6100}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(raw[role]["tensorParallelSize"])
        # No routing ConfigMap or grant key in a vLLM pod; /dev/shm stays.
        vols = pod["spec"]["volumes"]
        assert [v["name"] for v in vols] == [m["name"] for m in c["volumeMounts"]]
        assert [m["mountPath"] for m in c["volumeMounts"]] == ["/dev/shm"]
        text = json.dumps(pod)
        assert configmap_name(OWNER.name) not in text
        assert grant_secret_name(OWNER.name) not in text
        # vLLM's images run as root: runAsNonRoot is left to a template; the rest applies.
        assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["spec"]["hostname"] == f"demo-{role}-0"
        assert pod["metadata"]["labels"][keys.LABEL_COMPONENT] == role


def test_router_speaks_vllm_protocol_from_its_own_image() -> None:
    spec = parse_spec(vllm_spec((4, 4), (2, 2)))
    desired = build(OWNER, spec)
    assert desired.router_deployment is not None
    c = desired.router_deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PDD_ROUTER_UPSTREAM_PROTOCOL"] == "vllm"
    assert c["image"] == VLLM["router"]["image"] != spec.image
    pdd = parse_spec({**VLLM, "engine": "pdd", "router": {}})
    pc = build(OWNER, pdd).router_deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert "PDD_ROUTER_UPSTREAM_PROTOCOL" not in {e["name"] for e in pc["env"]}
    assert pc["image"] == pdd.image
    # Apart from the protocol and the image, the router Deployment is the one pdd renders.
    pc_env = [e for e in c["env"] if e["name"] != "PDD_ROUTER_UPSTREAM_PROTOCOL"]
    assert pc_env == pc["env"]
    assert {k: v for k, v in c.items() if k not in ("env", "image")} == {
        k: v for k, v in pc.items() if k not in ("env", "image")}


def test_template_overlay_applies_to_vllm_pods() -> None:
    raw = vllm_spec((2, 2), (2, 2))
    raw["prefill"]["template"] = {"spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
        "containers": [{"name": "sidecar", "volumeMounts": [{"name": "models",
                                                              "mountPath": "/models"}]}]}}
    pod = build(OWNER, parse_spec(raw)).pods["prefill"][0]
    c = main_container(pod)
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/dev/shm", "/models"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["command"][:2] == ["vllm", "serve"]


def test_engine_changes_the_pods_and_so_their_hash() -> None:
    raw = vllm_spec((2, 2), (2, 2))
    a = build(OWNER, parse_spec(raw)).pods["decode"][0]
    b = build(OWNER, parse_spec({**raw, "engine": "pdd"})).pods["decode"][0]
    ha = a["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    assert ha != b["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    assert main_container(b)["command"][:3] == ["python", "-m", "pdd_sidecar"]


@pytest.mark.parametrize("tp", range(1, 65))
def test_pdd_dcp_rule_implies_vllms_dcp_divides_tp(tp: int) -> None:
    """vLLM requires tp % dcp == 0; pdd's dcp in {1, tp} never lets a spec through that
    breaks it, so no fourth rule is needed."""
    for dcp in range(0, tp + 2):
        raw = vllm_spec((tp, dcp), (tp, 1))
        dcp_problems = [m for m in check_rules(raw)
                        if m.startswith("spec.prefill.decodeContextParallelSize")]
        if not dcp_problems:
            assert dcp >= 1 and tp % dcp == 0, (tp, dcp)


@pytest.mark.parametrize(("p", "d"), [(2, 3), (4, 6), (6, 4), (3, 8), (16, 12)])
def test_tp_sizes_that_do_not_divide_are_vllm_only_refusals(p: int, d: int) -> None:
    message = ("spec.decode.tensorParallelSize: with engine vllm, must divide or be a multiple "
               f"of spec.prefill.tensorParallelSize ({p}), got {d}")
    assert validate_spec(vllm_spec((p, 1), (d, 1))) == [message]
    assert validate_spec({**vllm_spec((p, 1), (d, 1)), "engine": "pdd"}) == []
    assert validate_spec(vllm_spec((p, 1), (p * (d // p + 1), 1))) == []


def test_router_image_rule_follows_the_router() -> None:
    no_image = {**VLLM, "router": {}}
    assert validate_spec(no_image) == [VLLM_ROUTER_IMAGE]
    assert validate_spec({k: v for k, v in VLLM.items() if k != "router"}) == [VLLM_ROUTER_IMAGE]
    assert validate_spec({**VLLM, "router": {"enabled": False}}) == []
    assert validate_spec({**no_image, "engine": "pdd"}) == []


# vLLM's published routing cases (the NIXL DCP change's description and docs), read as pdd's
# plan summary; test_routing.py pins the chunk residues of the same layouts.
PUBLISHED = [
    ((4, 4), (2, 2), {0: [0, 2], 1: [1, 3]}),
    ((2, 2), (4, 4), {3: [1]}),
]


@pytest.mark.parametrize(("p", "d", "reads"), PUBLISHED)
def test_vllm_published_routing_cases(p: tuple[int, int], d: tuple[int, int],
                                      reads: dict[int, list[int]]) -> None:
    plan = build(OWNER, parse_spec(vllm_spec(p, d))).plan
    for rank, sources in reads.items():
        assert [r.prefill_rank for r in plan.decode_ranks[rank].reads] == sources
    if p == (4, 4):
        assert plan.summary() == "D0 <- P0,P2; D1 <- P1,P3"


def test_sample_is_valid_and_renders_vllm_pods() -> None:
    doc = yaml.safe_load(SAMPLE.read_text())
    spec = parse_spec(doc["spec"])
    assert spec.engine == "vllm"
    desired = build(Owner(doc["metadata"]["name"], "ns", "u"), spec)
    assert all(main_container(p)["command"][:2] == builders_vllm.VLLM_SERVE
               for pods in desired.pods.values() for p in pods.values())


@pytest.mark.parametrize(("name", "spec", "message"),
                         [c for c in INVALID if c[1].get("engine") == "vllm"],
                         ids=[c[0] for c in INVALID if c[1].get("engine") == "vllm"])
def test_webhook_refuses_vllm_cases_with_pdd_validate_words(name: str, spec: dict[str, Any],
                                                           message: str) -> None:
    from pdd_operator.webhook import admission_problems

    doc = {"apiVersion": "serving.pdd.dev/v1alpha1", "kind": "PDDeployment",
           "metadata": {"name": "demo"}, "spec": spec}
    assert admission_problems(doc, None) == [message]

"""Three validators, one verdict: `pdd validate`, the admission webhook's check and the API
server's schema + CEL (a server-side dry run) accept and refuse the same specs, over thousands of
generated specs, valid and hostile (wrong types, nulls, integral and fractional floats, huge and
negative numbers, missing, extra and oversized fields).

The API server is asked with fieldValidation=Strict, as kubectl asks by default: an unknown
field is refused, as `pdd validate` refuses it. PDD_VALIDATOR_SPECS sets how many specs (CI runs
the default sample with a fixed seed; the full property run is 10000).
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import random
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from localcluster import Cluster
from test_crd import CRD_FILE, CRD_NAME, crd, namespace  # noqa: F401  (fixtures)

from pdd_api.models import API_GROUP, API_VERSION, KIND, PLURAL
from pdd_api.rules import check_rules
from pdd_api.structural import INT64_MAX, INT64_MIN, json_integer, normalize
from pdd_api.validation import parse_spec, validate_document, validate_name
from pdd_operator.webhook import admission_problems

pytestmark = pytest.mark.integration

SEED = 20261130
SPECS = int(os.environ.get("PDD_VALIDATOR_SPECS", "1000"))
WORKERS = 8

Path_ = tuple[str | int, ...]
ROLES = ("prefill", "decode")
TEMPLATED = (*ROLES, "router")

INTS = [-(2**63) - 1, -(2**63), -1, 0, 1, 2, 3, 4, 6, 8, 15, 16, 17, 32, 64, 65, 100, 1023,
        1024, 1025, 1040, 5600, 65471, 65472, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 10**30]
FLOATS = [1.0, 2.0, 4.0, 64.0, 5600.0, 1000.0, -0.0, -3.0, 2.5, 0.5, 1e20, 2.000000001,
          2.00000001, 1000.0000001, -3.0000000001, float(2**53), 9007199254740991.0]
STRINGS = ["", "x", "4", "pdd:0.2.0", "true", "null", "ünïcode", "a" * 300, "1e3"]
HOSTILE: list[Any] = [None, None, None, True, False, [], [1], ["a"], {}, {"a": 1}, *FLOATS,
                      *INTS[::3], *STRINGS[::2]]
QUANTITIES: list[Any] = [1, 4, "4", "500m", "1Gi", 2.0, 1.5, "", None, True, 2**63]
# Numbers (a double in CEL) and memory quantities, around the KV memory rules' edges.
NUMBERS: list[Any] = [0, 0.0, 0.05, 0.3, 0.5, 0.9, 1, 1.0, 1.5, -0.25, 2, 8, 4096, 4097, 1e20]
MEMORY: list[Any] = ["16Gi", "32Gi", "64Gi", "1Gi", "6G", 34359738368, "lots", "", 2.0, 1.5,
                     34359738368.0, None]


@dataclass(frozen=True)
class Leaf:
    path: Path_
    kind: str  # int | number | str | bool | enum | map_str | map_q | quantity | memory
    # | list_str | free | obj | list_obj
    values: tuple[Any, ...] = ()


def _leaves() -> list[Leaf]:
    out = [
        Leaf(("model",), "obj"), Leaf(("model", "name"), "str"),
        Leaf(("model", "source"), "str"),
        Leaf(("model", "dtype"), "enum", ("bfloat16", "float32", "float16", "")),
        Leaf(("image",), "str"), Leaf(("blockSize",), "int"),
        Leaf(("engine",), "enum", ("pdd", "vllm", "vLLM", "")), Leaf(("router", "image"), "str"),
        Leaf(("kvTransfer",), "obj"), Leaf(("kvTransfer", "backend"), "enum", ("UCX", "ucx")),
        Leaf(("kvTransfer", "sideChannelPort"), "int"),
        Leaf(("router",), "obj"), Leaf(("router", "enabled"), "bool"),
        Leaf(("router", "policy"), "enum", ("cache-aware", "least-loaded", "round-robin",
                                             "Round-Robin", "")),
        Leaf(("router", "replicas"), "int"), Leaf(("router", "resources"), "obj"),
        Leaf(("router", "resources", "limits"), "map_q"),
        Leaf(("rollout",), "obj"), Leaf(("rollout", "maxUnavailable"), "int"),
        Leaf(("networkPolicy",), "obj"), Leaf(("networkPolicy", "enabled"), "bool"),
        Leaf(("tracing",), "obj"),
        Leaf(("tracing", "endpoint"), "enum", ("http://jaeger:4317", "https://t:4318",
                                               "jaeger:4317", "")),
        Leaf(("tracing", "protocol"), "enum", ("grpc", "http/protobuf", "http/json", "GRPC")),
        Leaf(("tracing", "samplingRatio"), "number"),
    ]
    for r in ROLES:
        out += [
            Leaf((r,), "obj"), Leaf((r, "replicas"), "int"), Leaf((r, "tensorParallelSize"), "int"),
            Leaf((r, "decodeContextParallelSize"), "int"), Leaf((r, "gpusPerPod"), "int"),
            Leaf((r, "resources"), "obj"),
            Leaf((r, "resources", "limits"), "map_q"), Leaf((r, "resources", "requests"), "map_q"),
            Leaf((r, "resources", "limits", "nvidia.com/gpu"), "quantity"),
            Leaf((r, "resources", "requests", "nvidia.com/gpu"), "quantity"),
            Leaf((r, "resources", "limits", "cpu"), "quantity"),
            Leaf((r, "nodeSelector"), "map_str"), Leaf((r, "nodeSelector", "pool"), "str"),
            Leaf((r, "tolerations"), "list_obj"), Leaf((r, "tolerations", 0), "obj"),
            Leaf((r, "tolerations", 0, "key"), "str"),
            Leaf((r, "tolerations", 0, "operator"), "enum", ("Exists", "Equal", "In")),
            Leaf((r, "tolerations", 0, "effect"), "enum", ("NoSchedule", "NoExecute", "")),
            Leaf((r, "tolerations", 0, "tolerationSeconds"), "int"),
            Leaf((r, "affinity"), "free"), Leaf((r, "env"), "list_obj"), Leaf((r, "env", 0), "obj"),
            Leaf((r, "env", 0, "name"), "str"), Leaf((r, "env", 0, "value"), "str"),
            Leaf((r, "env", 0, "valueFrom"), "free"), Leaf((r, "extraArgs"), "list_str"),
            Leaf((r, "extraArgs", 0), "str"),
            Leaf((r, "imagePullPolicy"), "enum", ("Always", "IfNotPresent", "Never", "never")),
            Leaf((r, "priorityClassName"), "str"), Leaf((r, "prefixCache"), "bool"),
            Leaf((r, "gpuMemoryUtilization"), "number"), Leaf((r, "kvCacheBlocks"), "int"),
            Leaf((r, "hostKVCacheGiB"), "number"),
            Leaf((r, "resources", "limits", "memory"), "memory"),
        ]
    a = ("autoscaling",)
    out += [Leaf(a, "obj"), Leaf((*a, "intervalSeconds"), "int"),
            Leaf((*a, "scaleDownStabilizationSeconds"), "int"),
            Leaf((*a, "prometheusURL"), "enum", ("http://prom:9090", "https://p", "prom:9090",
                                                  ""))]
    for r, latency in (("prefill", "ttft"), ("decode", "tpot")):
        out += [Leaf((*a, r), "obj"), Leaf((*a, r, "enabled"), "bool"),
                Leaf((*a, r, "minReplicas"), "int"), Leaf((*a, r, "maxReplicas"), "int"),
                Leaf((*a, r, latency), "obj"), Leaf((*a, r, latency, "percentile"), "number"),
                Leaf((*a, r, latency, "seconds"), "number")]
    out += [Leaf((*a, "prefill", "queuedPromptTokensPerReplica"), "int"),
            Leaf((*a, "prefill", "promptTokensPerSecondPerReplica"), "int"),
            Leaf((*a, "decode", "sequencesPerReplica"), "int"),
            Leaf((*a, "decode", "kvCacheUtilization"), "number")]
    for r in TEMPLATED:
        t = (r, "template")
        out += [
            Leaf(t, "obj"), Leaf((*t, "metadata"), "obj"),
            Leaf((*t, "metadata", "labels"), "map_str"),
            Leaf((*t, "metadata", "labels", "team"), "str"),
            Leaf((*t, "metadata", "annotations"), "map_str"), Leaf((*t, "spec"), "free"),
            Leaf((*t, "spec", "hostname"), "str"), Leaf((*t, "spec", "volumes"), "list_obj"),
            Leaf((*t, "spec", "containers"), "list_obj"),
            Leaf((*t, "spec", "containers", 0), "obj"),
            Leaf((*t, "spec", "containers", 0, "name"), "str"),
            Leaf((*t, "spec", "containers", 0, "image"), "str"),
            Leaf((*t, "spec", "containers", 0, "command"), "list_str"),
            Leaf((*t, "spec", "containers", 0, "ports"), "list_obj"),
            Leaf((*t, "spec", "containers", 0, "volumeMounts"), "list_obj"),
        ]
    return out


LEAVES = _leaves()
OBJECTS = [leaf.path for leaf in LEAVES if leaf.kind in ("obj", "free")] + [()]


def _plausible(r: random.Random, leaf: Leaf) -> Any:
    """A value of the leaf's own type (often out of range, sometimes valid)."""
    k = leaf.kind
    if k == "int":
        return r.choice(INTS)
    if k == "number":
        return r.choice(NUMBERS)
    if k == "memory":
        return r.choice(MEMORY)
    if k == "str":
        return r.choice(STRINGS)
    if k == "bool":
        return r.choice([True, False])
    if k == "enum":
        return r.choice(leaf.values)
    if k == "quantity":
        return r.choice(QUANTITIES)
    if k == "map_q":
        return {r.choice(["cpu", "memory", "nvidia.com/gpu"]): r.choice(QUANTITIES)}
    if k == "map_str":
        n = r.choice([0, 1, 2, 63, 64, 65])
        prefix = r.choice(["k", "k", "app.kubernetes.io/", f"{API_GROUP}/"])
        out: dict[str, Any] = {f"{prefix}{i}": "v" for i in range(n)}
        if r.random() < 0.3:
            out["extra"] = r.choice([None, "v", 1])
        return out
    if k == "list_str":
        return [r.choice(["--x", "", None, 1]) for _ in range(r.randint(0, 3))]
    if k == "list_obj":
        n = r.choice([0, 1, 2, 15, 16, 17])
        return [{"name": f"c{i}"} if r.random() < 0.9 else r.choice([None, {}, 1])
                for i in range(n)]
    return r.choice([{}, {"a": None}, {"nodeAffinity": {"x": [1, None]}}, {"name": "sidecar"}])


def _set(spec: dict[str, Any], path: Path_, value: Any) -> dict[str, Any]:
    if not path:
        return value  # type: ignore[no-any-return]
    node: Any = spec
    for part, nxt in zip(path[:-1], path[1:], strict=True):
        want: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            assert isinstance(part, int)
            if part >= len(node):
                node.append(want)
                part = len(node) - 1
            if not isinstance(node[part], type(want)):
                node[part] = want
            node = node[part]
        else:
            if not isinstance(node.get(part), type(want)):
                node[part] = want
            node = node[part]
    last = path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        if last >= len(node):
            node.append(value)
        else:
            node[last] = value
    else:
        node[last] = value
    return spec


def _delete(spec: Any, path: Path_) -> None:
    node = spec
    for part in path[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)
    elif isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node):
        node.pop(path[-1])


def valid_spec(r: random.Random) -> dict[str, Any]:
    tps = [1, 2, 4, 8]
    p_tp = r.choice(tps)
    p_dcp = r.choice([1, p_tp])
    d_tp = r.choice(tps)
    d_dcp = r.choice([d for d in (1, d_tp) if d % p_dcp == 0 or p_dcp % d == 0])
    spec: dict[str, Any] = {
        "model": {"name": r.choice(["deepseek-ai/DeepSeek-V2-Lite-Chat", "tiny"])},
        "image": "pdd:0.1.0",
    }
    for role, tp, dcp in (("prefill", p_tp, p_dcp), ("decode", d_tp, d_dcp)):
        node: dict[str, Any] = {}
        if tp != 1 or r.random() < 0.5:
            node["tensorParallelSize"] = tp
        if dcp != 1 or r.random() < 0.5:
            node["decodeContextParallelSize"] = dcp
        if r.random() < 0.3:
            node["replicas"] = r.randint(1, 4)
        per_pod = tp
        if r.random() < 0.2:
            per_pod = r.choice([g for g in (1, 2, 4, 8) if tp % g == 0])
            node["gpusPerPod"] = per_pod
        if r.random() < 0.3:
            node["resources"] = {"limits": {"nvidia.com/gpu": r.choice([per_pod, str(per_pod)]),
                                            "memory": "64Gi"}}
        if r.random() < 0.2:
            node["gpuMemoryUtilization"] = r.choice([0.5, 0.8, 0.9, 1])
        if r.random() < 0.1:
            node["kvCacheBlocks"] = r.choice([1, 1000, 2**24])
        if r.random() < 0.2:  # a host tier the 64Gi limit (when given) holds
            node["hostKVCacheGiB"] = r.choice([g for g in (0, 0.5, 4, 8) if g * per_pod <= 64])
        if r.random() < 0.2:
            node["nodeSelector"] = {"pool": "gpu"}
        if r.random() < 0.2:
            node["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                    "effect": "NoSchedule"}]
        if r.random() < 0.15:
            node["env"] = [{"name": "LOG", "value": "debug"}]
        if r.random() < 0.1:
            node["extraArgs"] = ["--verbose"]
        if r.random() < 0.2:
            node["template"] = {
                "metadata": {"labels": {"team": "ml"}},
                "spec": {"containers": [{"name": "sidecar",
                                         "volumeMounts": [{"name": "w", "mountPath": "/w"}]}],
                         "volumes": [{"name": "w", "emptyDir": {}}]},
            }
        spec[role] = node
    if r.random() < 0.3:
        spec["blockSize"] = r.choice([16, 32, 64, 128, 1024])
    if r.random() < 0.2:
        spec["kvTransfer"] = {"backend": "UCX", "sideChannelPort": r.choice([1024, 5600])}
    if r.random() < 0.2:
        spec["router"] = {"replicas": r.randint(1, 3), "enabled": r.random() < 0.8}
    if r.random() < 0.1:
        spec["rollout"] = {"maxUnavailable": 2}
    if r.random() < 0.1:
        spec["networkPolicy"] = {"enabled": False}
    if r.random() < 0.15 and all(spec[role].get("gpusPerPod", tp) == tp
                                 for role, tp in (("prefill", p_tp), ("decode", d_tp))):
        spec["engine"] = "vllm"
        spec.setdefault("router", {})["image"] = "pdd:0.1.0"
        for role in ROLES:  # the host tier is pdd's sidecars' only
            spec[role].pop("hostKVCacheGiB", None)
    if r.random() < 0.3:
        auto: dict[str, Any] = {}
        if r.random() < 0.7:
            lo = r.randint(1, 4)
            auto["prefill"] = {"minReplicas": lo, "maxReplicas": r.randint(lo, 64),
                               "ttft": {"percentile": r.choice([50, 90, 99.9]),
                                        "seconds": r.choice([0.5, 2, 3600])}}
            if r.random() < 0.5:
                auto["prefill"]["queuedPromptTokensPerReplica"] = r.choice([1, 8192])
            if r.random() < 0.5:
                auto["prefill"]["promptTokensPerSecondPerReplica"] = r.choice([1, 40000])
        if r.random() < 0.7:
            auto["decode"] = {"maxReplicas": r.randint(1, 64),
                              "tpot": {"seconds": r.choice([0.01, 0.05])},
                              "kvCacheUtilization": r.choice([0.05, 0.8, 1])}
            if r.random() < 0.5:
                auto["decode"]["sequencesPerReplica"] = r.choice([1, 192])
        if r.random() < 0.3:
            auto["intervalSeconds"] = r.choice([1, 15, 3600])
            auto["prometheusURL"] = "http://prometheus:9090"
        spec["autoscaling"] = auto
    if r.random() < 0.2:
        spec["tracing"] = {"endpoint": r.choice(["http://jaeger:4317", "https://otel:4318"]),
                           "protocol": r.choice(["grpc", "http/protobuf"]),
                           "samplingRatio": r.choice([0, 0.01, 1])}
    return spec


def mutate(r: random.Random, spec: dict[str, Any]) -> dict[str, Any]:
    op = r.random()
    if op < 0.55:
        leaf = r.choice(LEAVES)
        value = _plausible(r, leaf) if r.random() < 0.55 else copy.deepcopy(r.choice(HOSTILE))
        return _set(spec, leaf.path, value)
    if op < 0.7:
        return _set(spec, r.choice(LEAVES).path, None)
    if op < 0.85:
        _delete(spec, r.choice(LEAVES + [Leaf((k,), "obj") for k in ("model", "image")] * 4).path)
        return spec
    target = r.choice(OBJECTS)
    return _set(spec, (*target, r.choice(["unknownField", "replica", "Image"])),
                copy.deepcopy(r.choice(HOSTILE)))


def generate(seed: int, count: int) -> list[Any]:
    r = random.Random(seed)
    specs: list[Any] = []
    for _ in range(count):
        spec: Any = valid_spec(r)
        for _ in range(r.choice([0, 0, 0, 1, 1, 1, 2, 3])):
            spec = mutate(r, spec)
        if r.random() < 0.01:
            spec = r.choice([None, [], "spec", 4, {}])
        specs.append(spec)
    return specs


HOSTILE_NAMES = ["a" * 47, "a" * 48, "Upper", "a.b", "1abc", "abc-", "a_b", "", "x" * 254, "ü"]


def names(seed: int, count: int) -> list[str]:
    """Mostly valid names; one in twenty hostile (metadata.name has a rule too)."""
    r = random.Random(seed + 1)
    return [r.choice(HOSTILE_NAMES) if r.random() < 0.05 else f"spec-{i}" for i in range(count)]


def document(name: str, spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
            "metadata": {"name": name}, "spec": spec}


# ----------------------------------------------------------------------------- verdicts


def cli_verdicts(docs: list[dict[str, Any]], workdir: Path) -> tuple[list[bool], dict[int, str]]:
    """One `pdd validate` run over a multi-document file, as a user runs it."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text = yaml.dump_all(docs, Dumper=dumper, sort_keys=False, allow_unicode=True)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    assert list(yaml.load_all(text, Loader=loader)) == docs, "YAML does not round-trip the specs"
    path = workdir / "specs.yaml"
    path.write_text(text)
    pdd = Path(sys.executable).with_name("pdd")
    proc = subprocess.run([str(pdd), "validate", "-f", str(path)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    problems: dict[int, str] = {}
    line = re.compile(rf"^{re.escape(str(path))}: document (\d+)(?: \([^)]*\))?: (.*)$")
    summary = f"{path}: {{}} of {len(docs)} document(s) invalid"
    lines = proc.stderr.splitlines()
    for text_line in lines[:-1] if proc.returncode else lines:
        m = line.match(text_line)
        assert m, f"pdd validate wrote an unexpected line (a crash?):\n{proc.stderr[-3000:]}"
        i = int(m.group(1)) - 1
        problems[i] = problems.get(i, "") + m.group(2) + "\n"
    assert (lines[-1] if proc.returncode else "") == (
        summary.format(len(problems)) if problems else ""), proc.stderr[-3000:]
    return [i not in problems for i in range(len(docs))], problems


class ApiServer:
    """Dry-run creates over kept-alive HTTPS connections, one per thread (kubectl would cost a
    process per spec)."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        pki = cluster.state_dir / "pki"
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        url = urlsplit(cluster.server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.path = (f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}"
                     "?dryRun=All&fieldValidation=Strict")
        self.local = threading.local()

    def dry_run(self, doc: dict[str, Any]) -> tuple[bool, Any]:
        body = json.dumps(doc)
        for attempt in range(3):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPSConnection(
                    self.host, self.port, context=self.ctx, timeout=60)
            try:
                conn.request("POST", self.path, body=body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                status, data = resp.status, json.loads(resp.read())
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                continue
            if status == 201:
                return True, data
            if status in (400, 422):
                message = data.get("message", "")
                assert "admission webhook" not in message, message
                return False, message
            if status == 429 or status >= 500:
                time.sleep(0.5)
                continue
            raise AssertionError(f"dry run answered {status}: {data}")
        raise AssertionError(f"dry run failed three times for {doc['metadata']['name']}")


def same_meaning(mine: Any, stored: Any) -> bool:
    """Equal, except for three number encodings: the API server keeps a near-integral float
    (2.000000001) that its schema calls an integer, where pdd reads the integer it stands for;
    it writes any integral float back as an integer (2.0 -> 2; Go's JSON encoding); and it
    holds an integer beyond 64 bits as the nearest float. The last two show only inside the
    free-form overlay, where pdd keeps what was written."""
    if isinstance(mine, dict) and isinstance(stored, dict):
        return mine.keys() == stored.keys() and all(same_meaning(v, stored[k])
                                                    for k, v in mine.items())
    if isinstance(mine, list) and isinstance(stored, list):
        return len(mine) == len(stored) and all(map(same_meaning, mine, stored))
    if isinstance(mine, int) and isinstance(stored, float) and json_integer(stored):
        return mine == round(stored)
    if isinstance(mine, float) and isinstance(stored, int) and not isinstance(stored, bool):
        return mine == stored
    if isinstance(mine, int) and not isinstance(mine, bool) and not INT64_MIN <= mine <= INT64_MAX:
        return isinstance(stored, int | float) and float(mine) == float(stored)
    return type(mine) is type(stored) and mine == stored  # type: ignore[no-any-return]


_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def cel_words(doc: dict[str, Any]) -> list[str]:
    """pdd's problems with a document when each is a CEL rule's too (the spec's value rules, the
    name rule), so the API server must say every one of them word for word; else nothing."""
    spec, name = doc["spec"], doc["metadata"]["name"]
    if not isinstance(spec, dict):
        return []
    words = check_rules(normalize(spec)[0])
    if len(name) <= 253 and _SUBDOMAIN.match(name):  # else the API server's own check answers
        words += validate_name(name)
    problems = validate_document(doc)
    return problems if set(problems) <= set(words) else []


PROBE = {"model": {"name": "m"}, "image": "i", "prefill": {"tensorParallelSize": 4,
                                                           "decodeContextParallelSize": 2},
         "decode": {}}
PROBE_WORDS = "must be 1 or equal to tensorParallelSize (4), got 2"


def crd_generation(cluster: Cluster) -> int:
    return int(cluster.kubectl_json("get", "crd", CRD_NAME)["metadata"]["generation"])


def wait_for_cel(cluster: Cluster, api: ApiServer) -> None:
    """The cluster may be shared: a test of the operator alone serves the CRD without CEL for a
    while and then restores it. Wait for the CEL to answer rather than overwrite that test's
    CRD; apply the committed one only when nobody restores it."""
    deadline = time.monotonic() + 300
    applied = False
    while True:
        ok, message = api.dry_run(document("probe", PROBE))
        if not ok and PROBE_WORDS in message:
            return
        assert time.monotonic() < deadline, f"the CRD's CEL never answered: {message}"
        if not applied and time.monotonic() > deadline - 60:
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
            applied = True
        time.sleep(1)


def _timed(label: str, fn: Callable[[], Any], figures: dict[str, float]) -> Any:
    start = time.monotonic()
    out = fn()
    figures[label] = time.monotonic() - start
    return out


def test_cli_webhook_and_api_server_agree(
    cluster: Cluster, crd: dict[str, Any], namespace: str, tmp_path: Path
) -> None:
    figures: dict[str, float] = {}
    started = time.monotonic()
    specs = generate(SEED, SPECS)
    docs = [document(n, s) for n, s in zip(names(SEED, SPECS), specs, strict=True)]

    cli, cli_problems = _timed("pdd validate", lambda: cli_verdicts(docs, tmp_path), figures)
    hook_problems = _timed("webhook", lambda: [admission_problems(d, None) for d in docs],
                           figures)
    api = ApiServer(cluster, namespace)
    for _attempt in range(3):  # a run during which the CRD changed says nothing
        generation = crd_generation(cluster)
        wait_for_cel(cluster, api)
        with ThreadPoolExecutor(WORKERS) as pool:
            answers = _timed("api server", lambda: list(pool.map(api.dry_run, docs)), figures)
        if crd_generation(cluster) == generation:
            break
    else:
        pytest.fail("the CRD changed during every run (another test installs its own)")

    disagreements = []
    for i, doc in enumerate(docs):
        verdicts = (cli[i], not hook_problems[i], answers[i][0])
        if len(set(verdicts)) > 1:
            said = ["accepts" if v else "refuses" for v in verdicts]
            disagreements.append(
                f"document {i + 1} ({doc['metadata']['name']!r}): pdd validate {said[0]}, "
                f"webhook {said[1]}, API server {said[2]}\n  spec: {json.dumps(doc['spec'])}\n"
                f"  pdd: {cli_problems.get(i, '').strip()}\n"
                f"  api: {answers[i][1] if not answers[i][0] else 'accepted'}")
    # What the webhook really receives is the API server's object (nulls dropped, defaults set,
    # integral floats re-encoded): it must admit every object the schema admitted.
    after = [(f"document {i + 1}", admission_problems(obj, None))
             for i, (ok, obj) in enumerate(answers) if ok]
    refused_after = [f"{n}: {p}" for n, p in after if p]
    # The same meaning, not only the same verdict: where all three accept, the spec pdd parsed
    # (nulls dropped, defaults applied) is the spec the API server stored.
    meaning = []
    for i, (ok, obj) in enumerate(answers):
        if ok and cli[i] and not hook_problems[i]:
            mine = parse_spec(docs[i]["spec"]).model_dump(exclude_none=True)
            if not same_meaning(mine, obj["spec"]):
                meaning.append(f"document {i + 1}:\n  pdd: {json.dumps(mine)}\n"
                               f"  api: {json.dumps(obj['spec'])}")

    # The same words where pdd's only problems are CEL rules' (structural problems are worded
    # by each side in its own way).
    worded = [(i, cel_words(doc)) for i, doc in enumerate(docs) if not answers[i][0]]
    worded = [(i, w) for i, w in worded if w]
    unsaid = [f"document {i + 1}: pdd says {m!r}\n  api: {answers[i][1]}"
              for i, words in worded for m in words if m not in answers[i][1]]

    accepted = sum(ok for ok, _ in answers)
    figures["total"] = time.monotonic() - started
    print(f"\n{SPECS} specs (seed {SEED}): {accepted} accepted, {SPECS - accepted} refused by "
          f"the API server; {len(disagreements)} disagreements; {len(worded)} refused by rules "
          f"alone, {len(unsaid)} messages worded differently; "
          + ", ".join(f"{k} {v:.1f}s" for k, v in figures.items()))
    assert not disagreements, (f"{len(disagreements)} of {SPECS} specs disagree:\n"
                               + "\n".join(disagreements[:15]))
    assert not refused_after, "\n".join(refused_after[:15])
    assert not unsaid, "\n".join(unsaid[:15])
    assert len(worded) > SPECS // 50, "too few specs refused by value rules alone"
    assert not meaning, f"{len(meaning)} specs mean something else:\n" + "\n".join(meaning[:10])
    # The generator must exercise both verdicts in earnest.
    assert 0.2 * SPECS < accepted < 0.8 * SPECS, accepted

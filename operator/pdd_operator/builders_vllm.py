"""Pure builders for `spec.engine: vllm`: the same spec served by `vllm serve` pods.

vLLM's prefill and decode instances are one program (`kv_role` is ignored by NixlConnector;
the proxy decides who prefills), so both roles get the same command line, differing only in
their parallelism. What pdd keeps: the pod names, labels, headless Services, GPUs per TP rank,
/dev/shm, the pod template overlay and the router in front (speaking vLLM's P/D protocol).
What vLLM pods do not get: the routing ConfigMap and the transfer-grant key (vLLM routes
ranks itself and has no grants), and the PodSecurity `runAsNonRoot` default (vLLM's published
images run as root; a template can set it for an image that does not).
"""

from __future__ import annotations

import json
from typing import Any

from pdd_api import keys
from pdd_api.models import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_DTYPE,
    DecodeRoleSpec,
    NgramSpec,
    PDDeploymentSpec,
    RoleSpec,
    SpeculativeSpec,
)
from pdd_api.quantity import plain_number

Obj = dict[str, Any]

VLLM_SERVE = ["vllm", "serve"]
KV_TRANSFER_CONFIG: Obj = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
ENV_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
# The router's upstream protocol (sidecar/pdd_sidecar/env.py reads it).
ENV_ROUTER_UPSTREAM_PROTOCOL = "PDD_ROUTER_UPSTREAM_PROTOCOL"
VLLM_ENV = frozenset({ENV_SIDE_CHANNEL_HOST, ENV_SIDE_CHANNEL_PORT})
HEALTH_PATH = "/health"  # vLLM's OpenAI server: 200 once the engine serves


def model_arg(spec: PDDeploymentSpec) -> str:
    """What `vllm serve` loads: the weights' directory when given, else the Hugging Face id."""
    return spec.model.source or spec.model.name


def speculative_config(spec: SpeculativeSpec) -> str:
    """vLLM's --speculative-config for the decode's drafter (its SpeculativeConfig fields):
    method mtp drafts with the checkpoint's MTP module, ngram with prompt lookup."""
    config: Obj = {"method": spec.method, "num_speculative_tokens": spec.tokens}
    if spec.method == "ngram":
        ngram = spec.ngram or NgramSpec()
        config.update(prompt_lookup_max=ngram.maxN, prompt_lookup_min=ngram.minN)
    return json.dumps(config, separators=(",", ":"))


def serve_args(spec: PDDeploymentSpec, role_spec: RoleSpec) -> list[str]:
    """`vllm serve` arguments for one role. vLLM's NIXL DCP support needs the KV interleaved
    at block granularity when DCP > 1 (pdd's routing contract too), so the interleave size is
    the block size there; with DCP 1 vLLM's default (1) is left alone."""
    tp, dcp = role_spec.tensorParallelSize, role_spec.decodeContextParallelSize
    args = [
        model_arg(spec),
        "--port", str(keys.HTTP_PORT),
        "--tensor-parallel-size", str(tp),
        "--decode-context-parallel-size", str(dcp),
        "--block-size", str(spec.blockSize),
        "--dtype", spec.model.dtype,
        "--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":")),
    ]
    if dcp > 1:
        args += ["--cp-kv-cache-interleave-size", str(spec.blockSize)]
    if spec.model.source:  # clients and the router name the model, not its directory
        args += ["--served-model-name", spec.model.name]
    if not role_spec.prefixCache:  # vLLM caches prefixes unless told not to
        args += ["--no-enable-prefix-caching"]
    # vLLM's default share is pdd's (0.9): written only when another is asked for.
    if role_spec.gpuMemoryUtilization != DEFAULT_GPU_MEMORY_UTILIZATION:
        args += ["--gpu-memory-utilization", plain_number(role_spec.gpuMemoryUtilization)]
    if role_spec.kvCacheBlocks is not None:
        args += ["--num-gpu-blocks-override", str(role_spec.kvCacheBlocks)]
    # vLLM's FP8 MLA cache (FlashMLA's or Triton MLA's) is the same layout as pdd's.
    if role_spec.kvCacheDtype != DEFAULT_KV_CACHE_DTYPE:
        args += ["--kv-cache-dtype", role_spec.kvCacheDtype]
    if isinstance(role_spec, DecodeRoleSpec) and role_spec.speculative is not None:
        args += ["--speculative-config", speculative_config(role_spec.speculative)]
    return args + list(role_spec.extraArgs or [])


def command(spec: PDDeploymentSpec, role_spec: RoleSpec) -> list[str]:
    return [*VLLM_SERVE, *serve_args(spec, role_spec)]


def env(spec: PDDeploymentSpec, role_spec: RoleSpec) -> list[Obj]:
    """The side channel must advertise the pod IP: vLLM's default `localhost` makes the
    decode's handshake reach itself and fail with an engine-id mismatch."""
    out: list[Obj] = [
        {"name": ENV_SIDE_CHANNEL_HOST,
         "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
        {"name": ENV_SIDE_CHANNEL_PORT, "value": str(spec.kvTransfer.sideChannelPort)},
    ]
    out += [e.model_dump(exclude_none=True) for e in (role_spec.env or [])
            if e.name not in VLLM_ENV]
    return out


def probe_target() -> Obj:
    return {"path": HEALTH_PATH, "port": "http", "scheme": "HTTP"}


def render_pod_spec(pod_spec: Obj, spec: PDDeploymentSpec, role_spec: RoleSpec) -> None:
    """Turn the pod spec builders.build_pod made for a sidecar into a vLLM pod (in place,
    before the template overlay): what applies to both is kept as built (the container's name,
    resources, securityContext and pull policy, /dev/shm, scheduling fields), the rest is
    vLLM's. The container keeps the sidecar's name, so the overlay and its owned-field rules
    mean the same for both engines."""
    built = pod_spec["containers"][0]
    shm = [m for m in built.get("volumeMounts", []) if m.get("mountPath") == "/dev/shm"]
    out: Obj = {
        "name": built["name"],
        "image": spec.image,
        "command": command(spec, role_spec),
        "env": env(spec, role_spec),
        "ports": [
            {"name": "http", "containerPort": keys.HTTP_PORT, "protocol": "TCP"},
            {"name": "side-channel", "containerPort": spec.kvTransfer.sideChannelPort,
             "protocol": "TCP"},
        ],
        "resources": built["resources"],
        "volumeMounts": shm,
        "securityContext": built["securityContext"],
        "startupProbe": {**built["startupProbe"], "httpGet": probe_target()},
        "livenessProbe": {**built["livenessProbe"], "httpGet": probe_target()},
        "readinessProbe": {**built["readinessProbe"], "httpGet": probe_target()},
    }
    if "imagePullPolicy" in built:
        out["imagePullPolicy"] = built["imagePullPolicy"]
    pod_spec["containers"][0] = out
    kept = {m["name"] for m in shm}
    pod_spec["volumes"] = [v for v in pod_spec.get("volumes", []) if v["name"] in kept]
    pod_spec["securityContext"] = {k: v for k, v in pod_spec.get("securityContext", {}).items()
                                   if k != "runAsNonRoot"}


def router_env() -> list[Obj]:
    return [{"name": ENV_ROUTER_UPSTREAM_PROTOCOL, "value": "vllm"}]

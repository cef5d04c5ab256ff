"""Spec cases shared by the unit tier (Python rules) and the integration tier (CEL rules)."""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-V2-Lite-Chat"},
    "image": "pdd:0.1.0",
    "prefill": {"tensorParallelSize": 4, "decodeContextParallelSize": 4},
    "decode": {"tensorParallelSize": 4, "decodeContextParallelSize": 1},
}


def with_(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    node = spec
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return spec


def gpu(role: str, kind: str, tp: int, value: Any) -> dict[str, Any]:
    spec = with_(f"{role}.tensorParallelSize", tp)
    spec[role]["decodeContextParallelSize"] = 1
    spec[role]["resources"] = {kind: {"nvidia.com/gpu": value}}
    return spec


def host_tier(role: str, gib: float, memory: Any, tp: int = 4, **more: Any) -> dict[str, Any]:
    """A role with a host KV tier and a memory limit (DCP 1, so any TP is valid)."""
    spec = copy.deepcopy(BASE)
    spec[role] = {"tensorParallelSize": tp, "hostKVCacheGiB": gib,
                  "resources": {"limits": {"memory": memory}}, **more}
    return spec


def autoscaled(**more: Any) -> dict[str, Any]:
    """Both roles autoscaled with valid targets; ``more`` replaces parts of spec.autoscaling
    (a role's dict is merged into that role's, a None there drops the key)."""
    spec = copy.deepcopy(BASE)
    auto: dict[str, Any] = {
        "prefill": {"minReplicas": 1, "maxReplicas": 4,
                    "ttft": {"percentile": 90, "seconds": 2}},
        "decode": {"minReplicas": 1, "maxReplicas": 8, "tpot": {"percentile": 90,
                                                               "seconds": 0.05},
                   "kvCacheUtilization": 0.8},
    }
    for k, v in more.items():
        if k in auto and isinstance(v, dict):
            auto[k] = {f: x for f, x in {**auto[k], **v}.items() if x is not None}
        else:
            auto[k] = v
    spec["autoscaling"] = auto
    return spec


def speculative(value: Any, model: str = "deepseek-ai/DeepSeek-V3") -> dict[str, Any]:
    """spec.decode.speculative set to ``value`` on a model of that name (V3 carries MTP)."""
    spec = with_("decode.speculative", value)
    spec["model"] = {"name": model}
    return spec


MTP_ON_V2_LITE = ("spec.decode.speculative.method: mtp needs a checkpoint with a multi-token-"
                  "prediction module (DeepSeek-V3/R1: num_nextn_predict_layers 1), and "
                  "deepseek-ai/DeepSeek-V2-Lite-Chat has none; use ngram")

# engine vllm: the router runs a pdd image of its own (spec.image is then a vLLM image).
VLLM: dict[str, Any] = {**BASE, "engine": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                        "router": {"image": "pdd:0.1.0"}}
VLLM_ROUTER_IMAGE = ("spec.router.image: required with engine vllm (spec.image is then a vLLM "
                     "image; the router needs a pdd image)")



def vllm_mtp(value: Any, model: str = "deepseek-ai/DeepSeek-V3") -> dict[str, Any]:
    """spec.decode.speculative on engine vllm, which serves mtp."""
    return {**VLLM, "model": {"name": model},
            "decode": {"tensorParallelSize": 4, "speculative": value}}


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("P TP4/DCP2", with_("prefill.decodeContextParallelSize", 2),
     "spec.prefill.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (4), got 2"),
    ("D TP4/DCP2", with_("decode.decodeContextParallelSize", 2),
     "spec.decode.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (4), got 2"),
    ("D TP8/DCP4", {**BASE, "decode": {"tensorParallelSize": 8, "decodeContextParallelSize": 4}},
     "spec.decode.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (8), got 4"),
    ("P DCP0", with_("prefill.decodeContextParallelSize", 0),
     "spec.prefill.decodeContextParallelSize: must be 1 or equal to tensorParallelSize (4), got 0"),
    ("P DCP4 -> D DCP3", {**BASE, "decode": {"tensorParallelSize": 3,
                                            "decodeContextParallelSize": 3}},
     "spec.decode.decodeContextParallelSize: must divide or be a multiple of "
     "spec.prefill.decodeContextParallelSize (4), got 3"),
    ("P DCP6 -> D DCP4", {**BASE, "prefill": {"tensorParallelSize": 6,
                                             "decodeContextParallelSize": 6},
                          "decode": {"tensorParallelSize": 4, "decodeContextParallelSize": 4}},
     "spec.decode.decodeContextParallelSize: must divide or be a multiple of "
     "spec.prefill.decodeContextParallelSize (6), got 4"),
    ("P TP0", with_("prefill.tensorParallelSize", 0),
     "spec.prefill.tensorParallelSize: must be between 1 and 64, got 0"),
    ("D TP65", {**BASE, "decode": {"tensorParallelSize": 65}},
     "spec.decode.tensorParallelSize: must be between 1 and 64, got 65"),
    ("P replicas 0", with_("prefill.replicas", 0),
     "spec.prefill.replicas: must be between 1 and 64, got 0"),
    ("D replicas 100", with_("decode.replicas", 100),
     "spec.decode.replicas: must be between 1 and 64, got 100"),
    ("D replicas -1", with_("decode.replicas", -1),
     "spec.decode.replicas: must be between 1 and 64, got -1"),
    ("blockSize 0", with_("blockSize", 0),
     "spec.blockSize: must be a positive multiple of 16 and at most 1024, got 0"),
    ("blockSize 100", with_("blockSize", 100),
     "spec.blockSize: must be a positive multiple of 16 and at most 1024, got 100"),
    ("blockSize 2048", with_("blockSize", 2048),
     "spec.blockSize: must be a positive multiple of 16 and at most 1024, got 2048"),
    ("blockSize -64", with_("blockSize", -64),
     "spec.blockSize: must be a positive multiple of 16 and at most 1024, got -64"),
    ("blockSize string", with_("blockSize", "64"), "spec.blockSize: must be an integer, got '64'"),
    ("P GPU limit", gpu("prefill", "limits", 4, 2),
     "spec.prefill.resources.limits[nvidia.com/gpu]: must equal tensorParallelSize (4), got 2"),
    ("D GPU limit string", gpu("decode", "limits", 2, "8"),
     "spec.decode.resources.limits[nvidia.com/gpu]: must equal tensorParallelSize (2), got 8"),
    ("D GPU request", gpu("decode", "requests", 4, 1),
     "spec.decode.resources.requests[nvidia.com/gpu]: must equal tensorParallelSize (4), got 1"),
    ("P gpusPerPod 3 of TP4", with_("prefill.gpusPerPod", 3),
     "spec.prefill.gpusPerPod: must divide tensorParallelSize (4), got 3"),
    ("D gpusPerPod 8 of TP4", with_("decode.gpusPerPod", 8),
     "spec.decode.gpusPerPod: must divide tensorParallelSize (4), got 8"),
    ("P gpusPerPod 0", with_("prefill.gpusPerPod", 0),
     "spec.prefill.gpusPerPod: must be between 1 and 64, got 0"),
    ("D gpusPerPod string", with_("decode.gpusPerPod", "2"),
     "spec.decode.gpusPerPod: must be an integer, got '2'"),
    ("P GPU limit vs gpusPerPod", {**gpu("prefill", "limits", 4, 4),
                                   "prefill": {"tensorParallelSize": 4, "gpusPerPod": 2,
                                               "resources": {"limits": {"nvidia.com/gpu": 4}}}},
     "spec.prefill.resources.limits[nvidia.com/gpu]: must equal gpusPerPod (2), got 4"),
    ("D GPU request vs gpusPerPod", {**BASE, "decode": {
        "tensorParallelSize": 16, "gpusPerPod": 8,
        "resources": {"requests": {"nvidia.com/gpu": "16"}}}},
     "spec.decode.resources.requests[nvidia.com/gpu]: must equal gpusPerPod (8), got 16"),
    ("vllm P gpusPerPod", {**VLLM, "prefill": {"tensorParallelSize": 4, "gpusPerPod": 2}},
     "spec.prefill.gpusPerPod: with engine vllm, must equal tensorParallelSize (4), got 2"),
    ("unknown top field", with_("prefil", {}), "spec.prefil: unknown field"),
    ("unknown role field", with_("decode.dcp", 4), "spec.decode.dcp: unknown field"),
    ("unknown nested field", with_("kvTransfer.port", 1), "spec.kvTransfer.port: unknown field"),
    ("unknown model field", with_("model.revision", "main"), "spec.model.revision: unknown field"),
    ("missing image", {k: v for k, v in BASE.items() if k != "image"}, "spec.image: required"),
    ("missing decode", {k: v for k, v in BASE.items() if k != "decode"}, "spec.decode: required"),
    ("missing model name", with_("model", {}), "spec.model.name: required"),
    ("empty image", with_("image", ""), "spec.image: must not be empty"),
    ("empty model name", with_("model.name", ""), "spec.model.name: must not be empty"),
    ("backend", with_("kvTransfer.backend", "TCP"),
     "spec.kvTransfer.backend: must be one of 'UCX', got 'TCP'"),
    ("side channel port", with_("kvTransfer.sideChannelPort", 80),
     "spec.kvTransfer.sideChannelPort: must be between 1024 and 65471, got 80"),
    ("dtype", with_("model.dtype", "fp8"),
     "spec.model.dtype: must be one of 'bfloat16' or 'float32', got 'fp8'"),
    ("pull policy", with_("prefill.imagePullPolicy", "Sometimes"),
     "spec.prefill.imagePullPolicy: must be one of 'Always', 'IfNotPresent' or 'Never', "
     "got 'Sometimes'"),
    ("router replicas", with_("router.replicas", 0),
     "spec.router.replicas: must be between 1 and 16, got 0"),
    ("router workers", with_("router.workers", 65),
     "spec.router.workers: must be between 1 and 64, got 65"),
    ("router local prefill negative", with_("router.localPrefillTokens", -1),
     "spec.router.localPrefillTokens: must be between 0 and 1048576, got -1"),
    ("router local prefill huge", with_("router.localPrefillTokens", 1048577),
     "spec.router.localPrefillTokens: must be between 0 and 1048576, got 1048577"),
    ("maxUnavailable", with_("rollout.maxUnavailable", 0),
     "spec.rollout.maxUnavailable: must be between 1 and 64, got 0"),
    ("tp bool", with_("prefill.tensorParallelSize", True),
     "spec.prefill.tensorParallelSize: must be an integer, got True"),
    ("toleration key type", with_("decode.tolerations", [{"key": 1}]),
     "spec.decode.tolerations[0].key: must be a string, got 1"),
    ("extraArgs type", with_("decode.extraArgs", "--foo"),
     "spec.decode.extraArgs: must be a list, got '--foo'"),
    ("nodeSelector value", with_("prefill.nodeSelector", {"gpu": 1}),
     "spec.prefill.nodeSelector.gpu: must be a string, got 1"),
    ("engine", with_("engine", "sglang"),
     "spec.engine: must be one of 'pdd' or 'vllm', got 'sglang'"),
    ("vllm P TP2 -> D TP3", {**VLLM, "prefill": {"tensorParallelSize": 2},
                             "decode": {"tensorParallelSize": 3}},
     "spec.decode.tensorParallelSize: with engine vllm, must divide or be a multiple of "
     "spec.prefill.tensorParallelSize (2), got 3"),
    ("vllm P TP6/DCP6 -> D TP4/DCP1", {**VLLM, "prefill": {"tensorParallelSize": 6,
                                                           "decodeContextParallelSize": 6},
                                       "decode": {"tensorParallelSize": 4}},
     "spec.decode.tensorParallelSize: with engine vllm, must divide or be a multiple of "
     "spec.prefill.tensorParallelSize (6), got 4"),
    ("router policy", with_("router.policy", "random"),
     "spec.router.policy: must be one of 'cache-aware', 'least-loaded' or 'round-robin', "
     "got 'random'"),
    ("router noPrefill", with_("router.noPrefill", "wait"),
     "spec.router.noPrefill: must be one of 'fallback' or 'refuse', got 'wait'"),
    ("prefixCache type", with_("prefill.prefixCache", "yes"),
     "spec.prefill.prefixCache: must be a boolean, got 'yes'"),
    ("D gpuMemoryUtilization 1.5", with_("decode.gpuMemoryUtilization", 1.5),
     "spec.decode.gpuMemoryUtilization: must be in (0, 1], got 1.5"),
    ("P gpuMemoryUtilization 0", with_("prefill.gpuMemoryUtilization", 0),
     "spec.prefill.gpuMemoryUtilization: must be in (0, 1], got 0"),
    ("D gpuMemoryUtilization -0.25", with_("decode.gpuMemoryUtilization", -0.25),
     "spec.decode.gpuMemoryUtilization: must be in (0, 1], got -0.25"),
    ("P gpuMemoryUtilization 90", with_("prefill.gpuMemoryUtilization", 90),
     "spec.prefill.gpuMemoryUtilization: must be in (0, 1], got 90"),
    ("D gpuMemoryUtilization string", with_("decode.gpuMemoryUtilization", "0.9"),
     "spec.decode.gpuMemoryUtilization: must be a number, got '0.9'"),
    ("P hostKVCacheGiB -1", with_("prefill.hostKVCacheGiB", -1),
     "spec.prefill.hostKVCacheGiB: must be between 0 and 4096, got -1"),
    ("D hostKVCacheGiB in bytes", with_("decode.hostKVCacheGiB", 17179869184),
     "spec.decode.hostKVCacheGiB: must be between 0 and 4096, got 1.7179869184e+10"),
    ("P hostKVCacheGiB bool", with_("prefill.hostKVCacheGiB", True),
     "spec.prefill.hostKVCacheGiB: must be a number, got True"),
    ("D drainSeconds 0", with_("decode.drainSeconds", 0),
     "spec.decode.drainSeconds: must be between 1 and 3600, got 0"),
    ("P drainSeconds 1h+1", with_("prefill.drainSeconds", 3601),
     "spec.prefill.drainSeconds: must be between 1 and 3600, got 3601"),
    ("P kvCacheBlocks 0", with_("prefill.kvCacheBlocks", 0),
     "spec.prefill.kvCacheBlocks: must be between 1 and 16777216, got 0"),
    ("D kvCacheBlocks 2^24+1", with_("decode.kvCacheBlocks", 2**24 + 1),
     "spec.decode.kvCacheBlocks: must be between 1 and 16777216, got 16777217"),
    ("D kvCacheBlocks fraction", with_("decode.kvCacheBlocks", 1.5),
     "spec.decode.kvCacheBlocks: must be an integer, got 1.5"),
    ("D host tier over the memory limit", host_tier("decode", 8, "16Gi"),
     "spec.decode.resources.limits.memory: 16Gi is less than the host KV cache needs "
     "(hostKVCacheGiB 8 × 4 ranks per pod = 32Gi)"),
    ("P host tier over the memory limit per pod",
     host_tier("prefill", 8, "15Gi", gpusPerPod=2),
     "spec.prefill.resources.limits.memory: 15Gi is less than the host KV cache needs "
     "(hostKVCacheGiB 8 × 2 ranks per pod = 16Gi)"),
    ("D host tier over a limit in bytes", host_tier("decode", 0.5, 536870911, tp=1),
     "spec.decode.resources.limits.memory: 536870911 is less than the host KV cache needs "
     "(hostKVCacheGiB 0.5 × 1 rank per pod = 0.5Gi)"),
    ("P host tier over a decimal limit", host_tier("prefill", 1.5, "6G"),
     "spec.prefill.resources.limits.memory: 6G is less than the host KV cache needs "
     "(hostKVCacheGiB 1.5 × 4 ranks per pod = 6Gi)"),
    ("vllm host tier", {**VLLM, "decode": {"tensorParallelSize": 4, "hostKVCacheGiB": 8}},
     "spec.decode.hostKVCacheGiB: with engine vllm, must be 0 (the host KV cache tier is "
     "served by pdd sidecars only), got 8"),
    ("vllm router image missing", {**VLLM, "router": {}}, VLLM_ROUTER_IMAGE),
    ("vllm router image empty", {**VLLM, "router": {"image": "", "enabled": True}},
     VLLM_ROUTER_IMAGE),
    # FP8 KV (issue 45): one dtype on both sides of the hand-off, a misspelt one said once.
    ("P fp8 KV, D auto", with_("prefill.kvCacheDtype", "fp8"),
     "spec.decode.kvCacheDtype: must equal spec.prefill.kvCacheDtype (fp8), got auto"),
    ("P auto KV, D fp8", with_("decode.kvCacheDtype", "fp8"),
     "spec.decode.kvCacheDtype: must equal spec.prefill.kvCacheDtype (auto), got fp8"),
    ("vllm P fp8 KV, D auto", {**VLLM, "prefill": {"tensorParallelSize": 4,
                                                   "kvCacheDtype": "fp8"},
                               "decode": {"tensorParallelSize": 4, "kvCacheDtype": "auto"}},
     "spec.decode.kvCacheDtype: must equal spec.prefill.kvCacheDtype (fp8), got auto"),
    ("D KV dtype fp16", {**BASE, "prefill": {"tensorParallelSize": 4, "kvCacheDtype": "fp8"},
                         "decode": {"tensorParallelSize": 4, "kvCacheDtype": "fp16"}},
     "spec.decode.kvCacheDtype: must be one of 'auto' or 'fp8', got 'fp16'"),
    ("P KV dtype type", with_("prefill.kvCacheDtype", 8),
     "spec.prefill.kvCacheDtype: must be one of 'auto' or 'fp8', got 8"),
    # Speculative decoding (issue 47): mtp only where the checkpoint has the module, k bounded,
    # n-gram lengths ordered and only for ngram, on the decode role only.
    ("D mtp on V2-Lite", with_("decode.speculative", {"method": "mtp"}), MTP_ON_V2_LITE),
    ("D mtp on a copy of V2", speculative({"method": "mtp", "tokens": 2},
                                          "my-org/DeepSeek-V2"),
     "spec.decode.speculative.method: mtp needs a checkpoint with a multi-token-prediction "
     "module (DeepSeek-V3/R1: num_nextn_predict_layers 1), and my-org/DeepSeek-V2 has none; "
     "use ngram"),
    ("vllm D mtp on V2-Lite", {**VLLM, "decode": {"tensorParallelSize": 4,
                                                  "speculative": {"method": "mtp"}}},
     MTP_ON_V2_LITE),
    ("D speculative tokens 0", speculative({"method": "ngram", "tokens": 0}),
     "spec.decode.speculative.tokens: must be between 1 and 8, got 0"),
    ("D speculative tokens 9", speculative({"method": "ngram", "tokens": 9}),
     "spec.decode.speculative.tokens: must be between 1 and 8, got 9"),
    ("D speculative method", speculative({"method": "eagle"}),
     "spec.decode.speculative.method: must be one of 'mtp' or 'ngram', got 'eagle'"),
    ("D speculative method with n-gram lengths", speculative({"method": "eagle",
                                                              "ngram": {"maxN": 3}}),
     "spec.decode.speculative.method: must be one of 'mtp' or 'ngram', got 'eagle'"),
    ("D speculative without a method", speculative({"tokens": 2}),
     "spec.decode.speculative.method: required"),
    ("D ngram minN above maxN", speculative({"method": "ngram", "ngram": {"maxN": 2,
                                                                          "minN": 3}}),
     "spec.decode.speculative.ngram.minN: must not exceed maxN (2), got 3"),
    ("D ngram minN above the default maxN", speculative({"method": "ngram",
                                                         "ngram": {"minN": 5}}),
     "spec.decode.speculative.ngram.minN: must not exceed maxN (4), got 5"),
    ("D ngram maxN 17", speculative({"method": "ngram", "ngram": {"maxN": 17}}),
     "spec.decode.speculative.ngram.maxN: must be between 1 and 16, got 17"),
    ("D ngram minN 0", speculative({"method": "ngram", "ngram": {"minN": 0}}),
     "spec.decode.speculative.ngram.minN: must be between 1 and 16, got 0"),
    ("D ngram lengths with mtp", vllm_mtp({"method": "mtp", "ngram": {"maxN": 3}}),
     "spec.decode.speculative.ngram: only with method ngram, got method mtp"),
    ("P speculative", with_("prefill.speculative", {"method": "ngram"}),
     "spec.prefill.speculative: unknown field"),
    # Autoscaling (issue 40): bounds that never reach zero, ordered; targets that make sense.
    ("P autoscaling min above max", autoscaled(prefill={"minReplicas": 5}),
     "spec.autoscaling.prefill.minReplicas: must not exceed maxReplicas (4), got 5"),
    ("D autoscaling min 0", autoscaled(decode={"minReplicas": 0}),
     "spec.autoscaling.decode.minReplicas: must be between 1 and 64, got 0"),
    ("D autoscaling max 65", autoscaled(decode={"maxReplicas": 65}),
     "spec.autoscaling.decode.maxReplicas: must be between 1 and 64, got 65"),
    ("P autoscaling percentile 100", autoscaled(prefill={"ttft": {"percentile": 100,
                                                                  "seconds": 1}}),
     "spec.autoscaling.prefill.ttft.percentile: must be in (0, 100), got 100"),
    ("D autoscaling percentile 0", autoscaled(decode={"tpot": {"percentile": 0,
                                                               "seconds": 0.05}}),
     "spec.autoscaling.decode.tpot.percentile: must be in (0, 100), got 0"),
    ("P autoscaling ttft 0 s", autoscaled(prefill={"ttft": {"seconds": 0}}),
     "spec.autoscaling.prefill.ttft.seconds: must be in (0, 3600], got 0"),
    ("D autoscaling tpot negative", autoscaled(decode={"tpot": {"seconds": -0.05}}),
     "spec.autoscaling.decode.tpot.seconds: must be in (0, 3600], got -0.05"),
    ("D autoscaling KV 1.5", autoscaled(decode={"kvCacheUtilization": 1.5}),
     "spec.autoscaling.decode.kvCacheUtilization: must be in (0, 1], got 1.5"),
    ("D autoscaling KV 0", autoscaled(decode={"kvCacheUtilization": 0}),
     "spec.autoscaling.decode.kvCacheUtilization: must be in (0, 1], got 0"),
    ("P autoscaling queued tokens 0", autoscaled(prefill={"queuedPromptTokensPerReplica": 0}),
     "spec.autoscaling.prefill.queuedPromptTokensPerReplica: must be between 1 and "
     "1073741824, got 0"),
    ("P autoscaling without a target", autoscaled(prefill={"minReplicas": 1,
                                                           "maxReplicas": 2, "ttft": None}),
     "spec.autoscaling.prefill: needs a target, ttft, queuedPromptTokensPerReplica or "
     "promptTokensPerSecondPerReplica, when enabled"),
    ("P autoscaling prompt tokens/s 0",
     autoscaled(prefill={"promptTokensPerSecondPerReplica": 0}),
     "spec.autoscaling.prefill.promptTokensPerSecondPerReplica: must be between 1 and "
     "1073741824, got 0"),
    ("D autoscaling sequences 0", autoscaled(decode={"sequencesPerReplica": 0}),
     "spec.autoscaling.decode.sequencesPerReplica: must be between 1 and 1073741824, got 0"),
    ("autoscaling interval 0", autoscaled(intervalSeconds=0),
     "spec.autoscaling.intervalSeconds: must be between 1 and 3600, got 0"),
    ("autoscaling window negative", autoscaled(scaleDownStabilizationSeconds=-1),
     "spec.autoscaling.scaleDownStabilizationSeconds: must be between 0 and 86400, got -1"),
    ("autoscaling Prometheus URL", autoscaled(prometheusURL="prometheus:9090"),
     "spec.autoscaling.prometheusURL: must start with http:// or https://, got "
     "prometheus:9090"),
    # Traces (issue 46): an OTLP receiver's URL, a known transport, a ratio.
    ("tracing endpoint without scheme", with_("tracing", {"endpoint": "jaeger:4317"}),
     "spec.tracing.endpoint: must start with http:// or https://, got jaeger:4317"),
    ("tracing endpoint empty", with_("tracing", {"endpoint": ""}),
     "spec.tracing.endpoint: must start with http:// or https://, got"),
    ("tracing endpoint missing", with_("tracing", {"samplingRatio": 0.5}),
     "spec.tracing.endpoint: required"),
    ("tracing protocol", with_("tracing", {"endpoint": "http://j:4318", "protocol": "http/json"}),
     "spec.tracing.protocol: must be one of 'http/protobuf' or 'grpc', got 'http/json'"),
    ("tracing ratio 1.5", with_("tracing", {"endpoint": "http://j:4318", "samplingRatio": 1.5}),
     "spec.tracing.samplingRatio: must be between 0 and 1, got 1.5"),
    ("tracing ratio negative", with_("tracing", {"endpoint": "http://j:4318",
                                                 "samplingRatio": -0.01}),
     "spec.tracing.samplingRatio: must be between 0 and 1, got -0.01"),
    ("tracing ratio in percent", with_("tracing", {"endpoint": "http://j:4318",
                                                   "samplingRatio": 100}),
     "spec.tracing.samplingRatio: must be between 0 and 1, got 100"),
    ("tracing ratio string", with_("tracing", {"endpoint": "http://j:4318",
                                               "samplingRatio": "1%"}),
     "spec.tracing.samplingRatio: must be a number, got '1%'"),
]


VALID_EDGES = [
    # mtp with engine pdd (served since issue 47), on V3 and on a name the validators do not
    # know (only its checkpoint's config can say; the sidecar refuses one without the module)
    speculative({"method": "mtp"}),
    speculative({"method": "mtp", "tokens": 2}, "my-org/DeepSeek-V2-Lite-Chat-mtp"),
    with_("blockSize", 16),
    with_("blockSize", 1024),
    with_("prefill.replicas", 64),
    {**BASE, "prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}},
    {**BASE, "prefill": {"tensorParallelSize": 64, "decodeContextParallelSize": 64},
     "decode": {"tensorParallelSize": 16, "decodeContextParallelSize": 16}},
    {**BASE, "prefill": {"tensorParallelSize": 2, "decodeContextParallelSize": 2},
     "decode": {"tensorParallelSize": 8, "decodeContextParallelSize": 8}},
    gpu("prefill", "limits", 4, 4),
    gpu("decode", "limits", 2, "2"),
    with_("prefill.resources", {"limits": {"cpu": "4", "memory": "16Gi"}}),
    with_("decode.affinity", {"nodeAffinity": {"anything": ["goes"]}}),
    with_("decode.env", [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]),
    with_("router.enabled", False),
    with_("router.policy", "round-robin"),
    with_("router.localPrefillTokens", 0),
    with_("router.localPrefillTokens", 4096),
    with_("router.noPrefill", "refuse"),
    with_("decode.prefixCache", False),
    {**VLLM, "prefill": {"tensorParallelSize": 4, "prefixCache": False}},
    with_("kvTransfer.sideChannelPort", 1024),
    # pdd's own sidecars serve TP sizes that do not divide; vLLM's NIXL routing does not.
    {**BASE, "prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 3}},
    with_("engine", "pdd"),
    VLLM,
    {**VLLM, "prefill": {"tensorParallelSize": 4, "decodeContextParallelSize": 4},
     "decode": {"tensorParallelSize": 2, "decodeContextParallelSize": 2}},
    {**VLLM, "prefill": {"tensorParallelSize": 2, "decodeContextParallelSize": 2},
     "decode": {"tensorParallelSize": 8, "decodeContextParallelSize": 1}},
    {**VLLM, "router": {"enabled": False}},
    # KV memory: the GPU's share in (0, 1], a fixed pool, a host tier the limit holds.
    with_("decode.gpuMemoryUtilization", 1),
    with_("prefill.gpuMemoryUtilization", 0.05),
    with_("prefill.kvCacheBlocks", 1),
    with_("decode.kvCacheBlocks", 2**24),
    with_("decode.hostKVCacheGiB", 4096),
    with_("prefill.hostKVCacheGiB", 0),
    host_tier("decode", 8, "32Gi"),
    host_tier("decode", 8, 34359738368),
    host_tier("prefill", 8, "16Gi", gpusPerPod=2),
    host_tier("prefill", 1.5, "6442450944"),
    host_tier("decode", 0.25, "1Gi", tp=1),
    {**VLLM, "prefill": {"tensorParallelSize": 4, "gpuMemoryUtilization": 0.8,
                         "kvCacheBlocks": 4096, "hostKVCacheGiB": 0}},
    # FP8 KV on both roles, or auto written on one side and left to the default on the other.
    {**BASE, "prefill": {"tensorParallelSize": 4, "decodeContextParallelSize": 4,
                         "kvCacheDtype": "fp8"},
     "decode": {"tensorParallelSize": 4, "kvCacheDtype": "fp8"}},
    with_("decode.kvCacheDtype", "auto"),
    {**VLLM, "prefill": {"tensorParallelSize": 4, "kvCacheDtype": "fp8"},
     "decode": {"tensorParallelSize": 2, "kvCacheDtype": "fp8"}},
    # Speculative decoding: mtp on checkpoints with the module (or names the validators do not
    # know: the sidecar checks the checkpoint), ngram on any model, k and n-gram lengths at
    # their bounds.
    vllm_mtp({"method": "mtp"}),
    vllm_mtp({"method": "mtp", "tokens": 8}, "deepseek-ai/DeepSeek-R1-0528"),
    vllm_mtp({"method": "mtp", "tokens": 2}, "my-org/DeepSeek-V2-Lite-Chat-mtp"),
    with_("decode.speculative", {"method": "ngram"}),
    with_("decode.speculative", {"method": "ngram", "tokens": 3,
                                 "ngram": {"maxN": 16, "minN": 16}}),
    speculative({"method": "ngram", "ngram": {"maxN": 1}}),
    {**VLLM, "decode": {"tensorParallelSize": 4, "speculative": {
        "method": "ngram", "tokens": 2, "ngram": {"maxN": 5, "minN": 2}}}},
    # Multi-node instances (LeaderWorkerSet groups): the GPU count is per pod.
    {**BASE, "prefill": {"tensorParallelSize": 4, "decodeContextParallelSize": 4,
                         "gpusPerPod": 2},
     "decode": {"tensorParallelSize": 16, "decodeContextParallelSize": 16, "gpusPerPod": 8,
                "resources": {"limits": {"nvidia.com/gpu": 8}, "requests": {
                    "nvidia.com/gpu": "8"}}}},
    with_("prefill.gpusPerPod", 4),
    with_("decode.gpusPerPod", 1),
    {**VLLM, "prefill": {"tensorParallelSize": 4, "gpusPerPod": 4}},
    autoscaled(),
    autoscaled(prefill={"minReplicas": 4}, decode={"minReplicas": 64, "maxReplicas": 64,
                                                    "kvCacheUtilization": 1}),
    autoscaled(prefill={"enabled": False, "ttft": None}),
    autoscaled(prefill={"ttft": None, "promptTokensPerSecondPerReplica": 40000},
               decode={"sequencesPerReplica": 192}),
    autoscaled(prefill={"ttft": None, "queuedPromptTokensPerReplica": 1},
               decode={"tpot": {"percentile": 99.9, "seconds": 3600}},
               intervalSeconds=1, scaleDownStabilizationSeconds=0,
               prometheusURL="https://prometheus.monitoring:9090"),
    {**BASE, "autoscaling": {"decode": {"maxReplicas": 2}}},
    with_("tracing", {"endpoint": "http://otel-collector.monitoring:4318"}),
    with_("tracing", {"endpoint": "https://tempo:4317", "protocol": "grpc", "samplingRatio": 0}),
    with_("tracing", {"endpoint": "http://jaeger:4317", "protocol": "grpc", "samplingRatio": 1}),
    with_("tracing", {"endpoint": "http://jaeger:4318", "samplingRatio": 0.01}),
]

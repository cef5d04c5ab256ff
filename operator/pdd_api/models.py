"""PDDeployment spec and status (contract: docs/architecture.md "The custom resource").

Field names are the CRD's (camelCase) so one model drives validation, the CRD schema and the
operator's builders. Structural checks (types, unknown fields, required fields) live here; value
rules with their designed messages live in rules.py, shared with the CRD's CEL.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

API_GROUP = "serving.pdd.dev"
API_VERSION = "v1alpha1"
KIND = "PDDeployment"
PLURAL = "pddeployments"
SHORT_NAME = "pdd"
# One role's replicas behind a scale subresource of its own (a CRD has one, PDDeployment's is
# decode's): what an HPA or KEDA targets to drive prefill, or decode by name.
ROLE_SCALE_KIND = "PDDRoleScale"
ROLE_SCALE_PLURAL = "pddrolescales"
ROLE_SCALE_SHORT_NAME = "pddrs"
GPU_RESOURCE = "nvidia.com/gpu"

# How the router picks replicas (sidecar serve/router/routing_policy.py); the first is the default.
RouterPolicy = Literal["cache-aware", "least-loaded", "round-robin"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
DEFAULT_ROUTER_POLICY: RouterPolicy = "cache-aware"  # first of ROUTER_POLICIES
# What the KV cache keeps a token's MLA latent in (docs/fp8-kv.md): auto, the model's dtype
# (1,152 bytes a token of a layer in bf16 for kv_lora_rank 512 + RoPE 64), or fp8, FlashMLA's
# layout (512 e4m3 values, an fp32 scale per 128, the RoPE part in bf16: 656 bytes). The sidecar's
# KV code (kv/fp8_layout.py) and its env reader take the values from here; the first is the
# default.
KvCacheDtype = Literal["auto", "fp8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
DEFAULT_KV_CACHE_DTYPE: KvCacheDtype = "auto"  # first of KV_CACHE_DTYPES
# Speculative decoding on the decode role (docs/operator.md, "Speculative decoding"): mtp drafts
# with the checkpoint's own multi-token-prediction module (DeepSeek-V3/R1), ngram with prompt
# lookup (any model).
SpeculativeMethod = Literal["mtp", "ngram"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
DEFAULT_SPECULATIVE_TOKENS = 1
# The n-gram drafter's defaults (sidecar engine/speculative/ngram.py NgramConfig).
DEFAULT_NGRAM_MAX_N = 4
DEFAULT_NGRAM_MIN_N = 1
# Where the router prefills a request (sidecar serve/router/prefill_path.py): on the decode when
# the prompt's part the decode does not cache is at most this many tokens (0: always through a
# prefill while one is ready). A conservative default until the crossing point of the two paths
# is measured on a GPU.
DEFAULT_LOCAL_PREFILL_TOKENS = 256
MAX_LOCAL_PREFILL_TOKENS = 1 << 20
# What a request meets when no prefill replica is ready: served on a decode (counted and shown
# as the fallback) or refused with a 503.
NoPrefillMode = Literal["fallback", "refuse"]
NO_PREFILL_MODES: tuple[str, ...] = get_args(NoPrefillMode)
DEFAULT_NO_PREFILL: NoPrefillMode = "fallback"
# The share of a GPU's memory an instance fills unless told otherwise (vLLM's default too);
# keys.py re-exports it for the sidecars.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_DRAIN_SECONDS = 120  # streams of a few thousand tokens end within it
MAX_DRAIN_SECONDS = 3600

# CRD-only schema hints carried on fields (see crd.py).
PRESERVE_UNKNOWN: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}


class _Strict(BaseModel):
    """Unknown fields are errors and nothing is coerced: what the API server would accept."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSpec(_Strict):
    name: str = Field(
        description="Model served by the sidecars, a Hugging Face id such as "
        "deepseek-ai/DeepSeek-V2-Lite-Chat. Used for the compatibility handshake."
    )
    source: str | None = Field(
        default=None,
        description="Where the sidecars load weights from: a directory inside the container "
        "(a Hugging Face format DeepSeek-V2 checkpoint). Absent: the built-in tiny model.",
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        default="bfloat16", description="Compute and KV-cache dtype of both roles."
    )


class KVTransferSpec(_Strict):
    backend: Literal["UCX"] = Field(
        default="UCX", description="NIXL backend that moves KV blocks from prefill to decode."
    )
    sideChannelPort: int = Field(
        default=5600,
        description="Base port of the per-rank side channel (HTTP): rank r listens on "
        "sideChannelPort + r and publishes its NIXL agent metadata there.",
    )


class ResourceRequirements(_Strict):
    limits: dict[str, int | str] | None = Field(
        default=None,
        description="Resource limits of the sidecar container (Kubernetes quantities). "
        "nvidia.com/gpu, when set, must equal gpusPerPod (tensorParallelSize when that is "
        "absent)."
    )
    requests: dict[str, int | str] | None = Field(
        default=None,
        description="Resource requests of the sidecar container (Kubernetes quantities). "
        "nvidia.com/gpu, when set, must equal gpusPerPod (tensorParallelSize when that is "
        "absent)."
    )


class Toleration(_Strict):
    key: str | None = Field(default=None, description="Taint key the toleration applies to.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (default Equal)."
    )
    value: str | None = Field(default=None, description="Taint value to match with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all."
    )
    tolerationSeconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


class EnvVar(_Strict):
    name: str = Field(description="Environment variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    valueFrom: dict[str, Any] | None = Field(
        default=None,
        description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...).",
        json_schema_extra=PRESERVE_UNKNOWN,
    )


# Fields of a pod and of its main container that the operator sets and a template may not
# override (a CEL rule and rules.py refuse them with a message); declared in the otherwise
# free-form overlay schema so CEL can see them.
OWNED_POD_FIELDS = ("hostname", "subdomain", "restartPolicy")
OWNED_CONTAINER_FIELDS = ("image", "command", "ports")
OWNED_LABEL_PREFIXES = ("app.kubernetes.io/", f"{API_GROUP}/")
MAX_TEMPLATE_CONTAINERS = 16
POD_SPEC_OVERLAY: JsonDict = {
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        **{f: {"type": "string"} for f in OWNED_POD_FIELDS},
        "containers": {
            "type": "array",
            "maxItems": MAX_TEMPLATE_CONTAINERS,
            "items": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "maxLength": 63},
                    "image": {"type": "string"},
                    "command": {"type": "array", "items": {"type": "string"}},
                    "ports": {"type": "array", "items": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                },
            },
        },
    },
}
_BOUNDED_MAP: JsonDict = {"maxProperties": 64}


class TemplateMetadata(_Strict):
    labels: dict[str, str] | None = Field(
        default=None, description="Extra pod labels (app.kubernetes.io/* and "
        "serving.pdd.dev/* are the operator's).", json_schema_extra=_BOUNDED_MAP)
    annotations: dict[str, str] | None = Field(
        default=None, description="Extra pod annotations (serving.pdd.dev/* are the "
        "operator's).", json_schema_extra=_BOUNDED_MAP)


class PodTemplate(_Strict):
    metadata: TemplateMetadata | None = Field(
        default=None, description="Labels and annotations added to the pods.")
    spec: dict[str, Any] | None = Field(
        default=None,
        description="A PodSpec overlay merged over the pod the operator builds: lists are "
        "appended (volumes, imagePullSecrets, tolerations, initContainers, ...), objects "
        "merged key by key (securityContext, ...), other values replace. A container named "
        "like the operator's (`sidecar`, `router`) is merged into it the same way (add "
        "volumeMounts, env, securityContext); any other container is added. hostname, "
        "subdomain, restartPolicy and the main container's image, command and ports are the "
        "operator's.",
        json_schema_extra=POD_SPEC_OVERLAY,
    )


class RoleSpec(_Strict):
    replicas: int = Field(default=1, description="Instances of this role; each is one Pod "
                          "(one LeaderWorkerSet group with gpusPerPod).")
    tensorParallelSize: int = Field(
        default=1, description="TP ranks per instance (one process and one GPU per rank)."
    )
    decodeContextParallelSize: int = Field(
        default=1,
        description="DCP size: 1 keeps the latent KV replicated on every rank, "
        "tensorParallelSize shards it by block across the ranks.",
    )
    gpusPerPod: int | None = Field(
        default=None,
        description="GPUs (and TP ranks) of one pod. Absent: tensorParallelSize, one pod per "
        "instance. Smaller (a divisor of tensorParallelSize): each instance is a "
        "LeaderWorkerSet group of tensorParallelSize / gpusPerPod pods, pod k holding ranks "
        "k*gpusPerPod .. (k+1)*gpusPerPod-1 (docs/lws.md); the cluster needs the "
        "LeaderWorkerSet controller.",
    )
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Container resources. Without an nvidia.com/gpu entry the operator asks "
        "for gpusPerPod GPUs per pod (tensorParallelSize when gpusPerPod is absent).",
    )
    nodeSelector: dict[str, str] | None = Field(
        default=None, description="Node labels the role's pods must match."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, description="Taints the role's pods tolerate (GPU nodes often have some)."
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="A Kubernetes Affinity object for the role's pods.",
        json_schema_extra=PRESERVE_UNKNOWN,
    )
    env: list[EnvVar] | None = Field(
        default=None, description="Extra environment for the sidecar (contract PDD_* win)."
    )
    extraArgs: list[str] | None = Field(
        default=None, description="Extra command-line arguments appended to the sidecar's."
    )
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Pull policy of the sidecar image."
    )
    priorityClassName: str | None = Field(
        default=None, description="PriorityClass of the role's pods."
    )
    prefixCache: bool = Field(
        default=True,
        description="Keep the KV blocks of each prompt for later prompts that begin the same "
        "way, so their shared prefix is not computed again (PDD_PREFIX_CACHE; with engine "
        "vllm, false adds --no-enable-prefix-caching).",
    )
    gpuMemoryUtilization: float = Field(
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        description="Share of each GPU's memory an instance may fill, in (0, 1]: weights, "
        "activations, CUDA graphs and the KV cache. The KV pool gets what is left once the "
        "weights are loaded and warm-up has run, the same number of blocks on every rank (the "
        "smallest any rank has room for). Lower it when something else uses the GPUs "
        "(PDD_GPU_MEMORY_UTILIZATION; with engine vllm, --gpu-memory-utilization). "
        "kvCacheBlocks, when set, wins.",
    )
    kvCacheBlocks: int | None = Field(
        default=None,
        description="KV cache blocks per rank (blockSize tokens each), a fixed pool instead "
        "of one sized from gpuMemoryUtilization (PDD_NUM_BLOCKS; with engine vllm, "
        "--num-gpu-blocks-override). Absent: sized from memory.",
    )
    kvCacheDtype: KvCacheDtype = Field(
        default=DEFAULT_KV_CACHE_DTYPE,
        description="What the KV cache keeps each token's latent in: auto, the model's dtype, "
        "or fp8, FlashMLA's FP8 layout (656 bytes a token of a layer against 1,152 in bf16: "
        "1.76x the tokens in the same pool and fewer bytes per decode read and per hand-off; "
        "docs/fp8-kv.md). Prefill and decode must agree: the hand-off moves the bytes as they "
        "are (PDD_KV_CACHE_DTYPE; with engine vllm, --kv-cache-dtype fp8).",
    )
    hostKVCacheGiB: float = Field(
        default=0.0,
        description="GiB of pinned host memory per rank under the prefix cache: blocks "
        "evicted from the GPU are kept there, and a prompt that starts like an earlier one "
        "loads them back instead of computing them again (PDD_HOST_KV_CACHE_GIB). 0: no host "
        "tier. Counts against the pod's memory: the operator adds hostKVCacheGiB x ranks per "
        "pod to the sidecar's memory request and limit (a request of just that when "
        "resources give no memory); a memory limit below that amount alone is refused. Not "
        "with engine vllm.",
    )
    drainSeconds: int = Field(
        default=DEFAULT_DRAIN_SECONDS,
        description="How long a pod of this role the operator removes (a scale-down, a "
        "replacement) may finish its work first: it takes no new requests, its running "
        "streams end and the KV it holds for a decode is read or released, then it exits "
        "(at once when idle; stopped at this bound otherwise). Becomes the deletion's grace "
        "period (docs/operator.md, Scaling down).",
    )
    template: PodTemplate | None = Field(
        default=None,
        description="Pod template overlay: labels, annotations and PodSpec fields (volumes, "
        "volumeMounts, imagePullSecrets, serviceAccountName, ...) merged over the pods the "
        "operator builds. The fields above stay as shorthands.",
    )


class NgramSpec(_Strict):
    maxN: int = Field(
        default=DEFAULT_NGRAM_MAX_N,
        description="Longest ending of the text (prompt and output so far), in tokens, looked "
        "up in what came before; the tokens that followed its latest earlier occurrence are "
        "the draft. Longer endings are tried first.",
    )
    minN: int = Field(
        default=DEFAULT_NGRAM_MIN_N,
        description="Shortest ending looked up, at most maxN: a text whose endings of minN "
        "tokens or more never occurred before gets no draft (an ordinary decode step).",
    )


class SpeculativeSpec(_Strict):
    method: SpeculativeMethod = Field(
        description="mtp: drafts from the checkpoint's multi-token-prediction module "
        "(DeepSeek-V3/R1 carry one, num_nextn_predict_layers 1; V2 and V2-Lite do not); "
        "ngram: prompt lookup, for any model, at no model cost.",
    )
    tokens: int = Field(
        default=DEFAULT_SPECULATIVE_TOKENS,
        description="Tokens drafted per sequence and step (k); one decode step verifies "
        "k + 1 positions. Output is the same as without speculation (greedy) or follows "
        "the same distribution (sampled).",
    )
    ngram: NgramSpec | None = Field(
        default=None,
        description="The n-gram drafter's lengths (method ngram only); absent: its defaults.",
    )


class DecodeRoleSpec(RoleSpec):
    speculative: SpeculativeSpec | None = Field(
        default=None,
        description="Speculative decoding: draft tokens cheaply, verify them in one decode "
        "step (PDD_SPECULATIVE_*; with engine vllm, --speculative-config). Absent: none. The "
        "prefill runs the same model (spec.model), so an MTP draft can start from the "
        "prompt's last hidden state.",
    )


class SecretKeyRef(_Strict):
    name: str = Field(description="A Secret in the PDDeployment's namespace.")
    key: str | None = Field(
        default=None,
        description="The one data key holding the API keys; absent: every data key of the "
        "Secret holds some (one API key per line).",
    )


class RouterSpec(_Strict):
    enabled: bool = Field(
        default=True,
        description="Run the router Deployment and Service named after the PDDeployment "
        "(the user-facing /v1/completions endpoint).",
    )
    replicas: int = Field(default=1, description="Router pods.")
    workers: int = Field(
        default=1,
        description="Router processes per pod sharing its port (PDD_ROUTER_WORKERS), each a "
        "whole router: more spread the per-request and per-token work over more cores. Each "
        "keeps its own routing view; metrics are summed over them.",
    )
    policy: RouterPolicy = Field(
        default=DEFAULT_ROUTER_POLICY,
        description="How the router picks replicas (PDD_ROUTER_POLICY): cache-aware sends a "
        "prompt to the prefill that was sent its longest prefix before unless that one is "
        "overloaded, and each decode by load; least-loaded picks both by load alone; "
        "round-robin in turn.",
    )
    localPrefillTokens: int = Field(
        default=DEFAULT_LOCAL_PREFILL_TOKENS,
        description="A request whose prompt, less what the chosen decode already caches, is at "
        "most this many tokens is prefilled on that decode itself, in its running batch, "
        "instead of through a prefill and a KV hand-off (PDD_ROUTER_LOCAL_PREFILL_TOKENS). 0: "
        "every request goes through a prefill while one is ready. The default is a "
        "conservative guess; measure where the two paths cross on your GPU (docs/serving.md).",
    )
    noPrefill: NoPrefillMode = Field(
        default=DEFAULT_NO_PREFILL,
        description="When no prefill replica is ready: fallback serves requests on a decode "
        "(the Disaggregated condition turns False with reason NoPrefillReady, and the router "
        "counts them under path=\"fallback\"); refuse answers 503 (PDD_ROUTER_NO_PREFILL).",
    )
    image: str | None = Field(
        default=None,
        description="Router image; absent: spec.image. Required with engine vllm, where "
        "spec.image is a vLLM image and the router is pdd's.",
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="Router container resources."
    )
    template: PodTemplate | None = Field(
        default=None, description="Pod template overlay of the router pods (as for the roles)."
    )
    apiKeySecretRef: SecretKeyRef | None = Field(
        default=None,
        description="API keys clients must send as `Authorization: Bearer <key>`, one per line "
        "in the Secret's data (several keys, several lines or data keys). The Secret is mounted "
        "as a folder and read again when it changes, so keys rotate without a restart. Absent: "
        "the router is open. Health, readiness and metrics stay open (docs/openai-api.md).",
    )


class RolloutSpec(_Strict):
    maxUnavailable: int = Field(
        default=1,
        description="Pods of a role replaced at once when a change needs new pods (parallelism, "
        "block size, image, model). A role of several replicas always keeps one serving.",
    )


class NetworkPolicySpec(_Strict):
    enabled: bool = Field(
        default=True,
        description="Render NetworkPolicies: prefill and decode pods accept traffic (HTTP, side "
        "channel, NIXL) only from pods of this PDDeployment, and HTTP from the operator's pods "
        "in the operator's namespace while its planner scrapes them; the router accepts client "
        "traffic on its HTTP port from anywhere. Needs a network plugin that enforces "
        "NetworkPolicy.",
    )


class LatencyTarget(_Strict):
    percentile: float = Field(
        default=90.0, description="Which percentile of the interval's requests must stay "
        "within `seconds`, in (0, 100): 90 is p90.")
    seconds: float = Field(description="The bound in seconds, > 0.")


class RoleAutoscaling(_Strict):
    enabled: bool = Field(
        default=True,
        description="pdd's planner sets this role's replicas from its metrics (recorded in "
        "status.autoscaling, never in spec). false: spec.<role>.replicas rules, written by "
        "hand, by git, or by an external scaler (HPA/KEDA through the scale subresource for "
        "decode; docs/autoscaling.md).",
    )
    minReplicas: int = Field(default=1, description="Fewest instances, >= 1 (never to zero).")
    maxReplicas: int = Field(description="Most instances, >= minReplicas.")


class PrefillAutoscaling(RoleAutoscaling):
    ttft: LatencyTarget | None = Field(
        default=None, description="Time-to-first-token target, from the router's "
        "pdd_router_ttft_seconds histogram over each interval.")
    queuedPromptTokensPerReplica: int | None = Field(
        default=None, description="Prompt tokens waiting per prefill instance above which "
        "prefill scales up (pdd_queued_prompt_tokens); one replica per this many queued "
        "tokens.")
    promptTokensPerSecondPerReplica: int | None = Field(
        default=None, description="Prompt tokens per second one prefill instance should "
        "serve (its capacity times the headroom wanted; pdd_prefill_computed_tokens plus the "
        "growth of pdd_queued_prompt_tokens): prefill is sized to the measured prompt-token "
        "rate over this, up at once when that asks for clearly more, down to the window's "
        "peak rate.")


class DecodeAutoscaling(RoleAutoscaling):
    tpot: LatencyTarget | None = Field(
        default=None, description="Time-per-output-token (inter-token latency) target, from "
        "the router's pdd_router_tpot_seconds histogram over each interval.")
    kvCacheUtilization: float = Field(
        default=0.8, description="Target share of the decode KV blocks in use, in (0, 1]. "
        "Decode never goes below the instances its running sequences' blocks need at this "
        "share.")
    sequencesPerReplica: int | None = Field(
        default=None, description="Sequences (running plus waiting, pdd_running_sequences + "
        "pdd_waiting_sequences) one decode instance should hold: its batch times the headroom "
        "wanted. Decode is sized to the measured sequences over this, up at once when that "
        "asks for clearly more, down to the window's peak.")


class AutoscalingSpec(_Strict):
    intervalSeconds: int = Field(
        default=15, description="Seconds between two scrapes and decisions (1..3600). A "
        "sustained breach (two samples in a row) scales up within two intervals.")
    scaleDownStabilizationSeconds: int = Field(
        default=300, description="A role scales down only after its load fitted fewer "
        "instances for this long, and this long after its last change: to the window's peak "
        "need where a capacity target measures it, else one instance (0..86400).")
    prometheusURL: str | None = Field(
        default=None, description="Read the metrics from this Prometheus (http:// or "
        "https://) instead of scraping the instances' and router's /metrics directly.")
    prefill: PrefillAutoscaling | None = Field(
        default=None, description="Prefill: scales on TTFT, prompt tokens per second and "
        "queued prompt tokens.")
    decode: DecodeAutoscaling | None = Field(
        default=None, description="Decode: scales on TPOT, KV cache utilization and "
        "sequences per replica.")


def gpus_per_pod(role: RoleSpec) -> int:
    """GPUs and ranks of one pod of the role (its whole TP unless gpusPerPod cuts it)."""
    return role.gpusPerPod if role.gpusPerPod is not None else role.tensorParallelSize


def pods_per_instance(role: RoleSpec) -> int:
    """1 for a one-pod instance; the LeaderWorkerSet group size otherwise."""
    return max(1, role.tensorParallelSize // gpus_per_pod(role))


# OTLP transports the sidecars' exporters speak (pdd_sidecar/tracing.py); the first is the
# default, the OpenTelemetry specification's.
TracingProtocol = Literal["http/protobuf", "grpc"]
TRACING_PROTOCOLS: tuple[str, ...] = get_args(TracingProtocol)


class TracingSpec(_Strict):
    endpoint: str = Field(
        description="OTLP receiver (an OpenTelemetry Collector, Jaeger, Tempo, ...) the router, "
        "prefill and decode send their spans to, http:// or https:// (OTEL_EXPORTER_OTLP_"
        "ENDPOINT): with grpc its OTLP/gRPC port (usually 4317), with http/protobuf the base "
        "URL of its OTLP/HTTP port (usually 4318; /v1/traces is added).",
    )
    protocol: TracingProtocol = Field(
        default="http/protobuf",
        description="OTLP transport: http/protobuf or grpc (OTEL_EXPORTER_OTLP_PROTOCOL).",
    )
    samplingRatio: float = Field(
        default=1.0,
        description="Share of requests traced, in [0, 1], when the client sent no "
        "traceparent; a client's traceparent decides for its own requests "
        "(OTEL_TRACES_SAMPLER=parentbased_traceidratio, OTEL_TRACES_SAMPLER_ARG).",
    )


class PDDeploymentSpec(_Strict):
    model: ModelSpec = Field(description="What the sidecars serve.")
    image: str = Field(description="Sidecar image (runs the prefill, decode and router roles). "
                       "With engine vllm: a vLLM image, run by the prefill and decode pods.")
    engine: Literal["pdd", "vllm"] = Field(
        default="pdd",
        description="What serves prefill and decode: pdd's sidecars, or vLLM itself (`vllm "
        "serve` with NixlConnector, pdd's router in front speaking vLLM's P/D protocol). "
        "vllm adds vLLM's rules: the two TP sizes divide one another, and the router needs "
        "router.image (a pdd image).",
    )
    blockSize: int = Field(
        default=64,
        description="Tokens per KV block on both sides; DCP interleaves at block granularity.",
    )
    kvTransfer: KVTransferSpec = Field(
        default_factory=KVTransferSpec, description="How KV moves from prefill to decode."
    )
    prefill: RoleSpec = Field(description="Prefill instances: run prompts, hold KV until read.")
    decode: DecodeRoleSpec = Field(
        description="Decode instances: read KV per the routing plan, decode.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The request router.")
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec, description="How pods are replaced when the spec changes."
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Scale prefill and decode apart on their own load (docs/autoscaling.md). "
        "The decisions live in status.autoscaling; spec.<role>.replicas only seeds them.",
    )
    networkPolicy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        description="Ingress isolation of the pods (NetworkPolicy objects owned by this "
        "PDDeployment).",
    )
    tracing: TracingSpec | None = Field(
        default=None,
        description="OpenTelemetry traces, one per request: the router's routing decision, the "
        "prefill, the KV hand-off and the decode, with a client's W3C traceparent honoured "
        "(docs/tracing.md). Absent: off, unless the roles' env sets the standard OTEL_* "
        "variables.",
    )


class Condition(BaseModel):
    """Kubernetes condition conventions (kstatus, kubectl wait)."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="Validated, RoutingReady, PrefillAvailable, DecodeAvailable, "
                      "Ready, Stalled, Autoscaling or ReplicasConflict.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="What a person needs to know.")
    lastTransitionTime: str = Field(description="When status last changed (RFC 3339).")
    observedGeneration: int | None = Field(
        default=None, description="Generation of the spec this condition describes."
    )


class RoleStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(default=0, description="Pods that exist for the role.")
    readyReplicas: int = Field(default=0, description="Pods that are Ready.")
    updatedReplicas: int = Field(default=0, description="Pods running the current spec.")
    selector: str | None = Field(
        default=None, description="Label selector of the role's pods (the scale subresource's "
        "selector for decode, as an HPA reads it).")


class RoleAutoscalingStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    desiredReplicas: int = Field(description="Instances the planner wants; the operator "
                                 "builds these instead of spec.<role>.replicas.")
    lastScaleTime: str | None = Field(
        default=None, description="When desiredReplicas last changed (RFC 3339).")
    reason: str = Field(default="", description="ScaledUp, ScaledDown, AtMaximum, AtMinimum, "
                        "Stable or MetricsUnavailable.")
    message: str = Field(default="", description="The decision and the metric values behind "
                         "it.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The metric values of the last decision.")


class AutoscalingStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill: RoleAutoscalingStatus | None = Field(default=None, description="Prefill planner.")
    decode: RoleAutoscalingStatus | None = Field(default=None, description="Decode planner.")


class PDDeploymentStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    observedGeneration: int | None = Field(
        default=None, description="Generation the operator last reconciled."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Current state.")
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill replicas.")
    decode: RoleStatus = Field(default_factory=RoleStatus, description="Decode replicas.")
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="The planner's decisions per role (spec.autoscaling).")
    routingCase: str | None = Field(default=None, description="The routing case of the plan.")
    routingSummary: str | None = Field(
        default=None, description="Which decode rank reads which prefill ranks, e.g. "
        "`D0 <- P0,P2; D1 <- P1,P3`."
    )


ROLES: tuple[Literal["prefill", "decode"], ...] = ("prefill", "decode")


class PDDRoleScaleSpec(_Strict):
    deployment: str = Field(description="The PDDeployment, in this namespace, whose role this "
                            "object scales. Immutable.")
    role: Literal["prefill", "decode"] = Field(description="The role it scales. Immutable.")
    replicas: int | None = Field(
        default=None, description="The role's instances: the operator writes them into the "
        "PDDeployment's spec.<role>.replicas (the scale subresource's spec, what `kubectl "
        "scale`, an HPA or KEDA set). Left out: the operator fills it in from the PDDeployment.")


class PDDRoleScaleStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(default=0, description="Pods that exist for the role (the scale "
                          "subresource's status).")
    readyReplicas: int = Field(default=0, description="Pods of the role that are Ready.")
    selector: str | None = Field(
        default=None, description="Label selector of the role's pods, as an HPA reads it.")
    applied: bool = Field(default=False, description="This object drives the role: the "
                          "pods follow its spec.replicas.")
    appliedReplicas: int | None = Field(
        default=None, description="The spec.replicas last written into the PDDeployment's "
        "spec.<role>.replicas: a different value there was written by someone else "
        "(condition ReplicasConflict), and is neither followed nor written back.")
    message: str = Field(default="", description="What the operator did with spec.replicas, "
                         "or why it did not.")
    observedGeneration: int | None = Field(
        default=None, description="Generation the operator last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list, description="ReplicasConflict, while another writer sets the "
        "role's replicas.")

"""Every label, annotation and environment key of the contract, named once.

The operator writes them, the sidecars read them; outside tooling (dashboards,
GitOps health checks) relies on them, so they change only with a version bump.
"""

from __future__ import annotations

from pdd_api.models import API_GROUP
from pdd_api.models import DEFAULT_GPU_MEMORY_UTILIZATION as DEFAULT_GPU_MEMORY_UTILIZATION

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_REPLICA = f"{API_GROUP}/replica"
APP_NAME = "pdd"
COMPONENT_ROUTER = "router"

ANNOTATION_SPEC_HASH = f"{API_GROUP}/spec-hash"

ROUTING_CONFIGMAP_KEY = "routing.json"

ENV_ROLE = "PDD_ROLE"
ENV_REPLICA = "PDD_REPLICA"
ENV_TP_SIZE = "PDD_TP_SIZE"
ENV_DCP_SIZE = "PDD_DCP_SIZE"
ENV_BLOCK_SIZE = "PDD_BLOCK_SIZE"
ENV_ROUTING_FILE = "PDD_ROUTING_FILE"
ENV_SIDE_CHANNEL_PORT = "PDD_SIDE_CHANNEL_PORT"
ENV_POD_IP = "POD_IP"

# Added by the operator (issue 4): serving endpoints and what the sidecars are told to load.
HTTP_PORT = 8000
ENV_HTTP_PORT = "PDD_HTTP_PORT"
ENV_MODEL_NAME = "PDD_MODEL_NAME"
ENV_MODEL_SOURCE = "PDD_MODEL_SOURCE"
ENV_DTYPE = "PDD_DTYPE"
ENV_POD_NAME = "PDD_POD_NAME"
ENV_NAMESPACE = "PDD_NAMESPACE"
ENV_PREFILL_URLS = "PDD_PREFILL_URLS"  # router: comma-separated http://<pod>.<svc>.<ns>.svc:8000
ENV_DECODE_URLS = "PDD_DECODE_URLS"
ENV_PREFILL_SERVICE = "PDD_PREFILL_SERVICE"  # router: headless Service DNS name of each role
ENV_DECODE_SERVICE = "PDD_DECODE_SERVICE"
ROUTING_MOUNT_DIR = "/etc/pdd"
ROUTING_FILE = f"{ROUTING_MOUNT_DIR}/{ROUTING_CONFIGMAP_KEY}"
CONTAINER_NAME = "sidecar"
ROUTER_CONTAINER_NAME = "router"
FIELD_MANAGER = "pdd-operator"
MANAGED_BY = "pdd-operator"

# Transfer grants (issue 12): a per-deployment HMAC key, in a Secret the operator creates once.
ENV_GRANT_KEY_FILE = "PDD_GRANT_KEY_FILE"
GRANT_KEY_SECRET_SUFFIX = "-grant-key"
GRANT_KEY_FILE_NAME = "grant.key"
GRANT_MOUNT_DIR = "/etc/pdd-grant"
GRANT_KEY_FILE = f"{GRANT_MOUNT_DIR}/{GRANT_KEY_FILE_NAME}"

# Versioned routing (issue 14 item 1): which routing plan a pod was started with. The router
# pairs a prefill and a decode only when these match.
LABEL_PLAN_HASH = f"{API_GROUP}/plan-hash"
ENV_PLAN_HASH = "PDD_PLAN_HASH"

# Plan-changing rolls: the one extra pod per role that carries the new plan while the old
# generation still serves (`<name>-<role>-surge`). The router lists it with the replicas.
LABEL_SURGE = f"{API_GROUP}/surge"
SURGE_SUFFIX = "surge"

# Instances whose ranks span the pods of a LeaderWorkerSet group (docs/lws.md): LWS's pod webhook
# sets the LWS_* variables, the operator the ranks per pod and the rendezvous port.
ENV_LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
ENV_LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
ENV_RANKS_PER_POD = "PDD_RANKS_PER_POD"
ENV_DIST_PORT = "PDD_DIST_PORT"
DIST_PORT = 29500  # torch.distributed's customary rendezvous port

# Prefix caching and cache-aware routing: whether an instance keeps a prompt's KV blocks for
# later prompts that start the same way ("1", the default, or "0"), and how the router picks
# replicas (cache-aware, least-loaded or round-robin; pdd_api.models.ROUTER_POLICIES).
ENV_PREFIX_CACHE = "PDD_PREFIX_CACHE"
ENV_ROUTER_POLICY = "PDD_ROUTER_POLICY"
ENV_ROUTER_WORKERS = "PDD_ROUTER_WORKERS"
# Where the router prefills a request (spec.router.localPrefillTokens, spec.router.noPrefill).
ENV_ROUTER_LOCAL_PREFILL_TOKENS = "PDD_ROUTER_LOCAL_PREFILL_TOKENS"
ENV_ROUTER_NO_PREFILL = "PDD_ROUTER_NO_PREFILL"

# KV memory (issue 38): the share of a GPU's memory an instance may fill (weights, activations,
# graphs and KV; the pool gets what is left), an explicit pool size that overrides it, and the
# pinned host-memory tier under the prefix cache, in GiB (0: none).
ENV_GPU_MEMORY_UTILIZATION = "PDD_GPU_MEMORY_UTILIZATION"
ENV_NUM_BLOCKS = "PDD_NUM_BLOCKS"
ENV_HOST_KV_CACHE_GIB = "PDD_HOST_KV_CACHE_GIB"
# DEFAULT_GPU_MEMORY_UTILIZATION (imported above from the models: the CRD's default is the
# sidecars').

# FP8 KV (issue 45): what the KV cache keeps a token's latent in, one of
# pdd_api.models.KV_CACHE_DTYPES; written only for fp8 (unset: auto, the model's dtype), so pods
# of specs without it keep their hash.
ENV_KV_CACHE_DTYPE = "PDD_KV_CACHE_DTYPE"

# Speculative decoding (issue 47), decode role only: the drafter (mtp | ngram;
# pdd_api.models.SPECULATIVE_METHODS; unset: none), tokens drafted per step, and the n-gram
# drafter's longest and shortest ending (method ngram only).
ENV_SPECULATIVE_METHOD = "PDD_SPECULATIVE_METHOD"
ENV_SPECULATIVE_TOKENS = "PDD_SPECULATIVE_TOKENS"
ENV_SPECULATIVE_NGRAM_MAX = "PDD_SPECULATIVE_NGRAM_MAX"
ENV_SPECULATIVE_NGRAM_MIN = "PDD_SPECULATIVE_NGRAM_MIN"

# API keys on the router (issue 39): keys in the env, or a file/folder of them (the mounted
# Secret of spec.router.apiKeySecretRef), read again when it changes.
ENV_API_KEY = "PDD_API_KEY"
ENV_API_KEY_FILE = "PDD_API_KEY_FILE"
API_KEY_MOUNT_DIR = "/etc/pdd-api-keys"

# Scale-down (pdd_operator/drain.py): a pod chosen to go carries when it was chosen (RFC 3339)
# and why, so a restarted operator finishes the same drain.
ANNOTATION_DRAINING_SINCE = f"{API_GROUP}/draining-since"
ANNOTATION_DRAIN_REASON = f"{API_GROUP}/drain-reason"

# Autoscaling (issue 40): the operator's pods (label app.kubernetes.io/name, as the kustomize
# base and the chart's default operatorName set it) scrape the instances' /metrics, which the
# data-plane NetworkPolicy then admits on the HTTP port from the operator's namespace only
# (the label every namespace carries: a tenant cannot set it on its own).
OPERATOR_APP_NAME = "pdd-operator"
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"

# Traces (issue 46, spec.tracing): the standard OpenTelemetry variables the operator sets on the
# router, prefill and decode containers (the sidecars' tracing.py reads them, as the SDK does).
# Where spec.tracing is set they are the operator's (a role's env cannot shadow them).
ENV_OTEL_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTEL_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTEL_SAMPLER = "OTEL_TRACES_SAMPLER"
ENV_OTEL_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
ENV_OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
TRACING_ENV = (ENV_OTEL_ENDPOINT, ENV_OTEL_PROTOCOL, ENV_OTEL_SAMPLER, ENV_OTEL_SAMPLER_ARG,
               ENV_OTEL_SERVICE_NAME, ENV_OTEL_RESOURCE_ATTRIBUTES)
# The sampler rendered: the share of spec.tracing.samplingRatio for requests that come without
# a sampling decision; a client's traceparent decides for its own.
OTEL_SAMPLER = "parentbased_traceidratio"
OTEL_SERVICE_PREFIX = "pdd-"  # OTEL_SERVICE_NAME = pdd-router | pdd-prefill | pdd-decode

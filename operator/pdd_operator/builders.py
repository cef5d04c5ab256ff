"""Pure builders: a PDDeployment (name, namespace, uid, parsed spec) -> the objects it owns.

Every function here is data in, data out, deterministic, so the same spec always yields the same
objects and the same hashes. That is what makes the operator level-based: a reconcile compares
these dicts with what the cluster holds and acts on the difference, never on remembered history.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

from pdd_api import keys
from pdd_api.models import (
    API_GROUP,
    API_VERSION,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_LOCAL_PREFILL_TOKENS,
    DEFAULT_NO_PREFILL,
    DEFAULT_ROUTER_POLICY,
    GPU_RESOURCE,
    KIND,
    PDDeploymentSpec,
    PodTemplate,
    ResourceRequirements,
    RoleSpec,
    gpus_per_pod,
)
from pdd_api.plan import RoutingPlan
from pdd_api.quantity import MAX_BYTES, format_bytes, gib_bytes, parse_quantity, plain_number
from pdd_api.routing import plan_for_spec
from pdd_api.speculative import speculative_env
from pdd_operator import builders_vllm
from pdd_operator.hashing import content_hash

Role = Literal["prefill", "decode"]
Obj = dict[str, Any]

SIDECAR_SERVE = ["python", "-m", "pdd_sidecar", "serve"]
SIDECAR_ROUTER = ["python", "-m", "pdd_sidecar", "router"]
ROUTING_VOLUME = "routing"
GRANT_VOLUME = "grant-key"
API_KEY_VOLUME = "api-keys"
SHM_VOLUME = "dshm"
# PodSecurity `restricted` by default; a template may relax it (e.g. a root-only image).
POD_SECURITY: Obj = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY: Obj = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# Model loading can take minutes: the startup probe gives it 20 min before liveness applies.
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 120

CONTRACT_ENV = frozenset(
    {
        keys.ENV_ROLE, keys.ENV_REPLICA, keys.ENV_TP_SIZE, keys.ENV_DCP_SIZE,
        keys.ENV_BLOCK_SIZE, keys.ENV_ROUTING_FILE, keys.ENV_SIDE_CHANNEL_PORT, keys.ENV_POD_IP,
        keys.ENV_HTTP_PORT, keys.ENV_MODEL_NAME, keys.ENV_MODEL_SOURCE, keys.ENV_DTYPE,
        keys.ENV_POD_NAME, keys.ENV_NAMESPACE, keys.ENV_GRANT_KEY_FILE,
        keys.ENV_PREFILL_SERVICE, keys.ENV_PLAN_HASH, keys.ENV_PREFIX_CACHE,
        # Set through the role's fields only: the host tier's memory is accounted from them.
        keys.ENV_GPU_MEMORY_UTILIZATION, keys.ENV_NUM_BLOCKS, keys.ENV_HOST_KV_CACHE_GIB,
        # Set through kvCacheDtype only: the validators hold both roles to one value.
        keys.ENV_KV_CACHE_DTYPE,
        # spec.decode.speculative, checked by the validators.
        keys.ENV_SPECULATIVE_METHOD, keys.ENV_SPECULATIVE_TOKENS, keys.ENV_SPECULATIVE_NGRAM_MAX,
        keys.ENV_SPECULATIVE_NGRAM_MIN,
    }
)


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> Obj:
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass
class Desired:
    """Everything one PDDeployment should own; pods keyed by role then replica index."""

    plan: RoutingPlan
    configmap: Obj
    services: list[Obj]
    pods: dict[Role, dict[int, Obj]]
    router_deployment: Obj | None = None
    router_service: Obj | None = None
    network_policies: list[Obj] = field(default_factory=list)
    extra: list[Obj] = field(default_factory=list)
    surge_pods: dict[Role, Obj] = field(default_factory=dict)  # only created during a plan roll

    def owned_non_pods(self) -> list[Obj]:
        objs = [self.configmap, *self.services]
        objs += [o for o in (self.router_deployment, self.router_service) if o is not None]
        return objs + self.network_policies


PLAN_HASH_LENGTH = 10


def plan_hash(plan: RoutingPlan) -> str:
    """Names a routing plan: pods started with different plans must not be paired."""
    return content_hash(plan.to_json(), length=PLAN_HASH_LENGTH)


def plan_of(spec: PDDeploymentSpec) -> RoutingPlan:
    """The plan `pdd plan -o json` prints for this spec: the `<name>-routing` ConfigMap."""
    return plan_for_spec(spec)


def labels(owner: Owner, component: str | None = None,
           replica: int | None = None) -> dict[str, str]:
    out = {
        keys.LABEL_NAME: keys.APP_NAME,
        keys.LABEL_INSTANCE: owner.name,
        keys.LABEL_MANAGED_BY: keys.MANAGED_BY,
    }
    if component is not None:
        out[keys.LABEL_COMPONENT] = component
    if replica is not None:
        out[keys.LABEL_REPLICA] = str(replica)
    return out


def selector(owner: Owner, component: str) -> dict[str, str]:
    return {
        keys.LABEL_NAME: keys.APP_NAME,
        keys.LABEL_INSTANCE: owner.name,
        keys.LABEL_COMPONENT: component,
    }


def _meta(owner: Owner, name: str, lbls: dict[str, str]) -> Obj:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": lbls,
        "ownerReferences": [owner.reference()],
    }


def configmap_name(name: str, plan_hash: str | None = None) -> str:
    """Immutable and named by its plan: a running pod's plan never changes under it, and the
    pods of a new plan mount a new ConfigMap. Without a hash: v1alpha1's `<name>-routing`
    (deleted once no pod mounts it), also the prefix of every routing ConfigMap's name."""
    return f"{name}-routing-{plan_hash}" if plan_hash else f"{name}-routing"


def is_routing_configmap(owner_name: str, cm_name: str) -> bool:
    return cm_name == configmap_name(owner_name) or (
        cm_name.startswith(f"{owner_name}-routing-")
        and len(cm_name) == len(owner_name) + len("-routing-") + PLAN_HASH_LENGTH)


def grant_secret_name(name: str) -> str:
    return f"{name}{keys.GRANT_KEY_SECRET_SUFFIX}"


def network_policy_names(name: str) -> tuple[str, str]:
    """(prefill and decode pods, router pods)."""
    return f"{name}-dataplane", f"{name}-router"


def service_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def pod_name(name: str, role: str, index: int) -> str:
    return f"{name}-{role}-{index}"


def surge_pod_name(name: str, role: str) -> str:
    return f"{name}-{role}-{keys.SURGE_SUFFIX}"


def pod_url(owner: Owner, role: str, index: int | None) -> str:
    """Per-pod DNS of replica `index`, or of the role's surge pod (None)."""
    pod = surge_pod_name(owner.name, role) if index is None else pod_name(owner.name, role,
                                                                           index)
    return f"http://{pod}.{service_dns(owner, role)}:{keys.HTTP_PORT}"


def service_dns(owner: Owner, role: str) -> str:
    return f"{service_name(owner.name, role)}.{owner.namespace}.svc"


def build_configmap(owner: Owner, plan: RoutingPlan) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, configmap_name(owner.name, plan_hash(plan)),
                          {**labels(owner), keys.LABEL_PLAN_HASH: plan_hash(plan)}),
        "immutable": True,
        "data": {keys.ROUTING_CONFIGMAP_KEY: plan.to_json()},
    }


def build_grant_secret(owner: Owner, key: bytes) -> Obj:
    """The transfer-grant HMAC key. Random, so it is not part of the desired state the
    builders compute: the reconciler creates it once (immutable, never rotated) and then only
    checks that it exists."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(owner, grant_secret_name(owner.name), labels(owner)),
        "type": "Opaque",
        "immutable": True,
        "data": {keys.GRANT_KEY_FILE_NAME: base64.b64encode(key).decode()},
    }


def _grant_volume(owner: Owner) -> Obj:
    return {"name": GRANT_VOLUME, "secret": {"secretName": grant_secret_name(owner.name)}}


def _grant_mount() -> Obj:
    return {"name": GRANT_VOLUME, "mountPath": keys.GRANT_MOUNT_DIR, "readOnly": True}


def _api_key_volumes(spec: PDDeploymentSpec) -> list[Obj]:
    """The router's API keys as a folder (never subPath: the kubelet updates a mounted Secret
    in place only as a whole volume, which is how keys rotate without a restart)."""
    ref = spec.router.apiKeySecretRef
    if ref is None:
        return []
    secret: Obj = {"secretName": ref.name}
    if ref.key is not None:
        secret["items"] = [{"key": ref.key, "path": "keys"}]
    return [{"name": API_KEY_VOLUME, "secret": secret}]


def _api_key_mounts(spec: PDDeploymentSpec) -> list[Obj]:
    if spec.router.apiKeySecretRef is None:
        return []
    return [{"name": API_KEY_VOLUME, "mountPath": keys.API_KEY_MOUNT_DIR, "readOnly": True}]


@dataclass(frozen=True)
class Scraper:
    """Where the autoscaling planner's scrapes of /metrics come from: the operator's pods
    (`app.kubernetes.io/name: <name>`) in the operator's own namespace. A label alone would
    admit any pod that copies it, in any namespace a tenant can write to."""

    namespace: str
    name: str = keys.OPERATOR_APP_NAME

    def peer(self) -> Obj:
        return {"namespaceSelector": {"matchLabels": {keys.LABEL_NAMESPACE_NAME: self.namespace}},
                "podSelector": {"matchLabels": {keys.LABEL_NAME: self.name}}}


def build_network_policies(owner: Owner, spec: PDDeploymentSpec,
                           scraper: Scraper | None = None) -> list[Obj]:
    """Ingress only. Prefill and decode pods take any TCP port (HTTP, the side channel and
    the UCX ports NIXL picks at run time) from pods of the same PDDeployment, the router
    included, and HTTP from the scraper while the planner reads their metrics itself; the
    router takes its HTTP port from anywhere. Without a scraper (an operator outside the
    cluster, whose namespace is unknown) no pod is admitted for scrapes."""
    if not spec.networkPolicy.enabled:
        return []
    workers, router = network_policy_names(owner.name)
    instance = {keys.LABEL_NAME: keys.APP_NAME, keys.LABEL_INSTANCE: owner.name}
    dataplane: Obj = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, workers, labels(owner)),
        "spec": {
            "podSelector": {
                "matchLabels": dict(instance),
                "matchExpressions": [{"key": keys.LABEL_COMPONENT, "operator": "In",
                                      "values": ["prefill", "decode"]}],
            },
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": dict(instance)}}],
                         "ports": [{"protocol": "TCP"}]}],
        },
    }
    a = spec.autoscaling
    if scraper is not None and a is not None and not a.prometheusURL and any(
            r is not None and r.enabled for r in (a.prefill, a.decode)):
        dataplane["spec"]["ingress"].append({
            "from": [scraper.peer()],
            "ports": [{"protocol": "TCP", "port": keys.HTTP_PORT}]})
    front: Obj = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, router, labels(owner, keys.COMPONENT_ROUTER)),
        "spec": {
            "podSelector": {"matchLabels": selector(owner, keys.COMPONENT_ROUTER)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": keys.HTTP_PORT}]}],
        },
    }
    return [dataplane, front]


def build_service(owner: Owner, role: Role, role_spec: RoleSpec, side_port: int) -> Obj:
    """Headless, publishing not-ready pods: sidecars find each other's side channels (per-pod
    DNS `<pod>.<svc>`) while still loading, before readiness."""
    ports = [{"name": "http", "port": keys.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
    ports += [
        {"name": f"side-{r}", "port": side_port + r, "targetPort": side_port + r,
         "protocol": "TCP"}
        for r in range(role_spec.tensorParallelSize)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, service_name(owner.name, role), labels(owner, role)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(owner, role),
            "ports": ports,
        },
    }


def _quantities(amounts: dict[str, int | str] | None) -> dict[str, str]:
    return {k: str(v) for k, v in (amounts or {}).items()}


# What a sidecar rank needs in host memory besides its host KV tier (the process, torch, the
# CUDA context, NIXL), where the spec gives the sidecar no memory: its limit must leave room.
SIDECAR_RANK_MEMORY_GIB = 8


def host_kv_cache_bytes(role_spec: RoleSpec) -> Fraction:
    """Pinned host memory of one pod's host KV tiers: hostKVCacheGiB for each of its ranks."""
    return gib_bytes(role_spec.hostKVCacheGiB) * gpus_per_pod(role_spec)


def _plus(amount: str, extra: Fraction) -> str:
    """A memory quantity grown by `extra` bytes. One that is not a quantity, or is beyond what
    Kubernetes counts in bytes (int64), is left as written for the API server to judge."""
    q = parse_quantity(amount)
    if q is None or abs(q.exact) > MAX_BYTES:
        return amount
    return format_bytes(q.exact + extra)


def role_resources(role_spec: RoleSpec) -> Obj:
    """One GPU per TP rank, as limit and request (extended resources need both equal). The
    host KV tier is pinned memory the kernel cannot reclaim: it is added to the memory the spec
    gives the sidecar (request and limit). With the tier on the sidecar always gets a limit as
    well as a request: without one a namespace LimitRange's default limit would apply, which a
    request this size exceeds, and the pod would be refused. A request alone is the limit too;
    no memory at all is the tier plus SIDECAR_RANK_MEMORY_GIB per rank, as both."""
    res = role_spec.resources or ResourceRequirements()
    limits, requests = _quantities(res.limits), _quantities(res.requests)
    gpus = str(role_spec.tensorParallelSize)
    limits[GPU_RESOURCE] = gpus
    requests[GPU_RESOURCE] = gpus
    tier = host_kv_cache_bytes(role_spec)
    if tier > 0:
        for amounts in (limits, requests):
            if "memory" in amounts:
                amounts["memory"] = _plus(amounts["memory"], tier)
        if "memory" not in limits and "memory" not in requests:
            own = gib_bytes(SIDECAR_RANK_MEMORY_GIB) * gpus_per_pod(role_spec)
            requests["memory"] = format_bytes(tier + own)
        if "memory" not in limits:
            limits["memory"] = requests["memory"]
    return {"limits": limits, "requests": requests}


def _env(name: str, value: str | int) -> Obj:
    return {"name": name, "value": str(value)}


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def owned_env(spec: PDDeploymentSpec) -> frozenset[str]:
    """The env names a role's env or template cannot set: the contract's, and the tracing
    variables where spec.tracing renders them."""
    return CONTRACT_ENV | frozenset(keys.TRACING_ENV) if spec.tracing else CONTRACT_ENV


def tracing_env(owner: Owner, spec: PDDeploymentSpec, component: str) -> list[Obj]:
    """spec.tracing as the standard OpenTelemetry variables of one component (none when
    absent, so pods of a spec without it keep their hash)."""
    t = spec.tracing
    if t is None:
        return []
    return [
        _env(keys.ENV_OTEL_ENDPOINT, t.endpoint),
        _env(keys.ENV_OTEL_PROTOCOL, t.protocol),
        _env(keys.ENV_OTEL_SAMPLER, keys.OTEL_SAMPLER),
        _env(keys.ENV_OTEL_SAMPLER_ARG, plain_number(t.samplingRatio)),
        _env(keys.ENV_OTEL_SERVICE_NAME, f"{keys.OTEL_SERVICE_PREFIX}{component}"),
        _env(keys.ENV_OTEL_RESOURCE_ATTRIBUTES,
             f"k8s.namespace.name={owner.namespace},pdd.deployment={owner.name}"),
    ]


def role_env(spec: PDDeploymentSpec, role: Role, index: int,
             prefill_service: str = "", owner: Owner | None = None) -> list[Obj]:
    r = getattr(spec, role)
    env = [
        _env(keys.ENV_ROLE, role),
        _env(keys.ENV_REPLICA, index),
        _env(keys.ENV_TP_SIZE, r.tensorParallelSize),
        _env(keys.ENV_DCP_SIZE, r.decodeContextParallelSize),
        _env(keys.ENV_BLOCK_SIZE, spec.blockSize),
        _env(keys.ENV_ROUTING_FILE, keys.ROUTING_FILE),
        _env(keys.ENV_SIDE_CHANNEL_PORT, spec.kvTransfer.sideChannelPort),
        _env(keys.ENV_HTTP_PORT, keys.HTTP_PORT),
        _env(keys.ENV_MODEL_NAME, spec.model.name),
        _env(keys.ENV_DTYPE, spec.model.dtype),
    ]
    # Written only when off (the sidecar's default is on), so existing pods keep their hash.
    if not r.prefixCache:
        env.append(_env(keys.ENV_PREFIX_CACHE, "0"))
    # KV memory, likewise only where it differs from the sidecar's own default.
    if r.gpuMemoryUtilization != DEFAULT_GPU_MEMORY_UTILIZATION:
        env.append(_env(keys.ENV_GPU_MEMORY_UTILIZATION, plain_number(r.gpuMemoryUtilization)))
    if r.kvCacheBlocks is not None:
        env.append(_env(keys.ENV_NUM_BLOCKS, r.kvCacheBlocks))
    if r.hostKVCacheGiB > 0:
        env.append(_env(keys.ENV_HOST_KV_CACHE_GIB, plain_number(r.hostKVCacheGiB)))
    if r.kvCacheDtype != DEFAULT_KV_CACHE_DTYPE:
        env.append(_env(keys.ENV_KV_CACHE_DTYPE, r.kvCacheDtype))
    env += [_env(k, v) for k, v in speculative_env(spec.decode.speculative, role).items()]
    if spec.model.source:
        env.append(_env(keys.ENV_MODEL_SOURCE, spec.model.source))
    env.append(_env(keys.ENV_GRANT_KEY_FILE, keys.GRANT_KEY_FILE))
    if role == "decode" and prefill_service:  # a decode reads only from peers it discovers
        env.append(_env(keys.ENV_PREFILL_SERVICE, prefill_service))
    env += [
        _field_env(keys.ENV_POD_IP, "status.podIP"),
        _field_env(keys.ENV_POD_NAME, "metadata.name"),
        _field_env(keys.ENV_NAMESPACE, "metadata.namespace"),
    ]
    if owner is not None:
        env += tracing_env(owner, spec, role)
    # User env first would let a duplicate shadow the contract (the last duplicate wins in
    # Kubernetes); dropping collisions makes "contract PDD_* win" true and visible in the pod.
    owned = owned_env(spec)
    env += [e.model_dump(exclude_none=True) for e in (r.env or []) if e.name not in owned]
    return env


def _merge(ours: Any, theirs: Any) -> Any:
    """The overlay rule: lists append, objects merge key by key, anything else replaces."""
    if isinstance(ours, list) and isinstance(theirs, list):
        return ours + copy.deepcopy(theirs)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = dict(ours)
        for k, v in theirs.items():
            out[k] = _merge(out[k], v) if k in out else copy.deepcopy(v)
        return out
    return copy.deepcopy(theirs)


def apply_template(meta: Obj, pod_spec: Obj, template: PodTemplate | None,
                   owned: frozenset[str] = CONTRACT_ENV) -> None:
    """Merge a user's pod template over a built pod (in place). The owned fields are refused
    by validation; the operator's labels, annotations and contract env still win here, so a
    template can never change what the operator selects or what the sidecar is told."""
    if template is None:
        return
    if template.metadata is not None:
        meta["labels"] = {**(template.metadata.labels or {}), **meta.get("labels", {})}
        if template.metadata.annotations:
            meta["annotations"] = {**template.metadata.annotations,
                                   **meta.get("annotations", {})}
    main = pod_spec["containers"][0]
    for key, value in (template.spec or {}).items():
        if key == "containers" and isinstance(value, list):
            for c in value:
                if isinstance(c, dict) and c.get("name") == main["name"]:
                    env = [e for e in c.get("env") or [] if isinstance(e, dict)
                           and e.get("name") not in owned]
                    rest = {k: v for k, v in c.items() if k not in ("name", "env")}
                    merged = _merge(main, rest)
                    merged["env"] = main.get("env", []) + copy.deepcopy(env)
                    pod_spec["containers"][0] = main = merged
                else:
                    pod_spec["containers"].append(copy.deepcopy(c))
        elif key in pod_spec:
            pod_spec[key] = _merge(pod_spec[key], value)
        else:
            pod_spec[key] = copy.deepcopy(value)


def _probe(path: str, period: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def build_pod(owner: Owner, spec: PDDeploymentSpec, plan: RoutingPlan, role: Role,
              index: int, surge: bool = False) -> Obj:
    """Replica `index` of the role; with `surge`, the role's surge pod (named
    `<name>-<role>-surge`, no replica label, PDD_REPLICA = index = the role's replicas)."""
    r: RoleSpec = getattr(spec, role)
    name = surge_pod_name(owner.name, role) if surge else pod_name(owner.name, role, index)
    side = spec.kvTransfer.sideChannelPort
    container: Obj = {
        "name": keys.CONTAINER_NAME,
        "image": spec.image,
        "command": [*SIDECAR_SERVE, *(r.extraArgs or [])],
        "env": [*role_env(spec, role, index, service_dns(owner, "prefill"), owner),
                _env(keys.ENV_PLAN_HASH, plan_hash(plan))],
        "ports": [{"name": "http", "containerPort": keys.HTTP_PORT, "protocol": "TCP"}]
        + [
            {"name": f"side-{rank}", "containerPort": side + rank, "protocol": "TCP"}
            for rank in range(r.tensorParallelSize)
        ],
        "resources": role_resources(r),
        "volumeMounts": [
            {"name": ROUTING_VOLUME, "mountPath": keys.ROUTING_MOUNT_DIR, "readOnly": True},
            _grant_mount(),
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        ],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "startupProbe": _probe("/healthz", STARTUP_PERIOD_S, STARTUP_FAILURES),
        "livenessProbe": _probe("/healthz", 10, 3),
        "readinessProbe": _probe("/readyz", 5, 3),
    }
    if r.imagePullPolicy:
        container["imagePullPolicy"] = r.imagePullPolicy
    pod_spec: Obj = {
        "hostname": name,
        "subdomain": service_name(owner.name, role),
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [container],
        "volumes": [
            {"name": ROUTING_VOLUME,
             "configMap": {"name": configmap_name(owner.name, plan_hash(plan))}},
            _grant_volume(owner),
            # torch and NCCL/UCX use shared memory; the container runtime's default is 64 MiB.
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
        ],
    }
    if spec.engine == "vllm":
        builders_vllm.render_pod_spec(pod_spec, spec, r)
    if r.nodeSelector:
        pod_spec["nodeSelector"] = dict(r.nodeSelector)
    if r.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in r.tolerations]
    if r.affinity:
        pod_spec["affinity"] = r.affinity
    if r.priorityClassName:
        pod_spec["priorityClassName"] = r.priorityClassName
    meta = _meta(owner, name, labels(owner, role, None if surge else index))
    meta["labels"][keys.LABEL_PLAN_HASH] = plan_hash(plan)
    if surge:
        meta["labels"][keys.LABEL_SURGE] = "true"
    apply_template(meta, pod_spec, r.template, owned_env(spec))
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": pod_spec,
    }
    # Everything a running sidecar cannot pick up live: its own pod spec and the routing plan
    # (the ConfigMap volume updates in place, but a sidecar reads the plan once at start).
    pod["metadata"]["annotations"] = {**meta.get("annotations", {}),
                                      keys.ANNOTATION_SPEC_HASH: content_hash(pod,
                                                                              plan.to_json())}
    return pod


def _role_urls(owner: Owner, role: str, replicas: int) -> str:
    """The replicas and the role's surge pod: the router must reach the new plan's pair during
    a plan-changing roll without being rolled itself (it probes a surge pod that does not
    exist as not ready)."""
    return ",".join([*(pod_url(owner, role, i) for i in range(replicas)),
                     pod_url(owner, role, None)])


def build_router(owner: Owner, spec: PDDeploymentSpec,
                 url_counts: Mapping[str, int] | None = None) -> tuple[Obj, Obj]:
    """The user-facing endpoint; it learns the replicas from env, so a scale rolls it. With a
    model source it reads the checkpoint's tokenizer and limits from there (the router's
    template mounts it, as the roles' do). `url_counts`: per role, the indices 0..n-1 it
    lists when they are not the replicas (a scale-down left a hole, drain.py)."""
    counts = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas,
              **(url_counts or {})}
    rlabels = selector(owner, keys.COMPONENT_ROUTER)
    env = [
        _env(keys.ENV_HTTP_PORT, keys.HTTP_PORT),
        _env(keys.ENV_MODEL_NAME, spec.model.name),
        _env(keys.ENV_BLOCK_SIZE, spec.blockSize),
        # Only another policy than the router's default, so existing routers keep their hash.
        *([_env(keys.ENV_ROUTER_POLICY, spec.router.policy)]
          if spec.router.policy != DEFAULT_ROUTER_POLICY else []),
        *([_env(keys.ENV_ROUTER_WORKERS, spec.router.workers)]
          if spec.router.workers != 1 else []),
        *([_env(keys.ENV_ROUTER_LOCAL_PREFILL_TOKENS, spec.router.localPrefillTokens)]
          if spec.router.localPrefillTokens != DEFAULT_LOCAL_PREFILL_TOKENS else []),
        *([_env(keys.ENV_ROUTER_NO_PREFILL, spec.router.noPrefill)]
          if spec.router.noPrefill != DEFAULT_NO_PREFILL else []),
        *([_env(keys.ENV_MODEL_SOURCE, spec.model.source)] if spec.model.source else []),
        _env(keys.ENV_PREFILL_URLS, _role_urls(owner, "prefill", counts["prefill"])),
        _env(keys.ENV_DECODE_URLS, _role_urls(owner, "decode", counts["decode"])),
        _env(keys.ENV_PREFILL_SERVICE, service_dns(owner, "prefill")),
        _env(keys.ENV_DECODE_SERVICE, service_dns(owner, "decode")),
        _env(keys.ENV_GRANT_KEY_FILE, keys.GRANT_KEY_FILE),
        _field_env(keys.ENV_POD_IP, "status.podIP"),
        *(builders_vllm.router_env() if spec.engine == "vllm" else []),
        *([_env(keys.ENV_API_KEY_FILE, keys.API_KEY_MOUNT_DIR)]
          if spec.router.apiKeySecretRef is not None else []),
        *tracing_env(owner, spec, keys.COMPONENT_ROUTER),
    ]
    container: Obj = {
        "name": keys.ROUTER_CONTAINER_NAME,
        "image": spec.router.image or spec.image,
        "command": SIDECAR_ROUTER,
        "env": env,
        "ports": [{"name": "http", "containerPort": keys.HTTP_PORT, "protocol": "TCP"}],
        "volumeMounts": [_grant_mount(), *_api_key_mounts(spec)],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "livenessProbe": _probe("/healthz", 10, 3),
        "readinessProbe": _probe("/readyz", 5, 3),
    }
    if spec.router.resources is not None:
        container["resources"] = {
            k: _quantities(v)
            for k, v in spec.router.resources.model_dump(exclude_none=True).items()
        }
    tmeta: Obj = {"labels": dict(rlabels)}
    tspec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [container],
        "volumes": [_grant_volume(owner), *_api_key_volumes(spec)],
    }
    apply_template(tmeta, tspec, spec.router.template, owned_env(spec))
    deployment: Obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, owner.name, labels(owner, keys.COMPONENT_ROUTER)),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": rlabels},
            "template": {"metadata": tmeta, "spec": tspec},
        },
    }
    service: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name, labels(owner, keys.COMPONENT_ROUTER)),
        "spec": {
            "type": "ClusterIP",
            "selector": dict(rlabels),
            "ports": [
                {"name": "http", "port": keys.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    return deployment, service


def build(owner: Owner, spec: PDDeploymentSpec, scraper: Scraper | None = None) -> Desired:
    plan = plan_of(spec)
    side = spec.kvTransfer.sideChannelPort
    pods: dict[Role, dict[int, Obj]] = {
        role: {
            i: build_pod(owner, spec, plan, role, i) for i in range(getattr(spec, role).replicas)
        }
        for role in ("prefill", "decode")
    }
    desired = Desired(
        plan=plan,
        configmap=build_configmap(owner, plan),
        services=[build_service(owner, role, getattr(spec, role), side)
                  for role in ("prefill", "decode")],
        pods=pods,
        surge_pods={role: build_pod(owner, spec, plan, role, getattr(spec, role).replicas,
                                    surge=True)
                    for role in ("prefill", "decode")},
    )
    if spec.router.enabled:
        desired.router_deployment, desired.router_service = build_router(owner, spec)
    desired.network_policies = build_network_policies(owner, spec, scraper)
    return desired


def with_indices(owner: Owner, spec: PDDeploymentSpec, desired: Desired,
                 indices: Mapping[Role, list[int]]) -> Desired:
    """`desired` with each given role's pods at these replica indices instead of 0..n-1 (a
    scale-down took out a replica other than the last: drain.py), and a router that lists
    every index up to the highest. A copy: `desired` is shared by the passes of a generation."""
    pods = dict(desired.pods)
    counts: dict[str, int] = {}
    for role, keep in indices.items():
        have = desired.pods[role]
        pods[role] = {i: have[i] if i in have else build_pod(owner, spec, desired.plan, role, i)
                      for i in keep}
        counts[role] = max(len(have), max(keep, default=-1) + 1)
    out = dataclasses.replace(desired, pods=pods)
    if desired.router_deployment is not None:
        out.router_deployment, out.router_service = build_router(owner, spec, counts)
    return out


def is_subset(want: Any, have: Any) -> bool:
    """Whether `have` (as the API server returns it, with defaults and extra entries added)
    still carries everything in `want`. Named lists match by name, other lists by containment,
    the way server-side apply merges them."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and is_subset(v, have[k]) for k, v in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        if want and all(isinstance(w, dict) and "name" in w for w in want):
            by_name = {h.get("name"): h for h in have if isinstance(h, dict)}
            return all(w["name"] in by_name and is_subset(w, by_name[w["name"]]) for w in want)
        if len(want) == len(have):
            return all(is_subset(w, h) for w, h in zip(want, have, strict=True))
        return all(any(is_subset(w, h) for h in have) for w in want)
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    return want == have or str(want) == str(have)

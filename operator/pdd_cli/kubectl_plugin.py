"""`kubectl pdd`: what a PDDeployment is doing on the cluster, rank by rank.

`kubectl get pdd` shows a routing summary; when a transfer misbehaves people need the whole
picture: which plan the pods actually mount, which pod (and IP, side-channel port) each rank
lives in, and what the operator said about it. The formatting functions here take plain object
dicts, so they are tested without a cluster; `main` only fetches those dicts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any, cast

from pdd_api import keys
from pdd_api.models import (
    API_GROUP,
    API_VERSION,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_LOCAL_PREFILL_TOKENS,
    ROLE_SCALE_KIND,
    ROLE_SCALE_PLURAL,
)
from pdd_api.plan import RoutingPlan
from pdd_api.quantity import plain_number
from pdd_cli.diagram import chunk_label, render_diagram, sides_title

Obj = Mapping[str, Any]
PLURAL = "pddeployments"
ROLES = ("prefill", "decode")
ROUTING_VOLUME = "routing"  # the pod volume the operator mounts the routing ConfigMap as
EXIT_OK, EXIT_INVALID, EXIT_UNUSABLE = 0, 1, 2


class PluginError(Exception):
    """A problem the user can act on (no such deployment, no routing yet); exit 1."""


def _meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def _owned_by(obj: Obj, pdd: Obj) -> bool:
    uid = _meta(pdd).get("uid")
    return any(ref.get("uid") == uid for ref in _meta(obj).get("ownerReferences") or [])


def routing_volume_configmap(pod: Obj) -> str | None:
    """The routing ConfigMap a pod mounts: the plan its sidecars really follow."""
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        cm = vol.get("configMap")
        if cm and vol.get("name") == ROUTING_VOLUME:
            return str(cm.get("name"))
    return None


def pick_routing_configmap(pdd: Obj, configmaps: Sequence[Obj], pods: Sequence[Obj]) -> Obj:
    """The live routing ConfigMap of `pdd`.

    The one its pods mount wins (during a rollout the newest pods' one); with no pods yet, the
    newest ConfigMap the deployment owns that holds a plan. Never a ConfigMap it does not own:
    a same-named object of someone else is exactly what the operator refuses to take over.
    """
    owned = [c for c in configmaps
             if _owned_by(c, pdd) and keys.ROUTING_CONFIGMAP_KEY in (c.get("data") or {})]
    if not owned:
        raise PluginError(f"{_meta(pdd).get('name')}: no routing ConfigMap owned by it yet "
                          "(is the operator running? see `kubectl pdd status`)")
    by_name = {_meta(c)["name"]: c for c in owned}
    for pod in sorted(pods, key=lambda p: str(_meta(p).get("creationTimestamp") or ""),
                      reverse=True):
        name = routing_volume_configmap(pod)
        if name in by_name:
            return by_name[name]
    return max(owned, key=lambda c: (str(_meta(c).get("creationTimestamp", "")),
                                     _meta(c)["name"]))


def role_of(pod: Obj) -> str | None:
    return (_meta(pod).get("labels") or {}).get(keys.LABEL_COMPONENT)


def _replica(pod: Obj) -> int:
    try:
        return int((_meta(pod).get("labels") or {}).get(keys.LABEL_REPLICA, -1))
    except ValueError:
        return -1


def _ready(pod: Obj) -> str:
    conds = (pod.get("status") or {}).get("conditions") or []
    return next((str(c.get("status")) for c in conds if c.get("type") == "Ready"), "Unknown")


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def _pods_of(pods: Sequence[Obj], role: str) -> list[Obj]:
    return sorted((p for p in pods if role_of(p) == role),
                  key=lambda p: (_replica(p), _meta(p).get("name", "")))


def side_channel_port(pdd: Obj) -> int:
    port = ((pdd.get("spec") or {}).get("kvTransfer") or {}).get("sideChannelPort", 5600)
    return int(port)


def plan_report(pdd: Obj, configmap: Obj, pods: Sequence[Obj]) -> str:
    """The diagram of the live plan, then every rank with the pods (IP:side-channel port) that
    run it: each replica pod of a role runs all of the role's TP ranks."""
    name, ns = _meta(pdd).get("name"), _meta(pdd).get("namespace")
    plan = RoutingPlan.from_json(configmap["data"][keys.ROUTING_CONFIGMAP_KEY])
    port = side_channel_port(pdd)
    lines = [render_diagram(plan, f"{ns}/{name}: {sides_title(plan)}  "
                                  f"(ConfigMap {_meta(configmap).get('name')})"), ""]
    rows = [["RANK", "PODS (IP:SIDE-CHANNEL PORT)", "READS", "NOTIFIES"]]
    reads = {d.rank: d for d in plan.decode_ranks}
    for role, tag, side in (("prefill", "P", plan.prefill), ("decode", "D", plan.decode)):
        role_pods = _pods_of(pods, role)
        for rank in range(side.tensor_parallel_size):
            where = ", ".join(
                f"{_meta(p).get('name')} "
                f"{(p.get('status') or {}).get('podIP') or '<no IP>'}:{port + rank}"
                for p in role_pods) or "<no pods>"
            if role == "decode":
                d = reads[rank]
                src = ", ".join(f"P{r.prefill_rank} [{chunk_label(r)}]" for r in d.reads)
                notes = ",".join(f"P{x}" for x in d.notifies)
            else:
                expected = plan.prefill_ranks[rank].expected_notifications
                src, notes = "-", f"frees after {expected} notification(s)"
            rows.append([f"{tag}{rank}", where, src, notes])
    lines += _table(rows, indent="")
    return "\n".join(lines)


def _age_key(event: Obj) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime")
               or _meta(event).get("creationTimestamp") or "")


def kv_memory(role_spec: Obj) -> tuple[str, str]:
    """How a role's KV pool is sized (`90%-of-GPU`, `4096-blocks`) and its host tier per rank
    (`8GiB/rank`, `-`): one word each, as the table splits on spaces."""
    blocks = role_spec.get("kvCacheBlocks")
    share = role_spec.get("gpuMemoryUtilization", DEFAULT_GPU_MEMORY_UTILIZATION)
    pool = f"{blocks}-blocks" if blocks is not None else f"{float(share) * 100:g}%-of-GPU"
    gib = role_spec.get("hostKVCacheGiB") or 0
    return pool, (f"{plain_number(gib)}GiB/rank" if gib > 0 else "-")


def _autoscaled(pdd: Obj, role: str) -> Obj | None:
    a = ((pdd.get("spec") or {}).get("autoscaling") or {}).get(role)
    return a if isinstance(a, dict) and a.get("enabled", True) is not False else None


def desired_replicas(pdd: Obj, role: str, scale: Obj | None = None) -> str:
    """The replicas of the role's owner, as the operator builds them: the planner's where it
    drives the role (spec's until it has decided), else those of the PDDRoleScale applied to
    it, else spec's (a spec another writer changed under a PDDRoleScale is not followed)."""
    spec_n = ((pdd.get("spec") or {}).get(role) or {}).get("replicas", 1)
    if _autoscaled(pdd, role) is None:
        return str(((scale or {}).get("spec") or {}).get("replicas", spec_n))
    auto = (((pdd.get("status") or {}).get("autoscaling") or {}).get(role) or {})
    return str(auto.get("desiredReplicas", spec_n))


def applied_role_scale(pdd: Obj, role: str, role_scales: Sequence[Obj]) -> Obj | None:
    """The PDDRoleScale the operator applies to one role of `pdd` (its status says so)."""
    name = _meta(pdd).get("name")
    return next((r for r in role_scales if (r.get("spec") or {}).get("deployment") == name
                 and (r.get("spec") or {}).get("role") == role
                 and (r.get("status") or {}).get("applied")), None)


def autoscaling_report(pdd: Obj, role_scales: Sequence[Obj] = ()) -> list[str]:
    """Per role: who sets its replicas (pdd's planner, a PDDRoleScale, or spec), current and
    desired, the bounds, and the planner's last reason with the metric values behind it."""
    driven = {role: applied_role_scale(pdd, role, role_scales) for role in ROLES}
    if not (pdd.get("spec") or {}).get("autoscaling") and not any(driven.values()):
        return []
    st = pdd.get("status") or {}
    rows = [["ROLE", "SCALER", "CURRENT", "DESIRED", "MIN", "MAX", "REASON", "SINCE", "WHY"]]
    for role in ROLES:
        a = _autoscaled(pdd, role)
        current = str((st.get(role) or {}).get("replicas", 0))
        scale = driven[role]
        if a is None and scale is not None:
            rows.append([role, f"{ROLE_SCALE_KIND}/{_meta(scale).get('name')}", current,
                         desired_replicas(pdd, role, scale), "-", "-", "-", "-",
                         str((scale.get("status") or {}).get("message") or "-")])
            continue
        if a is None:
            rows.append([role, "spec", current, desired_replicas(pdd, role), "-", "-", "-", "-",
                         f"spec.{role}.replicas (by hand, git, HPA/KEDA)"])
            continue
        auto = ((st.get("autoscaling") or {}).get(role) or {})
        rows.append([role, "pdd", current, desired_replicas(pdd, role),
                     str(a.get("minReplicas", 1)), str(a.get("maxReplicas", "?")),
                     str(auto.get("reason") or "-"), str(auto.get("lastScaleTime") or "-"),
                     str(auto.get("message") or "no decision yet")])
    return ["", "AUTOSCALING", *_table(rows)]


def request_paths(pdd: Obj) -> str:
    """Where the router prefills requests now: through the prefill pods (short uncached
    prompts on their decode), or, with no prefill ready, on the decode pods or nowhere."""
    router = (pdd.get("spec") or {}).get("router") or {}
    local = router.get("localPrefillTokens", DEFAULT_LOCAL_PREFILL_TOKENS)
    conds = {c.get("type"): c for c in (pdd.get("status") or {}).get("conditions") or []}
    dis = conds.get("Disaggregated")
    if dis is not None and dis.get("status") == "False":
        return f"requests: NOT DISAGGREGATED ({dis.get('reason')}): {dis.get('message')}"
    short = (f"prompts with at most {local} uncached tokens on their decode" if local
             else "never on the decode")
    return f"requests: prefilled on the prefill pods; {short}"


def status_report(pdd: Obj, pods: Sequence[Obj], events: Sequence[Obj], limit: int = 10,
                  role_scales: Sequence[Obj] = ()) -> str:
    meta, spec, st = _meta(pdd), pdd.get("spec") or {}, pdd.get("status") or {}
    gen, seen = meta.get("generation"), st.get("observedGeneration")
    lines = [f"{meta.get('namespace')}/{meta.get('name')}  generation {gen}, observed {seen}"
             + ("" if gen == seen else "  (operator has not caught up)")]
    if st.get("routingCase"):
        lines.append(f"routing: {st['routingCase']}: {st.get('routingSummary', '')}")
    lines.append(request_paths(pdd))
    lines += ["", "ROLES"]
    rows = [["ROLE", "TP", "DCP", "DESIRED", "PODS", "READY", "UPDATED", "KV-POOL", "HOST-KV",
             "KV-DTYPE"]]
    for role in ROLES:
        rs, rst = spec.get(role) or {}, st.get(role) or {}
        rows.append([role, str(rs.get("tensorParallelSize", "?")),
                     str(rs.get("decodeContextParallelSize", "?")),
                     desired_replicas(pdd, role, applied_role_scale(pdd, role, role_scales)),
                     str(rst.get("replicas", 0)), str(rst.get("readyReplicas", 0)),
                     str(rst.get("updatedReplicas", 0)), *kv_memory(rs),
                     str(rs.get("kvCacheDtype") or DEFAULT_KV_CACHE_DTYPE)])
    lines += _table(rows)
    lines += autoscaling_report(pdd, role_scales)
    lines += ["", "PODS"]
    rows = [["NAME", "ROLE", "REPLICA", "PHASE", "READY", "IP", "NODE"]]
    for p in sorted(pods, key=lambda p: (role_of(p) or "", _replica(p), _meta(p).get("name"))):
        status = p.get("status") or {}
        rows.append([str(_meta(p).get("name")), role_of(p) or "-", str(_replica(p)),
                     str(status.get("phase", "?")), _ready(p), str(status.get("podIP") or "-"),
                     str((p.get("spec") or {}).get("nodeName") or "-")])
    lines += _table(rows) if len(rows) > 1 else ["  <none>"]
    lines += ["", "CONDITIONS"]
    rows = [["TYPE", "STATUS", "REASON", "MESSAGE"]]
    for c in st.get("conditions") or []:
        rows.append([str(c.get("type")), str(c.get("status")), str(c.get("reason", "")),
                     str(c.get("message", ""))])
    lines += _table(rows) if len(rows) > 1 else ["  <none>"]
    lines += ["", f"EVENTS (last {limit})"]
    rows = [["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]]
    for e in sorted(events, key=_age_key)[-limit:]:
        inv = e.get("involvedObject") or e.get("regarding") or {}
        rows.append([_age_key(e), str(e.get("type", "")), str(e.get("reason", "")),
                     f"{str(inv.get('kind', '')).lower()}/{inv.get('name', '')}",
                     str(e.get("message") or e.get("note") or "").strip()])
    lines += _table(rows) if len(rows) > 1 else ["  <none>"]
    return "\n".join(lines)


class Cluster:
    """The few reads the plugin makes, as plain dicts, with the current kubeconfig context."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_kube_config(config_file=kubeconfig, context=context,
                                    client_configuration=cfg)
        except config.ConfigException as exc:
            raise PluginError(f"cannot load kubeconfig: {exc}") from None
        cfg.retries = 1  # a person is waiting: an unreachable API server is an error, fast
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen: dict[str, Any] = active or {}
        if context:
            chosen = next((c for c in contexts if c.get("name") == context), {})
        self.default_namespace = str((chosen.get("context") or {}).get("namespace") or "default")

    def _plain(self, obj: Any) -> Any:
        return self.api.sanitize_for_serialization(obj)

    def pdd(self, ns: str, name: str) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        try:
            obj = self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL,
                                                           name)
        except ApiException as exc:
            if exc.status == 404:
                raise PluginError(f"pddeployment {ns}/{name} not found") from None
            raise PluginError(f"cannot read pddeployment {ns}/{name}: {exc.status} "
                              f"{exc.reason}") from None
        return cast(dict[str, Any], obj)

    def pods(self, ns: str, name: str) -> list[Any]:
        sel = f"{keys.LABEL_INSTANCE}={name},{keys.LABEL_NAME}={keys.APP_NAME}"
        items = self.core.list_namespaced_pod(ns, label_selector=sel).items
        return [self._plain(p) for p in items]

    def configmaps(self, ns: str, name: str) -> list[Any]:
        sel = f"{keys.LABEL_INSTANCE}={name}"
        items = self.core.list_namespaced_config_map(ns, label_selector=sel).items
        return [self._plain(c) for c in items]

    def role_scales(self, ns: str) -> list[Any]:
        """The namespace's PDDRoleScales; none where their CRD is not installed."""
        from kubernetes.client.rest import ApiException

        try:
            out = self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, ns,
                                                            ROLE_SCALE_PLURAL)
        except ApiException as exc:
            if exc.status in (403, 404):
                return []
            raise PluginError(f"cannot list pddrolescales in {ns}: {exc.status} "
                              f"{exc.reason}") from None
        return list(cast(dict[str, Any], out).get("items") or [])

    def events(self, ns: str, names: Sequence[str]) -> list[Any]:
        wanted = set(names)
        items = self.core.list_namespaced_event(ns).items
        return [self._plain(e) for e in items if e.involved_object.name in wanted]


def cmd_plan(args: argparse.Namespace, k: Cluster) -> int:
    ns = args.namespace or k.default_namespace
    pdd = k.pdd(ns, args.name)
    pods = k.pods(ns, args.name)
    cm = pick_routing_configmap(pdd, k.configmaps(ns, args.name), pods)
    if args.output == "json":
        print(cm["data"][keys.ROUTING_CONFIGMAP_KEY])
    else:
        print(plan_report(pdd, cm, pods))
    return EXIT_OK


def cmd_status(args: argparse.Namespace, k: Cluster) -> int:
    ns = args.namespace or k.default_namespace
    pdd = k.pdd(ns, args.name)
    pods = k.pods(ns, args.name)
    names = [args.name, *(str(_meta(p).get("name")) for p in pods)]
    print(status_report(pdd, pods, k.events(ns, names), limit=args.events,
                        role_scales=k.role_scales(ns)))
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kubectl pdd", description=__doc__.splitlines()[0])
    ap.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    ap.add_argument("--context", help="kubeconfig context (default: the current one)")
    ap.add_argument("-n", "--namespace", help="default: the context's namespace")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="the live routing of a PDDeployment, rank by rank")
    p.add_argument("name")
    # Either side of the subcommand, as kubectl itself accepts `-n`.
    p.add_argument("-n", "--namespace", default=argparse.SUPPRESS)
    p.add_argument("-o", "--output", choices=["diagram", "json"], default="diagram")
    s = sub.add_parser("status", help="roles, pods, conditions and recent events")
    s.add_argument("name")
    s.add_argument("-n", "--namespace", default=argparse.SUPPRESS)
    s.add_argument("--events", type=int, default=10, help="how many recent events to show")
    v = sub.add_parser("validate", help="same as `pdd validate` (no cluster needed)")
    v.add_argument("-f", "--file", required=True, help="YAML file ('-' for stdin)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.command == "validate":
        from pdd_cli.main import main as pdd_main

        return pdd_main(["validate", "-f", args.file])
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import HTTPError

    try:
        k = Cluster(args.kubeconfig, args.context)
        return cmd_plan(args, k) if args.command == "plan" else cmd_status(args, k)
    except (PluginError, ValueError) as exc:  # ValueError: a routing ConfigMap that is no plan
        problem = str(exc)
    except ApiException as exc:
        problem = f"API server answered {exc.status} {exc.reason}"
    except HTTPError as exc:
        problem = f"cannot reach the API server: {exc}"
    print(f"kubectl pdd {args.command}: {problem}", file=sys.stderr)
    return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())

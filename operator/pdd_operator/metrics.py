"""Prometheus metrics of the operator (served on --metrics-port, default 8080)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("pdd_operator_reconciles_total", "Reconcile passes", ["result"])
ERRORS = Counter("pdd_operator_reconcile_errors_total", "Reconcile passes that failed")
LATENCY = Histogram(
    "pdd_operator_reconcile_duration_seconds", "Wall time of one reconcile pass",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ACTIONS = Counter("pdd_operator_actions_total", "Objects created, deleted or re-applied",
                  ["kind", "action"])
MANAGED = Gauge("pdd_operator_managed_objects", "Objects the operator owns, by kind", ["kind"])
DEPLOYMENTS = Gauge("pdd_operator_pddeployments", "PDDeployments the operator knows")
AUTOSCALE_DESIRED = Gauge("pdd_operator_autoscale_desired_replicas",
                          "Instances the autoscaling planner wants, per PDDeployment and role",
                          ["namespace", "name", "role"])
AUTOSCALE_DECISIONS = Counter("pdd_operator_autoscale_decisions_total",
                              "Autoscaling decisions by role, direction (up, down, hold) and "
                              "reason", ["role", "direction", "reason"])


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr=addr)

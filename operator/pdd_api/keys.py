"""Every label, annotation and environment key of the contract, named once.

The operator writes them, the sidecars and the pod runner read them; outside tooling (dashboards,
GitOps health checks) relies on them, so they change only with a version bump.
"""

from __future__ import annotations

from pdd_api.models import API_GROUP

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

"""What a PDDeployment may be called: the limits `pdd validate` and the webhook check, and the
CRD's CEL rules (crd.py) enforce in the API server, written once for both."""

from __future__ import annotations

MAX_NAME_LENGTH = 47  # leaves room for "-prefill-<i>" within a 63-character DNS label
# A role that spans pods (docs/lws.md): its LeaderWorkerSet's worker StatefulSet
# `<name>-prefill-<i>` labels its pods `controller-revision-hash: <statefulset>-<10-char hash>`,
# a label value of at most 63 characters (crd.name_lws_rule).
MAX_NAME_LENGTH_LWS = 41
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"  # also the CRD's CEL rule (crd.name_rule)


def lws_name_message(name: str) -> str:
    return (f"metadata.name: must be at most {MAX_NAME_LENGTH_LWS} characters when a role spans "
            "pods (gpusPerPod below tensorParallelSize: LeaderWorkerSet pods carry it in "
            f"63-character labels), got '{name}'")

"""pdd's Kubernetes operator: PDDeployment -> prefill/decode Pods, Services, routing ConfigMap.

Importing the package stays cheap (no kopf): the pure parts (builders, rollout, conditions) are
unit-tested without a cluster. `python -m pdd_operator` runs it; the kopf handlers live in
`pdd_operator.handlers` (`kopf run -m pdd_operator.handlers` works too).
"""

"""pdd's pure core: the PDDeployment API, its validation and the rank-routing planner.

Shared by the operator, the sidecars and users' CI; it imports only pydantic and pyyaml so a
GitOps pipeline can validate specs without a cluster, torch or NIXL.
"""

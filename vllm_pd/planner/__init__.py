"""Deployment planning (DistServe-style): profile an instance, simulate colocated and disaggregated
deployments on a workload, and pick the one with the most goodput per device under TTFT/TPOT SLOs."""

"""The backend instances and their live state.

The pool, circuit breakers, health checks, partitions, stalls, Kubernetes discovery, and the supervisor's role
changes.
"""

"""The Kubernetes API as the proxy reads it.

Pods, label selectors, LIST and WATCH. Imports nothing else of the router.
"""

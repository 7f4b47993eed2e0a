"""The running proxy.

Its routes (OpenAI, /health, /metrics), the admin API and the graceful drain.
"""

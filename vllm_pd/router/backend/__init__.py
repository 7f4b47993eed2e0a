"""Talking to the vLLM instances.

The HTTP/1.1 client, a backend's response and answer, its SSE stream, Retry-After, which backend addresses are
allowed.
"""

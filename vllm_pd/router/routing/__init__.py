"""Which instance serves a request.

The selection policies, and kv_aware's knowledge of which instance and which store holds a prompt's KV.
"""

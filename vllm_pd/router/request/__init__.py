"""A client request as the router reads it.

Its body, the KV fields a client may not send, its prompt's tokens and block hashes, and what the KV store
holds of it.
"""

"""The proxy's HTTP/1.1 server facing its clients.

Connections, requests and responses, their limits, client API keys, OpenAI-style errors.
"""

"""One request's way through the proxy.

Admission, the prefill leg, the decode leg and its relay to the client, every failure handled.
"""

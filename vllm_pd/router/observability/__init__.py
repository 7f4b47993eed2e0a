"""What the proxy tells about itself.

Prometheus metrics, leg timings, trace context and OTLP spans, the JSON request log.
"""

"""The PD proxy (``vllm-pd proxy``): a package per role, each importing only the ones listed before it.

* ``http/``: the HTTP/1.1 server facing clients, its limits, client API keys, OpenAI-style errors.
* ``backend/``: talking to the vLLM instances (HTTP client, responses, SSE, Retry-After, allowed addresses).
* ``k8s/``: the Kubernetes API as the proxy reads it (pods, label selectors, LIST and WATCH).
* ``request/``: a client request as the router reads it: body, prompt tokens, block hashes, store holdings.
* ``config.py``: the proxy's typed configuration (flags and YAML), validated at start-up.
* ``pool/``: the instances and their live state: health, partitions, stalls, Kubernetes discovery, supervisor.
* ``observability/``: Prometheus metrics, leg timings, trace context and OTLP spans, the request log.
* ``routing/``: which instance serves a request: policies, and where a prompt's KV already is (kv_aware).
* ``flow/``: one request's way through: admission, the prefill leg, the decode leg and its relay.
* ``server/``: the running proxy: its routes, the admin API, the graceful drain.
* ``cli/``: ``vllm-pd proxy`` and ``vllm-pd up``.

The KV store is reached only through its client (``connector/store/master_client.py``) and the protocol
package (its block keys: ``protocol/block_keys.py``); ``benchmarks/code_shape.py`` prints the import circles (none).
"""

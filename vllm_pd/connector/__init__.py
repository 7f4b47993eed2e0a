"""The PD connector (``PDConnector``, ``connector.py``): in layers, each importing only the ones listed before it.

* ``transport/``: move KV blocks between registered memory regions of two processes (tcp, shm, NIXL).
* ``deployment_secret.py``, ``config.py``: the deployment's secret; the connector's typed settings.
* ``device/``: the KV cache on its device: streams and events, staging, block copies, the KV geometry and layout.
* ``step_specs.py``: what the scheduler side tells a worker each step, as plain data.
* ``store/``: the KV block store (its scheduler and worker sides, its master).
* ``worker/``: the worker side: a dispatcher, the prefill sender, the decode loader, the release of prefill's KV.
* ``metadata.py``: a step (and the handshake) as vLLM carries it between the scheduler and the workers.
* ``announce_probe.py``, ``state_layout.py``, ``scheduler.py``: the scheduler side, in vLLM's EngineCore
  process (``state_layout``: a recurrent state's sharding, read from vLLM's state shapes).
* ``store_bridge.py``, ``store_group_bridge.py``: the store wired into both sides (one KV cache group;
  several attention groups).
* ``stats.py``: the counters vLLM logs and exports.
* ``connector.py``: the facade vLLM loads (``PDConnector``, registered from ``vllm_pd.connector.connector``).

Below them all, the wire both ends import: ``vllm_pd/protocol/``. worker/, device/ and transport/ import no
vLLM (the GPU harness runs them without it). tests/unit/imports/test_import_layers.py holds the order.
"""

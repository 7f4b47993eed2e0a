"""What two vllm-pd processes exchange: every message and frame, one place, one version.

The connector (prefill and decode workers, the scheduler side), its transports and KV store,
the store master and the proxy all import their wire from here, and this package imports
none of them, nor torch nor vLLM (tests/unit/imports/test_import_layers.py): it is the floor
they stand on. Only definitions live here - the messages, frame layouts, flags, sizes and
their encoding and checks; what moves them (sockets, shared memory, NIXL calls, torch
copies) lives with its user. One version for all of it: :data:`version.PROTOCOL_VERSION`.

Modules, one concern each (the map with who talks to whom: docs/design/protocol.md):

* ``version`` - the protocol's version and its history.
* ``transfer_params`` - ``kv_transfer_params`` between proxy, prefill and decode (JSON).
* ``kv_shape`` - an instance's KV cache shape, as the two sides of a transfer tell each other.
* ``control`` - the control messages riding on ``Transport.notify`` (msgpack).
* ``auth_handshake`` - the deployment-secret handshake every KV-plane connection opens with, and the seals after it.
* ``frames`` - the stream transports' frames: header, kinds, flags (one namespace), checksum kinds.
* ``hello_frame`` - the HELLO frame's payload: each end's endpoint and block channel's announcement.
* ``cross_memory_hello`` - the shm transport's cross-memory HELLOs: a process's memory probe, the offer, the answer.
* ``layer_plan`` - a PLAN frame's payload and the progress area its receiver polls.
* ``shm_ring`` - the shm transport's ring in /dev/shm: slots and control counters.
* ``nixl_messages`` - the NIXL transport's region layouts (its handshake) and PUSH and FETCH payloads.
* ``block_keys`` - the KV store's block keys, which every node, the master and the proxy compute alike.
* ``store_index`` - the store master's requests and replies.
* ``store_peer`` - a store node's fetch from another node's pool: grant, granted, release, released.

Importing the package imports none of its modules (each is imported by name), so a
process takes only the wire it speaks.
"""

"""The one version of everything two vllm-pd processes exchange (the ``vllm_pd.protocol`` package).

Every handshake that carries a version carries this one: the ``kv_transfer_params`` a
prefill answers with (``transfer_params.PROTOCOL_KEY``), the store master's every reply
(``store_index.Reply.version``) and the deployment-secret handshake's header
(``auth.HANDSHAKE_MAGIC``, then this as one byte). Any change to a message or frame of
this package bumps it (and the frame stream's magic, ``frames.MAGIC``, where the frames
change: a stream transport's peer of another frame format fails on it before a frame is read).

History (the kv_transfer_params' numbers, then of the whole package):

* 4 - a recurrent state group's shard layout (``kv_shape.StateLayout``) in the KV shape: decode of
  another TP takes its share of prefill's state.
* 3 - prefill's KV shape (``kv_shape``: TP, heads, KV cache groups) and every group's blocks in
  the transfer params; authenticated store master sessions and its ``Stats`` request; frames
  ``VPD5`` (layer plans). One version for the whole package since it was gathered here (the
  deployment-secret handshake's byte said 1 before).
* 2 - one ``transfer_id``; the master's snapshots carry the salt and the instance URL, ``Nodes``
  and ``Holders`` requests.
* 1 - the first.
"""

from __future__ import annotations

PROTOCOL_VERSION = 4

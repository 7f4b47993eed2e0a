"""vllm-pd: prefill/decode disaggregation for vLLM.

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in
every process it starts (API server, engine core, each worker), so it must be
cheap and idempotent.
"""

from __future__ import annotations

from vllm_pd.vllm_logging import vllm_logger

__version__ = "0.1.0"

CONNECTOR_NAME = "PDConnector"

logger = vllm_logger(__name__)


def register() -> None:
    """Register the PD connector (and the custom ops) with vLLM. Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_pd.connector.connector", CONNECTOR_NAME)
    _register_ops()


def _register_ops() -> None:
    try:
        from vllm_pd import ops
    except ImportError:  # ops are optional until their issue lands
        return
    register_ops = getattr(ops, "register", None)
    if register_ops is not None:
        register_ops()

"""Loggers of our code that runs inside vLLM's processes (connector, ops, the plugin hook).

vLLM configures logging for its own hierarchy only: a handler on the ``vllm``
logger, which does not propagate to the root. A plain ``getLogger(__name__)``
(``vllm_pd.connector.worker.worker``) has no handler in those processes, so its info
lines vanish and its warnings reach stderr only through logging's last resort,
without vLLM's format or process prefix. A logger named under ``vllm.plugins``
goes through vLLM's handler and ``VLLM_LOGGING_LEVEL``; outside vLLM (the proxy
imports the connector's protocol and release) it propagates to the root logger
like any other.
"""

from __future__ import annotations

import logging

VLLM_PLUGIN_LOGGERS = "vllm.plugins"


def vllm_logger(module: str) -> logging.Logger:
    """The logger of ``module`` (pass ``__name__``) under vLLM's hierarchy: ``vllm.plugins.<module>``."""
    return logging.getLogger(f"{VLLM_PLUGIN_LOGGERS}.{module}")

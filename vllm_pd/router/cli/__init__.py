"""The commands.

``vllm-pd proxy`` and ``vllm-pd up`` (with its local cluster of vLLM servers).
"""

"""Small random-weight Hugging Face models that vLLM loads offline (tests, benchmarks, ``vllm-pd up``)."""

from vllm_pd.small_model.cache import ensure_default_model, ensure_lora, ensure_model
from vllm_pd.small_model.spec import LoraSpec, ModelSpec, ModelSpecError
from vllm_pd.small_model.writer import write_model

__all__ = [
    "LoraSpec",
    "ModelSpec",
    "ModelSpecError",
    "ensure_default_model",
    "ensure_lora",
    "ensure_model",
    "write_model",
]

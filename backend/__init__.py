"""tritonllm: LLM serving behind Triton with TensorRT-LLM's model-repository contract."""

__version__ = "0.1.0"

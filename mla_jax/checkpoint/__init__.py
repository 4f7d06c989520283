"""Checkpoints: Hugging Face DeepSeek safetensors in and out (streamed tensor by tensor), FP8
block-quantized weights, and the built-in tiny model."""

"""The LSE merge of two partial attention results: the Pallas kernel (Triton lowering)."""

from .pallas_triton import merge_attn_states

__all__ = ["merge_attn_states"]

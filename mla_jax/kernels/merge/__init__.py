"""The LSE merge of two partial attention results: the Pallas kernel (Triton lowering) and
its pure-jnp reference (``reference.merge_attn_states``, the same signature)."""

from . import reference
from .pallas_triton import MergeConfig, merge_attn_states

__all__ = ["MergeConfig", "merge_attn_states", "reference"]

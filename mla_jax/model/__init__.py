"""The DeepSeek model: its configuration, layers (RMSNorm, MLP, rope), MLA attention over the
paged latent cache, the mixture of experts, and the decoder that stacks them."""

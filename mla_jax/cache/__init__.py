"""The paged latent KV cache: its arrays and writes, the block allocator, the block manager
(prefix caching), and the host-built metadata that tells a step where each token reads and
writes."""

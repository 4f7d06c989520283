"""Several GPUs on jax.sharding: the mesh, parameter and cache shardings, and the kernels under
shard_map."""

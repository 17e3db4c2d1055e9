"""The KV cache: page allocator and prefix cache, the host tier, transfers."""

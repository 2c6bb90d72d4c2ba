"""Model implementations over the paged KV cache, and the architecture registry."""

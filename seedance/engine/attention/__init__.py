"""Attention over the paged KV cache: the backend interface, the torch reference backend and the
Triton backend, chosen by `select_backend`."""

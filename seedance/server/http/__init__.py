"""HTTP/1.1 on h11: the connection loop and routing, the OpenAI-compatible API with its
parameter validation and error bodies, and the operations routes (health, readiness, metrics)."""

"""What operators see and tune: metrics, the server trace, structured logs, TLS and socket
options, interpreter tuning."""

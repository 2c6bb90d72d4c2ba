"""The only door between trio and the engine thread: the engine bridge and request handles,
admission control, batch negotiation and the engine factory."""

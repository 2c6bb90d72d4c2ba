"""Building blocks of the models: projections, rotary embeddings, RMSNorm and the sampler."""

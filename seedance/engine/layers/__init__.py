"""Building blocks of the models: rotary embeddings, RMSNorm and the sampler."""

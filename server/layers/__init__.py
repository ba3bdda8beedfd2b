"""Model building blocks: attention backends, MoE dispatch, norms, rotary embeddings, sampler."""

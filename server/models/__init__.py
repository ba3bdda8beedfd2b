"""Model families (Llama/Mistral, Qwen2, Mixtral, Qwen2-MoE), checkpoint loading, built-in models."""

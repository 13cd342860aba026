"""The chat engine: one thread per chat model that owns its MLX state, its lanes, queue and prompt cache."""

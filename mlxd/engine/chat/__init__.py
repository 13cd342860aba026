"""The chat engine: one thread per chat model owns its MLX state, lanes, queue and cache."""

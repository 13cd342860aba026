"""Pure policy: lane choice, KV admission and the drain state machine (no MLX, no I/O)."""

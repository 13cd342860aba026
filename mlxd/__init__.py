"""mlxd: an MLX inference daemon with continuous batching, a live TOML policy and a dashboard."""

__version__ = "0.1.0"

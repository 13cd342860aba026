"""Speculative decoding in the batch lane (docs/batching.md#speculative-decoding)."""

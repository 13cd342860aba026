"""Rerankers (``kind = "rerank"``): cross-encoders and yes/no LMs on the embedding engine."""

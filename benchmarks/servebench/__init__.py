"""The pieces of ``benchmarks/serving.py``, one idea per module."""

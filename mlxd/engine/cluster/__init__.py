"""The cluster: one model sharded over machines (mx.distributed); rank 0 and its followers."""

"""The cluster: one model sharded over several machines with mx.distributed; rank 0's hooks and the followers."""

"""The embedding engine: one thread per embedding model, batching its requests into masked passes."""

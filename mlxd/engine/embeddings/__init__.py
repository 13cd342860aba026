"""The embedding engine: one thread per embedding model, its requests in masked passes."""

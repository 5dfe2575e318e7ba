"""KV caches that roll back: one contract, a dynamic, a growing and a static implementation, and the direct pass."""

"""The CPU backend of lmcache-platform: KV tensors shared through POSIX shared memory."""

"""The CUDA backend of lmcache-platform: KV tensors shared through CUDA IPC."""

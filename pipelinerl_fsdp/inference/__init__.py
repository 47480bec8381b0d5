"""Generation: KV cache, sampling, and (later) the engines that run on inference ranks."""

"""Generation: the engine interface, its implementations (vLLM, the pure-PyTorch reference), their factory and
placement, the KV cache and sampling of the reference engine, and the inference-rank loop (`worker.py`)."""

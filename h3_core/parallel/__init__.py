"""Several devices for one request: worker processes over torch.distributed (`workers`), the DiT's
sequence split with all-to-all over heads (`sequence`), and optional FSDP-style weight sharding
(`sharding`). See README "Several GPUs"."""

from .workers import ModelSpec, ParallelRunner, ParallelWorkerError, serve_ranks

__all__ = ["ModelSpec", "ParallelRunner", "ParallelWorkerError", "serve_ranks"]

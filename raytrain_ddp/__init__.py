"""raytrain_ddp: cluster-agnostic PyTorch DDP on Ray Train."""

__version__ = "0.1.0"

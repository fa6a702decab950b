"""gpucloud: a self-hosted GPU cloud for AI training and inference."""

__version__ = "0.1.0"

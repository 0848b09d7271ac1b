"""autotune: find the fastest PyTorch training configuration that keeps model quality."""

__version__ = "0.1.0"

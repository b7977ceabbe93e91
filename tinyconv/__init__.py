"""tinyconv: a small, readable CNN framework with convolutions split by kernels across machines."""

__version__ = "0.1.0"

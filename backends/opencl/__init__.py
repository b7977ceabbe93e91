"""OpenCL backend (in progress)."""

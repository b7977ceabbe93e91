"""The distributed convolution, one idea per file (see docs/how-it-works.md)."""

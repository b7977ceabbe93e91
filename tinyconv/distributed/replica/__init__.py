"""Data parallelism and the hybrid: slices of the batch, one idea per file (README, "Where things are")."""

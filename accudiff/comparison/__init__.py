"""Per-tensor statistics and the comparison table."""

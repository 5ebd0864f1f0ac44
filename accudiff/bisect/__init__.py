"""Isolating what fails: partitions TensorRT can and cannot convert (and, later, bisectors)."""

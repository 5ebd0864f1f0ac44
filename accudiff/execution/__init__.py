"""The process boundary: worker processes (or Ray tasks), the typed messages that cross it, and the engine they run."""

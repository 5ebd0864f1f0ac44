"""Report folder, summary.json, console summary."""

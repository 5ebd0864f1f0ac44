"""Accuracy checks in a team's own test suite: the checker behind the pytest plugin (checker.py) and the
baseline files it holds a test to (baselines.py). `pytest_plugin.py` only registers them with pytest."""

"""Suspects tested at the output: the candidate run again with nodes kept in higher precision (trial.py),
the suspects and the search over every changed node (verify.py, search.py, readings.py), and which part of
a candidate's narrowing its loss comes from (loss_split.py). Shared by compare and `bisect precision`."""

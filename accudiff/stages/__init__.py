"""The stages of a run that take its settings and hand work to worker processes: samples grouped by the
If branches they take (branches.py), each group's plan, candidate and runs (group.py), and the judgement
of the table (judge.py). Verification is verification/."""

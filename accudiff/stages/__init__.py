"""The stages of a run that hand work to worker processes, each given only the small values of the run's
settings it reads (settings.py): samples grouped by the If branches they take (branches.py), each group's
plan, candidate and runs (group.py), and the judgement of the table (judge.py). Verification is verification/."""

"""The vocabulary of judging: tolerances, mergeable statistics (and their C kernel), what each output decides, decision figures and their intervals, the table."""

"""A run and its chain of jobs: run paths, submit, rehearse, the ledger, bad nodes and the run's flags."""

"""A run's history, read back: where its wall clock went (:mod:`.goodput`), what its failures and saves measure and
the save interval they ask for (:mod:`.measures`), and where its logs are (:mod:`.sources`)."""

"""A run's directory (:mod:`opskit.run.paths`) and the chain of jobs whose state lives in it (:mod:`opskit.run.chain`:
which queued jobs are the run's, the ledger, the bad-node list, the kill switch and the finished and stopped flags)."""

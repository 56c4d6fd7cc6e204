"""What runs inside a job's allocation: the job script's one entry (:mod:`.job`: the chain's stop flags, the
steps, the signals, the ledger line), each node's part of a step (:mod:`.node_step`), recovery on a spare
(:mod:`.in_job`) and the pre-flight check of the nodes (:mod:`.preflight`, :mod:`.node_check`)."""

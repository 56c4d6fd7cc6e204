"""Submitting a run: a spec rendered into its job script and DeepSpeed config (:mod:`.render`), and the chained job
array put in the queue, after the run's queued jobs, without its bad nodes (:mod:`.submit`)."""

"""What keeps a run looked after from the login node between jobs: copying its logs, TensorBoard and emissions to
the Hub, GCS or a folder (:mod:`.sync`), and the hourly schedule of that copy and of ``opskit status --alert``
(:mod:`.cron`)."""

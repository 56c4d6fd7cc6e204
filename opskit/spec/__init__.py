"""Training specs: the schema, finding and loading specs (``$VAR`` placeholders), ``specs new``, and the planner."""

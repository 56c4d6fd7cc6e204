"""`opskit report`: one self-contained HTML page per run (issue 49). :mod:`opskit.report.facts` gathers what the
page shows, :mod:`opskit.report.page` draws it."""

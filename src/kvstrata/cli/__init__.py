"""The ``kvstrata`` command line (``main``) and what its operator commands show: the integrity scan
(``check``), the progress bar (``progress``) and ``stats`` for a person (``stats_view``)."""

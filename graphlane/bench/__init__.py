"""``graphlane bench`` and the scripts in ``benchmarks/``: figures measured through real
daemons started for the purpose (:mod:`.daemon`), each beside its baseline in the same
run. :mod:`.suite` is the command; the other modules are one figure family each."""

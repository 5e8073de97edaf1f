"""Harnesses for the tests and benchmarks, not part of the installed server or its clients: a real
`linstream serve` in a subprocess on a free port (`local_server`), and the fault run that checks
every session against what its client saw (`chaos`)."""

"""linstream clients: Python SDK, CLI, latency benchmark and load tester."""

"""linstream clients: Python SDK, CLI, latency benchmark and load tester.

The folder is imported as `linstream.clients`: pyproject.toml's `package-dir` maps the package to this
folder, so `linstream.clients.<name>` is `clients/<name>.py`. Neither grep for the dotted name nor an editor's
"go to file" follows that mapping; look for the file under `clients/`.
"""

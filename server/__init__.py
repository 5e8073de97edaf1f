"""linstream server: FastAPI app, sessions, and the continuous-batching engine.

The folder is imported as `linstream.server`: pyproject.toml's `package-dir` maps the package to this
folder, so `linstream.server.<name>` is `server/<name>.py`. Neither grep for the dotted name nor an editor's
"go to file" follows that mapping; look for the file under `server/`.
"""

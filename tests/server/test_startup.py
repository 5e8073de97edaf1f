"""What `linstream serve` imports before it answers its first request: nothing it needs only
later or elsewhere (torch's compiler stack, the Redis and HTTP clients, transformers), each of
which costs the cold start CPU time (docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys

# what `serve` imports on its way to answering (linstream/cli.py): the command line, the
# settings, the engines' loading, the app and uvicorn's protocol
SERVE = ["linstream.cli", "linstream.server.core.settings", "linstream.server.engine.loading",
         "linstream.server.app", "linstream.server.api.connections"]
LATER = ["torch._dynamo", "torch._inductor", "sympy", "transformers", "redis", "httpx"]


def test_serve_imports_nothing_it_needs_only_later():
    code = f"import sys, {', '.join(SERVE)}; print(sorted(m for m in {LATER!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

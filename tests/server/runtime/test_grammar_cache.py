"""The compiled-grammar cache is kept per API key: the same grammar sent by two keys is compiled
twice, so how fast one key's grammar compiles tells it nothing of another key's requests; a key
sending its own grammar again finds it cached."""
import httpx
import pytest
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

pytestmark = pytest.mark.asyncio

A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


async def test_the_same_grammar_from_two_keys_compiles_twice():
    app = create_app(Settings(models=["linear"], api_keys=["key-a", "key-b"], store="memory"))
    async with app.router.lifespan_context(app):
        grammars = app.state.runtime.engines["linear"].grammars
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
            body = {"prompt": "A", "max_tokens": 2, "guided_regex": "(yes|no) [a-z]{1,6}"}
            counts = []
            for key in (A, B, A, B):
                r = await c.post("/v1/completions", json=body, headers=key)
                assert r.status_code == 200, r.text
                counts.append(grammars.compiles)
    assert counts[1] - counts[0] == 1  # B's first: compiled again, not A's
    assert counts[3] == counts[1]  # each key's second: from its own cache

"""What the engine's tests share: a prompt, a tokenizer for the tiny models' 64 ids, the check
that a state is the one a prefill of given tokens gives, and a handler's delivery of a job."""
import asyncio

import torch
from linstream.model.generate import prefill
from linstream.server.engine.engine import Engine, Job

PROMPT = [1, 2, 3, 4, 5]


def assert_state_of(model, state, tokens):
    """The state is the one a prefill of exactly these tokens gives."""
    want = prefill(model, tokens, model.init_state(1))
    assert int(state.position[0]) == len(tokens)
    for a, b in zip(state.layers, want.layers):
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=2e-5, rtol=1e-4)
    return want


class Tok:  # the tiny models' 64 ids as single letters
    token_bytes = [bytes([65 + i % 26]) for i in range(64)]
    eos_ids = frozenset()

    def decoder(self):
        from linstream.model.tokenizer import IncrementalDecoder
        return IncrementalDecoder(self)


async def deliver(eng: Engine, job: Job) -> list[int]:
    """What the server's handler does: hand each token over, tell the engine; after a failure
    hand over no more, and drop what the state could not take (server.streaming, runtime)."""
    toks = []
    while True:
        kind, ev = await asyncio.wait_for(job.events.get(), 20)
        if kind == "done":
            return toks[:job.consumed] if job.finish == "error" else toks
        if job.finish == "error" and job.yielded >= job.consumed:
            continue
        toks.append(ev["token"])
        job.yielded += 1
        eng.wake()

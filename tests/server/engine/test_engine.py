"""The engine and in-process `Generation` run one core (model/generate.py): from the same prompt
and parameters they give the same tokens, the same text piece by piece, the same finish and the
same final state, whether the generation ends on a stop string, an eos token or the length limit
(where text held back for a stop that never came is sent with the last token)."""
import asyncio

import pytest
import torch
from linstream.model import tokenizer_file
from linstream.model.config import PRESETS
from linstream.model.generate import Generation, TextStream, prefill
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.model.tokenizer import Tokenizer
from linstream.server.engine.engine import Engine, Job

from tests.model.test_golden import CKPT, GOLDEN, GOLDEN_IDS, PROMPT
from tests.server.engine.common import Tok

CHUNK = 64  # the engine's prefill chunk, and Generation's: one prefill pass either way


@pytest.fixture(scope="module")
def shipped():
    return LM.load(CKPT), Tokenizer(tokenizer_file(CKPT))


def in_process(model, tok, prompt, params):
    """([(token, text)], finish, final state) from Generation."""
    g = Generation(model, tok, prefill(model, prompt, model.init_state(1), CHUNK), params)
    events = [(e.token, e.text) for e in g]
    return events, g.finish_reason, g.state


def served(model, tok, prompt, params):
    """The same from the engine, its events handed over one by one as the server's handler does."""
    async def run():
        eng = Engine("m", model, tok, slots=3, prefill_chunk=CHUNK, max_batch=8)
        eng.start()
        try:
            slot = await eng.call(eng.alloc)
            await eng.prefill(slot, prompt)
            job = Job(slot, params, asyncio.get_running_loop())
            eng.submit(job)
            events = []
            while (ev := await asyncio.wait_for(job.events.get(), 30))[0] == "token":
                events.append((ev[1]["token"], ev[1]["text"]))
                job.yielded += 1
                eng.wake()
            await job.finished.wait()
            return events, job.finish, await eng.call(lambda: eng.read(slot))
        finally:
            eng.stop()
    return asyncio.run(run())


def assert_same(a, b):
    (ev_a, finish_a, state_a), (ev_b, finish_b, state_b) = a, b
    assert ev_a == ev_b and finish_a == finish_b
    assert torch.equal(state_a.position, state_b.position)
    torch.testing.assert_close(state_a.next_logits, state_b.next_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("stop, finish, text", [
    ([], "length", GOLDEN),
    (["in the"], "stop", "s not to the world,\nAnd, "),  # the stop string is not sent, nor what came with it
    # "And" comes last: it could start the stop, and is held back until the limit sends it
    (["And so"], "length", GOLDEN),
    ([" all the world,\nAnd so"], "length", GOLDEN),  # six tokens held back, all sent with the last
])
def test_shipped_model_served_as_in_process(shipped, stop, finish, text):
    model, tok = shipped
    params = SamplingParams(max_tokens=len(GOLDEN_IDS), temperature=0, stop=stop)
    got = in_process(model, tok, tok.encode(PROMPT), params)
    assert_same(got, served(model, tok, tok.encode(PROMPT), params))
    events, reason, _ = got
    assert reason == finish and "".join(t for _, t in events) == text
    assert [t for t, _ in events] == GOLDEN_IDS[:len(events)]
    if stop and finish == "length":  # the last token's event carries what was held back
        assert events[-1][1] == "And" if stop == ["And so"] else " all the world,\nAnd"


def test_eos_ends_both_with_stop(shipped):
    model, tok = shipped
    tok = Tokenizer(tokenizer_file(CKPT))
    tok.eos_ids = frozenset({GOLDEN_IDS[9]})  # " in": the tenth token, its first time
    params = SamplingParams(max_tokens=len(GOLDEN_IDS), temperature=0)
    got = in_process(model, tok, tok.encode(PROMPT), params)
    assert_same(got, served(model, tok, tok.encode(PROMPT), params))
    assert got[1] == "stop" and [t for t, _ in got[0]] == GOLDEN_IDS[:10]


class Utf8Tok(Tok):
    """Every third id is the first byte of a three-byte character, which no token completes: a
    stream that ends on one has its decoder flushed (U+FFFD) at the length limit."""
    token_bytes = [b"\xe2" if i % 3 == 0 else bytes([65 + i % 26]) for i in range(64)]


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-softmax", "tiny-mamba"])
def test_sampled_with_stops_and_penalties(preset):
    torch.manual_seed(0)
    model = LM(PRESETS[preset]).eval()
    for seed in range(6):
        params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed, stop=["AB", "QQ"],
                                frequency_penalty=0.3)
        assert_same(in_process(model, Utf8Tok(), [1, 2, 3, 4, 5], params),
                    served(model, Utf8Tok(), [1, 2, 3, 4, 5], params))


def test_text_stream_flushes_at_the_limit_only():
    """What a TextStream holds back: half a character and a possible stop's start; at the
    limit both are sent, before it neither."""
    tok, params = Utf8Tok(), lambda n: SamplingParams(max_tokens=n, stop=["BC"])  # noqa: E731
    ts = TextStream(tok, params(3))
    assert [ts.feed(t) for t in (4, 0, 1)] == [("E", None), ("", None), ("\ufffdB", "length")]  # the stop's "B"
    ts = TextStream(tok, params(2))
    assert [ts.feed(t) for t in (4, 0)] == [("E", None), ("\ufffd", "length")]  # the decoder's half character
    ts = TextStream(tok, params(3))
    assert [ts.feed(t) for t in (1, 2)] == [("", None), ("", "stop")]

"""Prefill + step decode == one full forward; sampling; stop sequences; tokenizer round trip."""
import torch
from linstream.model.generate import Generation, decode_one_token, prefill
from linstream.model.sampling import SamplingParams, StopMatcher, adjust_logits, logits_to_probs, sample


def test_prefill_then_steps_equals_full_forward(tiny):
    ids = torch.randint(0, tiny.cfg.vocab_size, (1, 30))
    with torch.no_grad():
        full, _ = tiny(ids)
    s = prefill(tiny, ids[0, :17], tiny.init_state(1), chunk=5)
    torch.testing.assert_close(s.next_logits, full[:, 16], atol=2e-5, rtol=1e-4)
    for t in range(17, 30):
        logits, s = decode_one_token(tiny, ids[:, t], s)
        torch.testing.assert_close(logits, full[:, t], atol=2e-5, rtol=1e-4)


def test_batched_decode_equals_separate(tiny):
    """Rows at different positions stepped together give each row's solo result."""
    a = prefill(tiny, [1, 2, 3], tiny.init_state(1))
    b = prefill(tiny, [4, 5, 6, 7, 8, 9, 10], tiny.init_state(1))
    pool = tiny.init_state(2)
    pool.assign([0], a)
    pool.assign([1], b)
    both, _ = decode_one_token(tiny, torch.tensor([11, 12]), pool)
    la, _ = decode_one_token(tiny, torch.tensor([11]), a)
    lb, _ = decode_one_token(tiny, torch.tensor([12]), b)
    torch.testing.assert_close(both, torch.cat([la, lb]), atol=2e-5, rtol=1e-4)


def test_top_k_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    one = lambda v: torch.tensor([v])  # noqa: E731
    p = logits_to_probs(logits, one(1.0), one(2), one(1.0))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum().item() > 0.999
    p = logits_to_probs(logits, one(1.0), one(0), one(0.5))  # first token has ~64 % mass
    assert p[0, 0].item() == 1.0


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(3, 50)
    ps = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, seed=9)]
    a = sample(logits, ps, [p.generator() for p in ps])
    b = sample(logits, ps, [p.generator() for p in ps])
    solo = sample(logits[2:], ps[2:], [ps[2].generator()])
    assert torch.equal(a, b) and a[1] == logits[1].argmax() and a[2] == solo[0]


def test_bias_and_penalties_follow_openai_and_stay_per_row():
    """l[v] + bias[v] - presence * (c[v] > 0) - frequency * c[v], each row from its own counts;
    a penalised row draws alone what it draws beside unpenalised rows."""
    logits = torch.zeros(2, 6)
    ps = [SamplingParams(logit_bias={1: 5.0, 4: -1.0}, presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    out = adjust_logits(logits, ps, [{1: 2, 3: 1}, {1: 9}])
    assert out[0].tolist() == [0.0, 5.0 - 0.5 - 0.5, 0.0, -0.75, -1.0, 0.0] and out[1].tolist() == [0.0] * 6
    assert logits.abs().sum() == 0  # the model's logits (and their logprobs) are left as they were
    logits = torch.randn(3, 50)
    ps = [SamplingParams(temperature=0.9, seed=1, frequency_penalty=1.5, logit_bias={3: 2.0}), SamplingParams(seed=2),
          SamplingParams(temperature=0.0, presence_penalty=2.0)]
    counts = [{int(logits[0].argmax()): 3}, {}, {int(logits[2].argmax()): 1}]
    both = sample(logits, ps, [p.generator() for p in ps], counts)
    solo = [sample(logits[i:i + 1], ps[i:i + 1], [ps[i].generator()], counts[i:i + 1])[0] for i in range(3)]
    assert both.tolist() == [int(x) for x in solo] and both[2] != logits[2].argmax()


def test_stop_matcher_never_emits_the_stop():
    m = StopMatcher(["END"])
    out = []
    for piece in ["ab", "cE", "N", "D", "zz"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "abc" and stopped


def test_generation_respects_max_tokens_and_seed(tiny):
    s = prefill(tiny, [1, 2, 3], tiny.init_state(1))

    class Tok:  # a stand-in vocabulary for the tiny model's 64 ids
        token_bytes = [bytes([65 + i % 26]) for i in range(64)]
        eos_ids = frozenset()
        decoder = lambda self: __import__("linstream.model.tokenizer", fromlist=["IncrementalDecoder"]).IncrementalDecoder(self)  # noqa: E731
    params = SamplingParams(max_tokens=9, temperature=0.9, seed=3)
    a = [e.token for e in Generation(tiny, Tok(), s.clone(), params)]
    b = [e.token for e in Generation(tiny, Tok(), s.clone(), params)]
    assert len(a) == 9 and a == b


class NaiveStops:
    """The reference: search the whole held-back text for every stop on each feed (quadratic)."""

    def __init__(self, stops):
        self.stops, self.pending = [s for s in stops if s], ""

    def feed(self, text):
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def test_stop_matcher_agrees_with_the_naive_search():
    """Random stops over a small alphabet (many overlaps and self-overlaps), random pieces: the
    same text out, the same text held back, the same stop, at every feed."""
    import random
    rng = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"
        word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
        stops = [word(rng.randint(0, 6)) for _ in range(rng.randint(0, 4))]
        fast, slow = StopMatcher(stops), NaiveStops(stops)
        for piece in [word(rng.randint(0, 5)) for _ in range(rng.randint(1, 10))]:
            got = fast.feed(piece)
            assert got == slow.feed(piece) and fast.pending == slow.pending, (stops, piece)
            if got[1]:
                break


def test_long_self_overlapping_stop_holds_back_only_what_could_start_it():
    """A stop of 256 'a's then 'b' over a stream of 'a's: exactly the last 256 are held back,
    and the 'b' stops with every earlier 'a' sent."""
    m = StopMatcher(["a" * 256 + "b"])
    sent = "".join(m.feed("a")[0] for _ in range(2000))
    assert sent == "a" * (2000 - 256) and m.pending == "a" * 256
    assert m.feed("ab") == ("a", True)

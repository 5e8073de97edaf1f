"""The fast sampler against its readable reference: the same probabilities bit for bit, the same
seeded token for every row, whatever the batch."""
import random

import pytest
import torch
from linstream.model import sampling
from linstream.model.sampling import SamplingParams, logits_to_probs, reference_probs, sample

V = 2048


def reference_tokens(logits, params, uniforms):
    """The draw as it is defined: argmax for greedy rows, else u against the vocabulary-order CDF
    of reference_probs (the full torch sort)."""
    temp = torch.tensor([p.temperature or 1.0 for p in params])
    cdf = reference_probs(logits, temp, torch.tensor([p.top_k for p in params]),
                          torch.tensor([p.top_p for p in params], dtype=torch.float32)).cumsum(-1)
    drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return torch.where(torch.tensor([p.temperature == 0 for p in params]), logits.argmax(-1), drawn)


def random_batch(rng: random.Random, B: int):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(B, V, generator=g) * rng.choice([0.5, 2.0, 5.0, 20.0])
    if rng.random() < 0.25:
        logits = (logits * 2).round() / 2  # many equal logits, so cuts fall between ties
    if rng.random() < 0.15:
        logits[:, :100] = float("-inf")
    params = [SamplingParams(temperature=rng.choice([0.0, 0.3, 0.8, 1.0, 1.5]),
                             top_k=rng.choice([0, 0, 0, 1, 5, 40, 100, 600, 5000]),
                             top_p=rng.choice([1.0, 1.0, 0.95, 0.9, 0.5, 0.99]),
                             seed=rng.randrange(1 << 30)) for _ in range(B)]
    return logits, params


def uniforms(params):
    return torch.cat([torch.rand(1, generator=p.generator()) for p in params])


def test_logits_to_probs_is_reference_probs_bit_for_bit():
    rng = random.Random(0)
    for _ in range(60):
        logits, params = random_batch(rng, rng.choice([4, 16, 64]))
        args = (logits, torch.tensor([p.temperature or 1.0 for p in params]), torch.tensor([p.top_k for p in params]),
                torch.tensor([p.top_p for p in params], dtype=torch.float32))
        assert torch.equal(logits_to_probs(*args), reference_probs(*args))


def test_a_cut_between_equal_logits_keeps_what_torch_sort_keeps():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(4))
    logits[:4] = 0.0
    logits[:4, :10] = 1.0  # rows 0-3: ten tied leaders, of which top-k 4 keeps four
    args = (logits, torch.ones(8), torch.full((8,), 4), torch.ones(8))
    assert torch.equal(logits_to_probs(*args), reference_probs(*args))
    assert (logits_to_probs(*args) > 0).sum(-1).tolist() == [4] * 8


def test_sample_draws_the_reference_token_for_every_row():
    rng = random.Random(1)
    for _ in range(80):
        logits, params = random_batch(rng, rng.choice([1, 3, 8, 64]))
        got = sample(logits, params, [p.generator() for p in params])
        assert torch.equal(got, reference_tokens(logits, params, uniforms(params)))


def test_each_row_draws_alone_what_it_draws_in_the_batch():
    rng = random.Random(2)
    logits, params = random_batch(rng, 25)
    both = sample(logits, params, [p.generator() for p in params])
    alone = [int(sample(logits[i:i + 1], [p], [p.generator()])[0]) for i, p in enumerate(params)]
    assert both.tolist() == alone


def test_rows_without_filters_skip_the_sort_and_defer_only_near_a_boundary(monkeypatch):
    """Plain rows (top-k 0, top-p 1) decide without logits_to_probs for nearly every draw, and the
    same as the reference; a uniform on a boundary between two tokens is left to the reference."""
    calls = []
    real = sampling.logits_to_probs
    monkeypatch.setattr(sampling, "logits_to_probs", lambda x, *a: calls.append(len(x)) or real(x, *a))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, V, generator=g) * 4
    params = [SamplingParams(seed=i) for i in range(64)]
    for _ in range(10):
        got = sample(logits, params, [p.generator() for p in params])
        assert torch.equal(got, reference_tokens(logits, params, uniforms(params)))
        params = [SamplingParams(seed=p.seed + 64) for p in params]
    assert sum(calls) < 0.1 * 640
    # u exactly where the first token's mass ends: undecided
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    token, decided = sampling._draw_plain(x, torch.tensor([0.25]))
    assert not decided.item()
    token, decided = sampling._draw_plain(x, torch.tensor([0.125]))
    assert decided.item() and token.item() == 0


@pytest.mark.parametrize("B", [1, 64])
def test_greedy_rows_take_the_argmax_and_leave_their_generator_alone(B):
    logits = torch.randn(B, V)
    params = [SamplingParams(temperature=0.0, seed=5) for _ in range(B)]
    gens = [p.generator() for p in params]
    assert torch.equal(sample(logits, params, gens), logits.argmax(-1))
    assert all(torch.equal(g.get_state(), params[0].generator().get_state()) for g in gens)


def test_rows_with_filters_draw_the_reference_token_without_its_second_pass():
    """_draw_filtered's decided rows are reference_draw's tokens: peaked and flat rows, cuts past
    its head, top-k beyond the head, ties, -inf and NaN logits; it decides nearly all rows without ties."""
    rng = random.Random(5)
    decided = total = 0
    for _ in range(40):
        B = rng.choice([4, 16, 64])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        x = torch.randn(B, V, generator=g) * rng.choice([0.3, 1.0, 3.0, 8.0])
        ties = rng.random() < 0.25
        if ties:  # few distinct logits: nearly every cut falls between equal ones, left to the reference
            x = (x * 2).round() / 2
        if rng.random() < 0.2:
            x[:, :50] = float("-inf")
        if rng.random() < 0.1:
            x[0] = float("nan")
        top_k = torch.tensor([rng.choice([0, 0, 1, 5, 40, 300, 1000, 5000]) for _ in range(B)])
        top_p = torch.tensor([rng.choice([1.0, 0.99, 0.95, 0.9, 0.5, 0.1]) for _ in range(B)], dtype=torch.float32)
        u = torch.rand(B, generator=g)
        tokens, ok = sampling._draw_filtered(x, top_k, top_p, u)
        want = sampling.reference_draw(x, torch.ones(B), top_k, top_p, u)
        assert torch.equal(tokens[ok], want[ok])
        if not ties:
            decided, total = decided + int(ok.sum()), total + B
    assert decided > 0.97 * total


def test_a_filtered_row_leaves_ties_at_its_cut_and_boundary_draws_to_the_reference():
    x = torch.zeros(4, V)
    x[:, :10] = 1.0  # ten tied leaders
    u = torch.full((4,), 0.35)
    # top-k 4 cuts between the ties: which four stay is torch.sort's choice
    _, ok = sampling._draw_filtered(x, torch.full((4,), 4), torch.ones(4), u)
    assert not ok.any()
    # top-k 10 keeps all ten: decided, and the fourth of them
    tokens, ok = sampling._draw_filtered(x, torch.full((4,), 10), torch.ones(4), u)
    assert ok.all() and (tokens == 3).all()
    # u where the third token's mass ends: undecided
    _, ok = sampling._draw_filtered(x, torch.full((4,), 10), torch.ones(4), torch.full((4,), 0.3))
    assert not ok.any()


def test_the_filtered_cut_keeps_the_ranks_the_reference_keeps():
    """_cut's count of kept ranks is reference_probs' count of tokens with probability > 0, row
    for row (logits spread enough that no kept token's probability underflows)."""
    rng = random.Random(6)
    for _ in range(30):
        B = rng.choice([4, 16, 64])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        x = torch.randn(B, V, generator=g) * rng.choice([0.3, 1.0, 3.0, 8.0])
        top_k = torch.tensor([rng.choice([0, 0, 1, 5, 40, 300, 1000, 5000]) for _ in range(B)])
        top_p = torch.tensor([rng.choice([1.0, 0.99, 0.95, 0.9, 0.5, 0.1]) for _ in range(B)], dtype=torch.float32)
        _, n, lead = sampling._cut(x.numpy(), top_k, top_p)
        want = (reference_probs(x, torch.ones(B), top_k, top_p) > 0).sum(-1)
        assert torch.equal(n, want) and torch.equal(lead, n)


def test_finite_rows_finds_each_bad_row():
    from linstream.model.sampling import finite_rows
    x = torch.randn(4, 50)
    x[1, 7], x[3, 0] = float("nan"), float("-inf")
    assert finite_rows(x) == [True, False, True, False]
    assert finite_rows(x.bfloat16()) == [True, False, True, False]  # the torch path
    assert finite_rows(x[2:3]) == [True]

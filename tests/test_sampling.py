import pytest
import torch

from speculant.errors import SpeculantError
from speculant.sampling import SamplingConfig, probs, sample


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    p = probs(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(p, torch.softmax(logits / 2.0, -1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([0.5, 3.0, 1.0, 2.0, -1.0])
    p = probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [False, True, False, True, False]
    assert torch.allclose(p[[1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert (p > 0).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p[:2], torch.tensor([0.5, 0.3]) / 0.8)
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.81))
    assert (p > 0).tolist() == [True, True, True, False]
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.1))
    assert (p > 0).tolist() == [True, False, False, False]  # the top token always stays


def test_top_k_then_top_p_batched():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    p = probs(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.9))
    assert p.shape == (2, 4)
    assert torch.allclose(p.sum(-1), torch.ones(2))
    assert p[0, 3] == 0 and p[1, 0] == 0


def test_seeded_sampling_repeats_and_differs_by_seed():
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = [sample(p, SamplingConfig(1.0, seed=7).generator()).tolist() for _ in range(2)]
    assert a[0] == a[1]
    g1, g2 = SamplingConfig(1.0, seed=7).generator(), SamplingConfig(1.0, seed=8).generator()
    draws1 = [sample(p, g1).tolist() for _ in range(20)]
    draws2 = [sample(p, g2).tolist() for _ in range(20)]
    assert draws1 != draws2


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": 1.5}, "top-p"),
    ({"top_k": -1}, "top-k"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(SpeculantError, match=match):
        SamplingConfig(**kwargs)


def test_top_token_is_argmax_with_the_first_index_on_ties():
    from speculant.sampling import top_token

    x = torch.randn(5, 151936, generator=torch.Generator().manual_seed(3))
    assert torch.equal(top_token(x), x.argmax(-1))
    tied = torch.zeros(2, 1000)
    tied[:, [7, 500, 999]] = 1.0
    assert top_token(tied).tolist() == [7, 7] and int(top_token(tied[0])) == 7

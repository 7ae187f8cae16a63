"""Token weights, weighted mean and RDA: properties and golden numbers from numpy."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco_cli.core.merge import MergeAccumulator, radial_directional_average, token_weight, weighted_mean


def test_token_weight_is_tokens_squared_over_steps():
    assert token_weight(c_tokens=6000, c_steps=3) == 12_000_000.0
    assert token_weight(0, 5) == 0.0 and token_weight(100, 0) == 0.0


def numpy_rda(vectors, weights):
    """An independent RDA in float64 numpy, straight from the formula."""
    vectors = [np.asarray(v, dtype=np.float64) for v in vectors]
    w = np.asarray(weights, dtype=np.float64)
    norms = np.array([np.linalg.norm(v) for v in vectors])
    units = [v / n if n > 0 else v * 0 for v, n in zip(vectors, norms)]
    mean_norm = (w * norms).sum() / w.sum()
    direction = sum(wi * u for wi, u in zip(w, units)) / w.sum()
    return mean_norm * direction / np.linalg.norm(direction)


def test_rda_golden_numbers():
    deltas = [[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0]]
    weights = [token_weight(300, 3), token_weight(100, 1), token_weight(200, 4)]  # 30000, 10000, 10000
    # by hand: norms 5, 2, 1; mean norm (150000+20000+10000)/50000 = 3.6;
    # mean unit (30000*(0.6,0.8) + 10000*(0,1) + 10000*(-1,0))/50000 = (0.16, 0.68)
    direction = np.array([0.16, 0.68]) / np.hypot(0.16, 0.68)
    expected = 3.6 * direction
    result = radial_directional_average([torch.tensor(d) for d in deltas], weights)
    np.testing.assert_allclose(result.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(result.numpy(), numpy_rda(deltas, weights), atol=1e-6)


def test_weighted_mean_golden_numbers():
    result = weighted_mean([torch.tensor([1.0, -2.0]), torch.tensor([4.0, 0.5])], [1.0, 3.0])
    np.testing.assert_allclose(result.numpy(), [(1 + 12) / 4, (-2 + 1.5) / 4], atol=1e-6)


@given(count=st.integers(1, 12), size=st.integers(2, 200), norm=st.floats(1e-3, 1e3), seed=st.integers(0, 10**6))
def test_rda_of_equal_norms_keeps_that_norm(count, size, norm, seed):
    generator = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(size, generator=generator) for _ in range(count)]
    vectors = [v / v.norm() * norm for v in vectors]
    weights = torch.rand(count, generator=generator).add(0.1).tolist()
    merged = radial_directional_average(vectors, weights)
    assert float(merged.norm()) == pytest.approx(norm, rel=1e-5)
    np.testing.assert_allclose(merged.numpy(), numpy_rda(vectors, weights), rtol=1e-4, atol=1e-5 * norm)


@given(count=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_rda_of_identical_inputs_is_that_input(count, seed):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    merged = radial_directional_average([vector] * count, [float(i + 1) for i in range(count)])
    torch.testing.assert_close(merged, vector, rtol=1e-5, atol=1e-6)


@given(seed=st.integers(0, 10**6), scale=st.floats(0.01, 100), count=st.integers(1, 6))
def test_weighted_mean_is_linear(seed, scale, count):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(32, generator=generator) for _ in range(count)]
    ys = [torch.randn(32, generator=generator) for _ in range(count)]
    weights = torch.rand(count, generator=generator).add(0.1).tolist()
    combined = weighted_mean([x + scale * y for x, y in zip(xs, ys)], weights)
    torch.testing.assert_close(
        combined, weighted_mean(xs, weights) + scale * weighted_mean(ys, weights), rtol=1e-4, atol=1e-4
    )
    # scaling every weight by the same factor changes nothing
    torch.testing.assert_close(
        weighted_mean(xs, [w * 7 for w in weights]), weighted_mean(xs, weights), rtol=1e-5, atol=1e-6
    )
    # token weights grow as tokens squared over steps
    assert token_weight(2 * count, 1) == 4 * token_weight(count, 1)


def test_rda_falls_back_to_the_weighted_mean_when_directions_cancel():
    merged = radial_directional_average([torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])], [1.0, 1.0])
    assert torch.equal(merged, torch.zeros(2))
    # nearly cancelling: direction tiny but above the threshold keeps RDA's norm
    nearly = radial_directional_average([torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1e-3])], [1.0, 1.0])
    assert float(nearly.norm()) == pytest.approx(1.0, rel=1e-3)


def test_a_plain_mean_shrinks_where_rda_does_not():
    vectors = [torch.eye(16)[i] for i in range(16)]  # orthogonal unit vectors
    assert float(weighted_mean(vectors, [1.0] * 16).norm()) == pytest.approx(0.25)
    assert float(radial_directional_average(vectors, [1.0] * 16).norm()) == pytest.approx(1.0)


def test_accumulator_merges_embeddings_by_mean_and_the_rest_by_rda():
    accumulator = MergeAccumulator({"embed": (2,), "w": (2,)}, mean_names={"embed"})
    accumulator.add({"embed": torch.tensor([1.0, 0.0]), "w": torch.tensor([1.0, 0.0])}, 1.0)
    accumulator.add({"embed": torch.tensor([0.0, 1.0]), "w": torch.tensor([0.0, 1.0])}, 1.0)
    merged = accumulator.result()
    torch.testing.assert_close(merged["embed"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(merged["w"], torch.tensor([0.5, 0.5]) * 2**0.5)
    assert accumulator.count == 2


def test_zero_weights_merge_to_nothing():
    accumulator = MergeAccumulator({"w": (3,)})
    accumulator.add({"w": torch.ones(3)}, token_weight(0, 10))
    assert torch.equal(accumulator.result()["w"], torch.zeros(3))
    with pytest.raises(ValueError, match="exactly the fragment's tensors"):
        accumulator.add({"v": torch.ones(3)}, 1.0)

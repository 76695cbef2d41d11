"""The equivalence tests' tolerance: fp32 roundoff of reordered sums passes, a real error
does not, and a failure says every number."""

from __future__ import annotations

import pytest
import torch

from tests.autopar.runtime.closeness import assert_trains_alike


def _row_parallel_matmul() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (64 x 1024) @ B (1024 x 32) three ways: in float64, in fp32 on one device, and in
    fp32 as four tensor-parallel shards of the inner dim summed afterwards (Megatron's row
    split, as a compiled model computes it)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 1024, generator=generator, dtype=torch.float64)
    b = torch.randn(1024, 32, generator=generator, dtype=torch.float64)
    exact = a @ b
    single = a.float() @ b.float()
    sharded = sum(
        (a[:, k : k + 256].float() @ b[k : k + 256].float() for k in range(0, 1024, 256)),
        start=torch.zeros(64, 32),
    )
    return sharded, single, exact


def test_a_sharded_sum_is_within_the_roundoff_of_one_device() -> None:
    sharded, single, exact = _row_parallel_matmul()
    assert not torch.equal(sharded, single)  # the orders differ, so do the bits
    assert_trains_alike(sharded, single, exact, "row-parallel matmul")


def test_one_element_off_by_ten_ppm_of_the_tensors_scale_is_caught_and_explained() -> None:
    # fp32 roundoff of these 1024-term sums is about 4e-7 of the largest value
    sharded, single, exact = _row_parallel_matmul()
    wrong = sharded.clone()
    wrong[3, 5] += 1e-5 * float(exact.abs().max())
    with pytest.raises(AssertionError) as failure:
        assert_trains_alike(wrong, single, exact, "row-parallel matmul")
    message = str(failure.value)
    assert "row-parallel matmul: compiled is" in message
    assert "at (3, 5)" in message
    assert "single-device fp32 roundoff" in message


def test_a_missing_shard_is_caught() -> None:
    sharded, single, exact = _row_parallel_matmul()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 1024, generator=generator, dtype=torch.float64).float()
    b = torch.randn(1024, 32, generator=generator, dtype=torch.float64).float()
    with pytest.raises(AssertionError):
        assert_trains_alike(sharded - a[:, :256] @ b[:256], single, exact, "three of four shards")


def test_losses_compare_as_a_sequence() -> None:
    exact = [4.1588830833596715, 4.0512, 3.9]
    single = [4.158883, 4.0512004, 3.8999996]
    assert_trains_alike([4.1588831, 4.0512004, 3.9000001], single, exact, "losses")
    with pytest.raises(AssertionError, match="losses: compiled is"):
        assert_trains_alike([4.1588831, 4.0513, 3.9], single, exact, "losses")

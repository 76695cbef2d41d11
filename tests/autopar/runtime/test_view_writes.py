"""A model that writes in place through slices and selects of an intermediate tensor
trains on 2x2 gloo ranks as on one device, free, data and tensor parallel: the writes made
functional (``autopar_passes.functionalize``) carry their gradients too."""

from __future__ import annotations

import pytest

from autopar.testing.ranks import run_ranks
from tests.autopar.runtime.closeness import assert_same_training
from tests.autopar.runtime.view_writes import compare_view_writes

pytestmark = pytest.mark.multirank
STYLES = [None, "dp", "tp"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return {r["case"]: r for r in run_ranks(compare_view_writes, 4, (STYLES,))[0]}


@pytest.mark.parametrize("case", ["free", "dp", "tp"])
def test_one_step_equals_one_device(results: dict[str, dict], case: str) -> None:
    assert_same_training(results[case])

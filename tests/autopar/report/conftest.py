from __future__ import annotations

import pytest

import autopar
from autopar_examples.models import build
from autopar_plans.plan import Plan


@pytest.fixture(scope="module")
def planned() -> Plan:
    """gpt-tiny on two nodes of two devices, a batch of 8, no pipeline."""
    model, inputs = build("gpt-tiny", device="meta", batch_size=8)
    mesh = autopar.Mesh.cluster(nodes=2, gpus_per_node=2, device="h100-sxm")
    return autopar.plan(model, mesh, inputs, stages=1)

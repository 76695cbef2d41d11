"""The offload request (``autopar_plans.offload``): how options and hints spell it, and the
policies the planner tries, cheapest first."""

from __future__ import annotations

import pytest

from autopar_plans.offload import (
    AUTO_OFFLOAD,
    KINDS,
    Offload,
    OffloadRequest,
    offload_request,
)


def test_auto_tries_every_policy_parameters_last_and_never_without_the_optimizer():
    assert [o.kinds for o in AUTO_OFFLOAD.candidates()] == [
        (),
        ("optimizer",),
        ("activations",),
        ("optimizer", "activations"),
        ("optimizer", "parameters"),
        ("optimizer", "activations", "parameters"),
    ]


def test_parameters_alone_force_the_optimizer_on_and_the_rest_off():
    request = offload_request("parameters")
    assert request == OffloadRequest(optimizer="on", activations="off", parameters="on")
    assert [o.kinds for o in request.candidates()] == [("optimizer", "parameters")]
    assert offload_request("optimizer,parameters") == request


@pytest.mark.parametrize(
    ("spelled", "optimizer"),
    [
        ({"parameters": "on"}, "on"),
        ({"parameters": True, "optimizer": "auto"}, "on"),
        ({"parameters": "auto", "optimizer": "off"}, "off"),
    ],
)
def test_a_mapping_with_parameters_on_forces_the_optimizer(spelled, optimizer):
    request = offload_request(spelled)
    assert request.optimizer == optimizer
    assert all(o.optimizer for o in request.candidates() if o.parameters)


def test_parameters_auto_without_the_optimizer_never_offload_them():
    request = offload_request({"optimizer": "off"})
    assert not any(o.parameters for o in request.candidates())


@pytest.mark.parametrize(
    "spelled", [{"parameters": "on", "optimizer": "off"}, {"parameters": True, "optimizer": False}]
)
def test_parameters_on_with_the_optimizer_off_says_what_to_do(spelled):
    with pytest.raises(ValueError, match=r"needs the optimizer offloaded too.*parameters to off"):
        offload_request(spelled)
    with pytest.raises(ValueError, match="needs the optimizer"):
        OffloadRequest(**{k: "on" if v in ("on", True) else "off" for k, v in spelled.items()})
    with pytest.raises(ValueError, match="needs the optimizer"):
        Offload(parameters=True)


def test_none_turns_every_kind_off_and_a_plan_round_trips():
    assert offload_request("none") == OffloadRequest(**dict.fromkeys(KINDS, "off"))
    used = Offload(optimizer=True, parameters=True)
    assert offload_request(used).candidates() == [used]


def test_unknown_kinds_name_the_kinds():
    with pytest.raises(ValueError, match="optimizer, activations, parameters"):
        offload_request("weights")


@pytest.mark.parametrize(
    ("offload", "words"),
    [
        (Offload(), "nothing"),
        (Offload(optimizer=True), "optimizer states"),
        (Offload(optimizer=True, activations=True), "optimizer states and activations"),
        (Offload(optimizer=True, parameters=True), "optimizer states and parameters"),
        (
            Offload(optimizer=True, activations=True, parameters=True),
            "optimizer states, activations and parameters",
        ),
    ],
)
def test_describe_names_the_kinds_in_words(offload, words):
    assert offload.describe() == words

"""Optimizers and learning-rate rules for training with large batches (``docs/large_batch.md``).

- ``LARS`` (You, Gitman & Ginsburg 2017) and ``LAMB`` (You et al. 2019): SGD with momentum
  and Adam, each layer's step scaled by a trust ratio of whole-parameter norms, so they
  step a sharded compiled model (DTensor parameters, ZeRO masters) as one device would.
  ``trust_ratios()`` reports the last step's ratios; ``layerwise_groups(model)`` leaves
  biases and norm gains out by the user's shapes.
- ``scaled_lr`` (linear or square-root scaling to the global batch, a number or a compiled
  model's plan) and ``warmup_schedule`` (Goyal et al. 2017's gradual warm-up, a
  ``LambdaLR``).
"""

from autopar.optim.lamb import LAMB
from autopar.optim.lars import LARS
from autopar.optim.layerwise import is_bias_or_norm, layerwise_groups
from autopar.optim.norms import global_norms
from autopar.optim.schedule import (
    LinearWarmup,
    global_batch_of,
    scaled_lr,
    warmup_from,
    warmup_schedule,
)

__all__ = [
    "LAMB",
    "LARS",
    "LinearWarmup",
    "global_batch_of",
    "global_norms",
    "is_bias_or_norm",
    "layerwise_groups",
    "scaled_lr",
    "warmup_from",
    "warmup_schedule",
]

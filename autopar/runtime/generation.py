"""``generate`` on a compiled causal language model: greedy decoding, as Hugging Face's
``model.generate(input_ids, max_new_tokens=k)`` does it by default.

The compiled model holds no KV cache, so each new token runs the whole sequence again. The
sequence is held at one length, the prompt's plus ``max_new_tokens``, padded on the right:
one program (``runtime.calls``) serves every step. Padding on the right changes nothing a
causal model computes at the positions before it; the first step checks that by running
the prompt under two different paddings, and refuses a model whose outputs there differ
(one that attends to later positions, or mixes a batch's sequences), where padding would
change the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopar_plans.errors import UsageError

# a model's logits at every position of ``tokens`` [batch, length]
Logits = Callable[[torch.Tensor], torch.Tensor]


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: ``.logits`` (Hugging Face), the first of a tuple,
    or the output itself."""
    found = getattr(output, "logits", None)
    if found is None:
        found = output[0] if isinstance(output, tuple | list) else output
    if not isinstance(found, torch.Tensor) or found.dim() != 3:
        raise UsageError(
            "generate needs a language model whose output is its logits, [batch, "
            f"sequence, vocabulary] (or has .logits); this one gave {type(found).__name__}"
        )
    return found


def _token_ids(value: int | list[int] | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


@torch.no_grad()
def greedy(
    logits: Logits,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
) -> torch.Tensor:
    """The prompt and up to ``max_new_tokens`` tokens after it, each the most likely next
    one; a sequence that produced an end-of-sequence token is continued with
    ``pad_token_id``, and decoding stops once every sequence has."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise UsageError("generate takes input_ids of shape [batch, prompt length]")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens={max_new_tokens}: generate at least one token")
    batch, prompt = input_ids.shape
    eos = _token_ids(eos_token_id)
    if eos and pad_token_id is None:
        pad_token_id = eos[0]  # as Hugging Face does, with a warning there
    filler = pad_token_id if pad_token_id is not None else 0
    tokens = torch.full((batch, prompt + max_new_tokens), filler, dtype=input_ids.dtype)
    tokens = tokens.to(input_ids.device)
    tokens[:, :prompt] = input_ids
    _check_causal(logits, tokens, prompt, filler)
    unfinished = torch.ones(batch, dtype=torch.bool, device=tokens.device)
    end = prompt
    for position in range(prompt, prompt + max_new_tokens):
        scores = logits(tokens)[:, position - 1, :].float()
        chosen = scores.argmax(dim=-1).to(tokens.dtype)
        if eos:
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, filler))
            unfinished &= ~torch.isin(chosen, torch.tensor(eos, device=chosen.device))
        tokens[:, position] = chosen
        end = position + 1
        if eos and not bool(unfinished.any()):
            break
    return tokens[:, :end]


def _check_causal(logits: Logits, tokens: torch.Tensor, prompt: int, filler: int) -> None:
    """The prompt's logits are the same whatever follows it, else refuse."""
    if tokens.shape[1] == prompt:
        return
    other = tokens.clone()
    other[:, prompt:] = filler + 1 if filler == 0 else filler - 1
    first, second = logits(tokens)[:, :prompt], logits(other)[:, :prompt]
    if not torch.allclose(first.float(), second.float(), rtol=1e-4, atol=1e-5):
        raise UsageError(
            "generate pads the sequence on the right, which changes nothing only in a "
            "causal model; this model's outputs at the prompt depend on what follows it "
            f"(they moved by {float((first - second).abs().max()):.3g}): generate with the "
            "model on one device"
        )

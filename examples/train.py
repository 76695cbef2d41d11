"""A training script of the usual shape, compiled by autopar; launch it with torchrun.

    torchrun --standalone --nproc-per-node 4 -m autopar_examples.train --mesh 2x2 --steps 20
    torchrun --standalone --nproc-per-node 4 -m autopar_examples.train --mesh 2x2 --steps 20 \\
        --checkpoint ckpt --resume 10

A Hugging Face Llama built from a config (its defaults, tiny sizes; no download), called
with ``input_ids`` and ``labels`` for its own loss, AdamW under a cosine schedule, gradient
clipping with ``torch.nn.utils.clip_grad_norm_``, a sharded checkpoint through
``torch.distributed.checkpoint``'s standard state-dict API, which a later run resumes from
(under any mesh), and at the end ``model.eval()`` and ``generate`` for a few tokens.
Nothing in it is autopar's but ``autopar.compile``: the process group comes from
torchrun's environment, the plan from the first call. With ``--out`` rank 0 writes each
step's loss and gradient norm, and the generated tokens, as JSON
(``tests/autopar/runtime/test_torchrun.py`` runs it so, against the same loop on one
process).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import autopar

VOCAB = 64


def build_model(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def batch_at(step: int, batch: int = 4, length: int = 16) -> torch.Tensor:
    """The global batch of ``step``: the same on every rank (autopar's default input mode)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def make_optimizer(model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)


def norm_value(norm: torch.Tensor) -> float:
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def train(
    model: nn.Module,
    steps: int,
    *,
    start: int = 0,
    checkpoint: str | None = None,
    save_at: int | None = None,
    max_norm: float = 0.5,
) -> list[tuple[float, float]]:
    """Steps ``start`` to ``steps``; resumes from ``checkpoint`` when ``start`` > 0, saves
    there after step ``save_at``. Returns (loss, gradient norm) per step."""
    optimizer, schedule = make_optimizer(model, steps)
    if start:
        _load(model, optimizer, schedule, checkpoint)
    history = []
    for step in range(start, steps):
        tokens = batch_at(step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        history.append((float(loss.detach()), norm_value(norm)))
        if checkpoint is not None and step + 1 == save_at:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}
            dcp.save(state, checkpoint_id=checkpoint)
    return history


def continue_prompt(model: nn.Module, new_tokens: int = 4) -> list[list[int]]:
    """After training, in eval mode: the tokens greedy decoding puts after a prompt (the
    model's ``generate``; the compiled model's runs on a program of its own)."""
    model.eval()
    prompt = batch_at(-1, batch=2, length=6)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    model.train()
    return generated[:, prompt.shape[1] :].tolist()


def _load(model: nn.Module, optimizer: Any, schedule: Any, checkpoint: str | None) -> None:
    """The standard resume: the fresh model's and optimizer's state dicts, filled in place
    by ``dcp.load``, set back."""
    if checkpoint is None:
        raise SystemExit("--resume needs --checkpoint DIR")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    schedule.load_state_dict(state["schedule"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autopar_examples.train", description=__doc__)
    parser.add_argument("--mesh", default="2", help="mesh shape, such as 4 or 2x2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", help="a directory for the sharded checkpoint")
    parser.add_argument("--save-at", type=int, help="save after this many steps")
    parser.add_argument("--resume", type=int, default=0, help="resume at this step")
    parser.add_argument("--out", help="rank 0 writes the losses and norms here (JSON)")
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.mesh.split("x"))
    names = ("dp", "tp")[: len(shape)] if len(shape) <= 2 else None
    device = "h100-sxm" if torch.cuda.is_available() else "cpu"  # the preset it is costed for
    mesh = autopar.Mesh(shape, names, device=device)
    torch.set_num_threads(1)
    tokens = batch_at(0)
    # planned here, from a batch of the loop's shape (the process group from torchrun's
    # environment); a resumed run starts from other weights, which the checkpoint replaces
    model = autopar.compile(
        build_model(seed=1 if args.resume else 0),
        mesh,
        example_kwargs={"input_ids": tokens, "labels": tokens},
    )
    history = train(
        model, args.steps, start=args.resume, checkpoint=args.checkpoint, save_at=args.save_at
    )
    generated = continue_prompt(model)
    if dist.get_rank() == 0:
        for step, (loss, norm) in enumerate(history, start=args.resume):
            print(f"step {step}: loss {loss:.4f}, gradient norm {norm:.4f}")
        print(f"after training, a prompt continues with {generated}")
        if args.out:
            with open(args.out, "w") as file:
                record = {"history": history, "generated": generated}
                json.dump({**record, "world": dist.get_world_size()}, file)
    assert all(math.isfinite(loss) for loss, _ in history)
    del model  # before the group goes: see tests/autopar/runtime/torchrun_train.py
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

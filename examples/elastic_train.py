"""A training script that survives losing a rank: launch it under torchrun with restarts.

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 \\
        -m autopar_examples.elastic_train --steps 20 --checkpoint ckpt

Each step ends with a sharded checkpoint (``autopar.elastic.save``); the script begins by
resuming from the latest complete one (``autopar.elastic.resume``; none on a fresh start).
When a rank dies, torchrun restarts the whole group and the job goes on from the last
checkpoint. The mesh is the job's world size, so a job restarted with another number of
processes (``--nnodes MIN:MAX``) resumes on it: DCP reshards each tensor to the new plan.

For tests, ``--kill-rank R --kill-at S`` makes rank R SIGKILL itself before step S on the
first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0), and ``--out`` makes rank 0 write
the final whole parameters, the losses and the attempts it saw.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal

import torch
import torch.distributed as dist

import autopar
from autopar_examples.train import batch_at, build_model, make_optimizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autopar_examples.elastic_train")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", required=True, help="the checkpoints' directory")
    parser.add_argument("--kill-rank", type=int, help="this rank kills itself (first attempt)")
    parser.add_argument("--kill-at", type=int, default=0, help="... before this step")
    parser.add_argument("--out", help="rank 0 writes the final parameters here (torch.save)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = int(os.environ["WORLD_SIZE"])
    device = "h100-sxm" if torch.cuda.is_available() else "cpu"  # the preset it is costed for
    tokens = batch_at(0)
    model = autopar.compile(
        build_model(seed=0),
        autopar.Mesh((world,), ("dp",), device=device),
        example_kwargs={"input_ids": tokens, "labels": tokens},
        timeout=60,
    )
    optimizer, schedule = make_optimizer(model, args.steps)
    start = autopar.elastic.resume(model, optimizer, args.checkpoint, schedule)
    losses = []
    for step in range(start, args.steps):
        if attempt == 0 and dist.get_rank() == args.kill_rank and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = batch_at(step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        autopar.elastic.save(model, optimizer, args.checkpoint, step + 1, schedule)
    params = {name: model.full_parameter(name) for name, _ in model.named_parameters()}
    if dist.get_rank() == 0 and args.out:
        torch.save({"params": params, "losses": losses, "start": start, "attempt": attempt},
                   args.out)  # fmt: skip
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

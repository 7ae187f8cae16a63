"""A plain PyTorch training loop, made a learner of a diloco run by `diloco_cli.join`.

Run it with `diloco up examples/plain-loop.yaml`: every learner process runs this script
(the recipe's `training.entry_point`).  Nothing here is diloco's but the `with` block:
the model, the optimizer, its learning-rate schedule, the data and the step are the
script's own.  The recipe's `model` must describe the same architecture (the syncer
builds it too).

A learner that is restarted (a crash, `diloco resume`) comes back at `run.step`, with
its weights and optimizer state from its checkpoint; whatever else depends on the step
resumes from `run.step` too: the data position, and the learning-rate schedule, made
after `join` so that it starts where the learner is.
"""

import math

import torch
from torch.nn import functional as F

import diloco_cli
from diloco_cli.data.corpora import builtin_corpus
from diloco_cli.models.gpt import byte_gpt

SEQUENCE, BATCH = 64, 8
LEARNING_RATE, WARMUP_STEPS = 3e-3, 20

model = byte_gpt(num_layers=2, width=64, num_heads=2, context=SEQUENCE)
optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1)
text = torch.frombuffer(bytearray(builtin_corpus("shakespeare")), dtype=torch.uint8)

with diloco_cli.join(model, optimizer, tokens_per_step=BATCH * SEQUENCE) as run:

    def warmup_then_cosine(step: int) -> float:
        """The learning rate of `step`, as a fraction of LEARNING_RATE."""
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP_STEPS) / (run.total_steps - WARMUP_STEPS)))

    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    # last_epoch = run.step - 1: the schedule's next step is the learner's next step (0 on a first start)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine, last_epoch=run.step - 1)
    print(f"starting at step {run.step}, learning rate {schedule.get_last_lr()[0]:.6g}", flush=True)

    part = len(text) * 9 // 10 // run.num_shards  # the last tenth is the syncer's held-out text
    mine = text[run.shard * part : (run.shard + 1) * part]  # only this learner's shard
    generator = torch.Generator().manual_seed(1000 * run.shard + run.step)
    for _step in range(run.step, run.total_steps):
        starts = torch.randint(0, len(mine) - SEQUENCE - 1, (BATCH,), generator=generator)
        windows = torch.stack([mine[start : start + SEQUENCE + 1] for start in starts.tolist()]).long()
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        run.loss = loss.item()  # shown by `diloco status`
        optimizer.step()  # also sends, installs, heartbeats and checkpoints when due
        schedule.step()
        if run.stop_requested:  # `diloco down`
            break

"""A plain PyTorch training loop, made a learner of a diloco run by `diloco_cli.join`.

Run it with `diloco up --recipe examples/plain-loop.yaml`: every learner process runs
this script (the recipe's `training.entry_point`).  Nothing here is diloco's but the
`with` block: the model, the optimizer, the data and the step are the script's own.
The recipe's `model` must describe the same architecture (the syncer builds it too).
"""

import torch
from torch.nn import functional as F

import diloco_cli
from diloco_cli.data.corpora import builtin_corpus
from diloco_cli.models.gpt import byte_gpt

SEQUENCE, BATCH = 64, 8

model = byte_gpt(num_layers=2, width=64, num_heads=2, context=SEQUENCE)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
text = torch.frombuffer(bytearray(builtin_corpus("shakespeare")), dtype=torch.uint8)

with diloco_cli.join(model, optimizer, tokens_per_step=BATCH * SEQUENCE) as run:
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
        if run.stop_requested:  # `diloco down`
            break

"""A Hugging Face `Trainer`, made a learner of a diloco run by `DilocoCallback`.

Run it with `diloco up examples/hf-trainer.yaml`.  The model is a tiny Llama-style
`transformers` model built offline from a config (the recipe's model names the same
config, so the syncer builds the same architecture); the data are byte windows of the
built-in corpus, so the syncer's held-out loss is in nats per byte.

A learner that is restarted comes back at the step it had reached (`run.step`), with its
weights and optimizer state; the Trainer starts its own count again at 0, so
`ResumeSchedule` moves the Trainer's learning-rate schedule on to that step.
"""

import os
import warnings

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from diloco_cli.data.corpora import builtin_corpus
from diloco_cli.hf_trainer import DilocoCallback
from diloco_cli.models.hf import causal_lm

SEQUENCE, BATCH = 64, 8


class ByteWindows(torch.utils.data.Dataset):
    """Random windows of this learner's part of the text (its shard: DILOCO_SHARD)."""

    def __init__(self, shard: int, num_shards: int, length: int = 100_000) -> None:
        text = torch.frombuffer(bytearray(builtin_corpus("shakespeare")), dtype=torch.uint8)
        part = len(text) * 9 // 10 // num_shards
        self.text, self.length = text[shard * part : (shard + 1) * part], length
        self.generator = torch.Generator().manual_seed(shard)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        start = int(torch.randint(0, len(self.text) - SEQUENCE, (1,), generator=self.generator))
        window = self.text[start : start + SEQUENCE].long()
        return {"input_ids": window, "labels": window}  # the model shifts labels itself


class ResumeSchedule(TrainerCallback):
    """After `DilocoCallback` has joined the run: the learning-rate schedule at the step
    the learner resumed at (0 on a first start)."""

    def __init__(self, learner: DilocoCallback) -> None:
        self.learner = learner

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs) -> None:
        with warnings.catch_warnings():  # stepping the schedule before the optimizer is the point here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(self.learner.run.step):
                lr_scheduler.step()
        print(f"starting at step {self.learner.run.step}, learning rate {lr_scheduler.get_last_lr()[0]:.6g}")


model = causal_lm("builtin:tiny-llama")
arguments = TrainingArguments(
    output_dir=os.environ.get("TMPDIR", "/tmp") + "/hf-trainer-learner",
    max_steps=10_000,  # the callback stops at the recipe's training.inner_steps
    per_device_train_batch_size=BATCH,
    learning_rate=3e-3,
    warmup_steps=10,
    save_strategy="no",  # the learner checkpoints itself
    report_to=[],
    logging_steps=10,
    use_cpu=not torch.cuda.is_available(),
    dataloader_num_workers=0,
)
callback = DilocoCallback(tokens_per_step=BATCH * SEQUENCE)
shard, num_shards = int(os.environ.get("DILOCO_SHARD", "0")), int(os.environ.get("DILOCO_NUM_SHARDS", "1"))
callbacks = [callback, ResumeSchedule(callback)]  # in this order: join first, then move the schedule
Trainer(model=model, args=arguments, train_dataset=ByteWindows(shard, num_shards), callbacks=callbacks).train()

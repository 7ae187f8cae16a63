"""Make a Hugging Face ``transformers`` ``Trainer`` a learner of a diloco run.

::

    from diloco_cli.hf_trainer import DilocoCallback

    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[DilocoCallback(tokens_per_step=batch * length)])
    trainer.train()

The callback joins the run when training begins (:func:`diloco_cli.join` around the
Trainer's model and optimizer), counts every optimizer step of the Trainer as an inner
step of the learner, stops training at the recipe's ``training.inner_steps`` or when the
run is stopped, and finishes the learner when training ends.  Leave the Trainer's own
checkpointing off (``save_strategy="no"``): the learner checkpoints itself, and a
restarted learner resumes the weights and the optimizer's state from its checkpoint
(the Trainer's learning-rate schedule starts over).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from diloco_cli.runtime.learner.own_loop import JoinedRun, join


class DilocoCallback(TrainerCallback):
    """The learner's duties after each of the Trainer's optimizer steps."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.run: JoinedRun | None = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        self.run = join(model, inner, tokens_per_step=self.tokens_per_step, step_hook=False).__enter__()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if self.run is not None and logs and "loss" in logs:
            self.run.loss = float(logs["loss"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        assert self.run is not None, "on_train_begin joins the run first"
        self.run.step_done()
        if self.run.stop_requested or self.run.step >= self.run.total_steps:
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.__exit__(None, None, None)

"""``from diloco_cli.hf_trainer import DilocoCallback``: the documented import of the
Hugging Face ``Trainer`` callback, which lives in
:mod:`diloco_cli.runtime.learner.hf_trainer` (scripts written against this path keep
working)."""

from diloco_cli.runtime.learner.hf_trainer import DilocoCallback

__all__ = ["DilocoCallback"]

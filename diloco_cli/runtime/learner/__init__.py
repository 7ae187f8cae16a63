"""A learner: the built-in training loop and the duties every learner's loop carries.

* :mod:`.loop`: the built-in loop that ``diloco up`` runs (``diloco _learner``).
* :mod:`.sync`: :class:`~.sync.LearnerSync`, the learner's duties after every inner
  step, each at its cadence: the place to read what a learner does and when.
* :mod:`.sends` and :mod:`.outbox`: numbering and encoding sends, delivering them in order.
* :mod:`.poller`: looking for newer global weights and taking them into the bases.
* :mod:`.fragments`: per fragment, the base, counters and error-feedback residual.
* :mod:`.control`: what the run asks of the learner, shared by all its processes.
* :mod:`.heartbeats`, :mod:`.checkpoints`, :mod:`.progress`: reporting and resuming.
* :mod:`.own_loop` and :mod:`.hf_trainer`: a user's own loop or a Hugging Face
  ``Trainer`` as a learner (``diloco_cli.join``).
"""

"""What a learner computes locally: the inner step, its losses and its schedule (the
batches it steps on come from :mod:`diloco_cli.data`)."""

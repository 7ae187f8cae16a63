import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def secret():
    from diloco_cli.codec import RunSecret

    return RunSecret(bytes(range(32)))

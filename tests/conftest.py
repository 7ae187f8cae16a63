import os

# gcsfs must see this before it is first imported (else it hangs on a gRPC call).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None, max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def secret():
    from diloco_cli.codec import RunSecret

    return RunSecret(bytes(range(32)))

"""Credentials never go into configuration files: they would travel in run manifests."""

from __future__ import annotations

from typing import Any

CREDENTIAL_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "aws_access_key_id",
        "aws_secret_access_key",
        "session_token",
        "client_secret",
    }
)
"""Storage options that would put a credential into a file that travels with the run."""

NON_SECRET_TOKENS = frozenset({"anon", "google_default", "cloud", "browser"})
"""gcsfs ``token`` values that name a way to authenticate rather than a credential."""


def refuse_inline_credentials(options: dict[str, Any], where: str) -> None:
    """Storage options must not carry credentials: they travel in run manifests."""
    inline = sorted(
        key
        for key, value in options.items()
        if key.lower() in CREDENTIAL_KEYS and not (key.lower() == "token" and value in NON_SECRET_TOKENS)
    )
    if inline:
        raise ValueError(
            f"{where} hold credentials ({', '.join(inline)}): set them in the environment "
            "(AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS, ...) or name a profile instead"
        )

"""A Ctrl-C as pydantic delivers it: raised inside its serializer, it comes out wrapped."""

from __future__ import annotations


def pydantic_wrapped_interrupt() -> Exception:
    """The PydanticSerializationError pydantic raises for a KeyboardInterrupt in its serializer."""
    from pydantic import BaseModel, field_serializer

    class Interrupted(BaseModel):
        value: int = 0

        @field_serializer("value")
        def interrupt(self, value: int) -> int:
            raise KeyboardInterrupt

    try:
        Interrupted().model_dump_json()
    except Exception as error:
        return error
    raise AssertionError("pydantic no longer wraps a KeyboardInterrupt raised in its serializer")


def raise_wrapped_interrupt(*_args, **_kwargs) -> str:
    """A stand-in for ``model_dump_json`` that raises pydantic's wrapped Ctrl-C."""
    raise pydantic_wrapped_interrupt()

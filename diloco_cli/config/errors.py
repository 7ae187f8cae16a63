"""The error a configuration mistake raises (light: no YAML, no pydantic)."""


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message says where and what to do."""


def wraps_an_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is a Ctrl-C in pydantic's wrapping: a KeyboardInterrupt raised
    inside its serializer comes out as a PydanticSerializationError that names it."""
    return type(error).__name__ == "PydanticSerializationError" and "KeyboardInterrupt" in str(error)

"""The error a configuration mistake raises (light: no YAML, no pydantic)."""


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message says where and what to do."""

"""The error every configuration check raises, and how its messages show a value (clipped, never whole)."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        self.key, self.problem = key, message
        super().__init__(f"configuration key {key!r}: {message}")


def clip(text: str, limit: int = 200) -> str:
    """`text`, cut to `limit` characters: an error message names a value, it does not reprint it."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"

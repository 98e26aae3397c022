"""A small settings library: each setting is read from its flag, else its environment variable, else
its default, and a bad value raises :class:`ConfigError` naming the flag or variable it came from."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting with a bad value; the message names the flag or environment variable."""


# --- value parsers: each raises ValueError with a message that completes "FLAG=VALUE: ..." ---


def integer(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("must be an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")
        return value

    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive finite number")
    return value


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def choice(options: Sequence[str], upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.upper() if upper else text
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return parse


def nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def existing_path(text: str) -> str:
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError("no such file or directory")
    return str(path.resolve())


@dataclass(frozen=True, slots=True)
class Setting:
    dest: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    env: str = ""  # "" means KVGATE_<DEST>
    repeatable: bool = False  # flag repeatable; the env value is comma-separated
    switch: bool = False
    metavar: str | None = None
    group: str = "server"
    secret: bool = False  # its values are never shown in errors

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env_name(self) -> str:
        return self.env or "KVGATE_" + self.dest.upper()

    def add_to(self, group: argparse._ActionsContainer) -> None:
        """Its flag, with a help that names the environment variable and the default."""
        shown = "" if self.default in (None, (), "") else f"; default: {self.default}"
        text = f"{self.help} (env {self.env_name}{shown})"
        if self.switch:
            group.add_argument(self.flag, action="store_true", default=None, help=text)
        else:
            group.add_argument(self.flag, action="append" if self.repeatable else "store", default=None,
                               help=text, metavar=self.metavar or self.dest.upper())


def read(s: Setting, args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """One setting from its flag, else its env variable, else its default; raises ConfigError."""
    raw = getattr(args, s.dest, None)
    source = s.flag
    if raw is None and s.env_name in environ:
        raw = environ[s.env_name]
        source = s.env_name
        if s.repeatable:
            raw = [item.strip() for item in raw.split(",") if item.strip()]
        elif s.switch:
            raw = raw or "0"
    if raw is None:
        return s.default
    if s.switch and raw is True:
        return True
    items = raw if s.repeatable else [raw]
    values = []
    for item in items:
        try:
            values.append(s.parse(item))
        except ValueError as exc:
            shown = "<redacted>" if s.secret else item
            raise ConfigError(f"{source}={shown!r}: {exc}") from None
    return tuple(values) if s.repeatable else values[0]

"""argparse value types shared by the `baton` commands: each turns a flag's
text into a checked number or says, as argparse prints it, why not."""

from __future__ import annotations

import argparse


def port(value: str) -> int:
    """A TCP port, 0 (pick a free one) to 65535."""
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from exc
    if not 0 <= number < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {number}")
    return number


def count(value: str) -> int:
    """How many processes of one kind: 1 to 9."""
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from exc
    if not 1 <= number <= 9:
        raise argparse.ArgumentTypeError(f"must be between 1 and 9, not {number}")
    return number


def at_least_one(value: str) -> int:
    """A whole number of at least 1."""
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from exc
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def seconds(value: str) -> float:
    """A finite duration of 0 seconds or more."""
    try:
        duration = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from exc
    if not 0 <= duration < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {value}")
    return duration


def window_seconds(value: str) -> float:
    """A duration of at least a second (hooks refuses less at startup)."""
    duration = seconds(value)
    if duration < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, not {value}")
    return duration


def non_negative(value: str) -> int:
    """A whole number of 0 or more (a limit, a page size, a seq)."""
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from exc
    if number < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {number}")
    return number

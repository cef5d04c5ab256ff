"""The Dockerfile read as instructions: shared by the static packaging checks and the e2e
test that compares a container's environment with the image's ENV."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def instructions(path: Path) -> list[tuple[str, str, str]]:
    """(stage, instruction, argument) with line continuations joined and comments dropped."""
    out: list[tuple[str, str, str]] = []
    stage = ""
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            stage = m.group(1) if m else ""
        out.append((stage, word, rest.strip()))
    return out


def runtime_env(path: Path) -> dict[str, str]:
    """The ENV of the ``runtime`` stage, which every target inherits."""
    env: dict[str, str] = {}
    for stage, word, rest in instructions(path):
        if word == "ENV" and stage == "runtime":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env

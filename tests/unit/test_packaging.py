"""Every command the Dockerfile, the manifests and the operator's pod builders name exists in
the installed package.

The image is built only by ``make image`` (buildah, root, minutes; tests/e2e/test_realnode.py
runs its entry points on the real node), never in the default tiers; what can rot silently in
between is a renamed module or subcommand that the image's CMD, a manifest's ``command`` or
the pods the operator writes still name. These tests resolve each such command against the installed
package (the same one the local pod runner executes) and check that the runtime ENV of the
image is what the pod runner gives its pods.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


# --------------------------------------------------------------------------- collect


def dockerfile_commands() -> list[tuple[str, list[str]]]:
    """CMD and ENTRYPOINT of every stage, exec form (shell form would hide the argv)."""
    cmds = []
    for stage, word, rest in dockerfile.instructions(DOCKERFILE):
        if word in ("CMD", "ENTRYPOINT"):
            argv = json.loads(rest)
            assert isinstance(argv, list), f"{stage} {word} must use the exec form: {rest}"
            cmds.append((f"Dockerfile {stage} {word}", [str(a) for a in argv]))
    return cmds


def _containers(doc: Any) -> Iterator[dict[str, Any]]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _containers(item)


def manifest_commands() -> list[tuple[str, list[str]]]:
    cmds = []
    for path in sorted((ROOT / "manifests").rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for c in _containers(doc):
                argv = [*c.get("command", []), *c.get("args", [])]
                if argv:
                    cmds.append((f"{path.relative_to(ROOT)} container {c.get('name')}", argv))
    return cmds


def operator_commands() -> list[tuple[str, list[str]]]:
    """What the operator writes into every prefill/decode pod and the router Deployment."""
    from pdd_operator import builders

    return [
        ("pdd_operator.builders.SIDECAR_SERVE", list(builders.SIDECAR_SERVE)),
        ("pdd_operator.builders.SIDECAR_ROUTER", list(builders.SIDECAR_ROUTER)),
    ]


ALL_COMMANDS = dockerfile_commands() + manifest_commands() + operator_commands()


# --------------------------------------------------------------------------- resolve


def _help_text(argv: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return proc.stdout + proc.stderr


def _subcommand_listed(sub: str, help_text: str) -> bool:
    """The usage line's ``{a,b|c}`` choice set (argparse and pdd_sidecar both print one)."""
    m = re.search(r"usage:[^{]*\{([\w,|-]+)\}", help_text)
    return m is not None and sub in re.split(r"[,|]", m.group(1))


def command_problem(argv: list[str]) -> str | None:
    """None when ``argv`` names something the installed package provides, else why not.

    ``python -m MOD [SUB ...]``: MOD must be importable and runnable (a package needs
    ``__main__``), and a first positional SUB must be a subcommand its ``--help`` lists.
    A bare name must be a console script of an installed distribution, likewise with SUB.
    """
    if not argv:
        return "empty command"
    exe, rest = argv[0], argv[1:]
    if exe in ("python", "python3", "/opt/pdd/bin/python"):
        if len(rest) < 2 or rest[0] != "-m":
            return f"only `python -m MODULE` entry points are allowed, got {shlex.join(argv)}"
        module, sub_args = rest[1], rest[2:]
        spec = importlib.util.find_spec(module)
        if spec is None:
            return f"module {module!r} is not installed"
        if spec.submodule_search_locations is not None:
            if importlib.util.find_spec(f"{module}.__main__") is None:
                return f"package {module!r} has no __main__"
        help_argv = ["-m", module]
    else:
        scripts = {
            ep.name: ep
            for dist in importlib.metadata.distributions()
            for ep in dist.entry_points
            if ep.group == "console_scripts"
        }
        if exe not in scripts:
            return f"{exe!r} is not a console script of any installed distribution"
        try:
            scripts[exe].load()
        except Exception as e:  # noqa: BLE001 - any import error is the finding
            return f"console script {exe!r} does not load: {e}"
        sub_args = rest
        help_argv = ["-c", f"import sys; sys.argv[0] = {exe!r}; "
                     f"from importlib.metadata import entry_points; "
                     f"ep = [e for e in entry_points(group='console_scripts') "
                     f"if e.name == {exe!r}][0]; sys.exit(ep.load()())"]  # fmt: skip
    subs = [a for a in sub_args if not a.startswith("-")][:1]
    if subs and not _subcommand_listed(subs[0], _help_text(help_argv)):
        return f"{shlex.join(argv)}: subcommand {subs[0]!r} is not listed by --help"
    return None


# --------------------------------------------------------------------------- tests


def test_something_is_checked() -> None:
    names = {where.split()[0] for where, _ in ALL_COMMANDS}
    assert "Dockerfile" in names, "the Dockerfile names no CMD/ENTRYPOINT"
    assert any(w.startswith("pdd_operator.builders") for w, _ in ALL_COMMANDS)


@pytest.mark.parametrize(
    ("where", "argv"), ALL_COMMANDS, ids=[f"{w}: {' '.join(a)}" for w, a in ALL_COMMANDS]
)
def test_command_exists_in_installed_package(where: str, argv: list[str]) -> None:
    problem = command_problem(argv)
    assert problem is None, f"{where}: {problem}"


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "-m", "pdd_sidecar", "serv"],  # typo of a subcommand
        ["python", "-m", "pdd_no_such_module"],
        ["python", "-m", "pdd_api"],  # a package without __main__
        ["pdd", "plans"],
        ["pdd-no-such-script"],
        ["bash", "-c", "python -m pdd_operator"],  # a shell hides what runs
    ],
)
def test_checker_rejects_what_is_not_there(argv: list[str]) -> None:
    assert command_problem(argv) is not None


def test_dockerfile_stages_run_as_non_root_from_a_pinned_base() -> None:
    instructions = dockerfile.instructions(DOCKERFILE)
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for _, w, rest in instructions
            if w == "ARG" and "=" in rest}  # fmt: skip
    froms = [rest.split()[0] for _, w, rest in instructions if w == "FROM"]
    stages = {s for s, w, _ in instructions if w == "FROM"}
    for image in froms:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), image)
        if resolved in stages:
            continue
        assert re.search(r":\d+\.\d+\.\d+", resolved) or "@sha256:" in resolved, (
            f"base image {image} -> {resolved!r} is not pinned to a patch release or digest"
        )
    users = [rest for _, w, rest in instructions if w == "USER"]
    assert users and all(not u.startswith(("0", "root")) for u in users)
    assert len(froms) >= 3, "expected a runtime base and the operator and sidecar targets"
    for target in ("operator", "sidecar"):
        words = [w for stage, w, _ in instructions if stage == target]
        assert "USER" in words, f"{target} never leaves root"
        last_user = len(words) - 1 - words[::-1].index("USER")
        assert "RUN" not in words[last_user:], f"{target} runs a step after its USER"


def test_image_env_puts_the_package_first_and_logs_unbuffered() -> None:
    """`python`, `pdd` in a pod are the package's; `kubectl logs` shows a line when it is
    written, not when a buffer fills (tests/e2e/test_realnode.py checks the ENV in a container)."""
    env = dockerfile.runtime_env(DOCKERFILE)
    assert env.get("PATH", "").split(":")[0] == "/opt/pdd/bin", env
    assert env.get("PYTHONUNBUFFERED") == "1", env


def _pip_installs() -> list[tuple[str, str]]:
    return [(stage, rest) for stage, word, rest in dockerfile.instructions(DOCKERFILE)
            if word == "RUN" and re.search(r"\bpip install\b", rest)]  # fmt: skip


def test_pip_cache_is_a_build_mount_never_a_layer() -> None:
    """A rebuild downloads nothing (the cache mount), and no layer carries pip's cache."""
    installs = _pip_installs()
    assert installs, "no pip install in the Dockerfile"
    for stage, rest in installs:
        mounted = re.search(r"--mount=type=cache,[^ ]*target=/root/\.cache/pip", rest)
        assert mounted or "--no-cache-dir" in rest, f"{stage}: {rest}"
    env = " ".join(rest for _, w, rest in dockerfile.instructions(DOCKERFILE) if w == "ENV")
    assert "PIP_NO_CACHE_DIR" not in env, "PIP_NO_CACHE_DIR would switch the cache mount off"


def test_dependencies_install_before_the_source_is_copied() -> None:
    """Each build stage installs the dependencies before it copies the source, then the
    package alone, so a source change rebuilds one small layer and not torch's."""
    instructions = dockerfile.instructions(DOCKERFILE)
    for target in ("operator", "sidecar"):
        steps = [(w, rest) for stage, w, rest in instructions if stage == target]
        copies = [i for i, (w, rest) in enumerate(steps) if w == "COPY" and "sidecar/" in rest]
        installs = [i for i, (w, rest) in enumerate(steps)
                    if w == "RUN" and "pip install" in rest]  # fmt: skip
        assert copies and len(installs) == 2, (target, steps)
        assert installs[0] < copies[0] < installs[1], (target, steps)
        assert "--no-deps" in steps[installs[1]][1], steps[installs[1]]

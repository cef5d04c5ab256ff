"""serve/ is three rooms imported one way, so a reader finds each job in its room.

- ``openai``: the OpenAI surface; it imports no other room.
- ``router`` and ``instance``: each may import ``openai``, never the other.
- serve/'s own modules: the shared ones (``event_loop``, ``discovery``, ``access_log``) import
  no room, and
  ``local_stack`` (which launches the whole stack) is imported by no room.

The graph is read with `ast` as test_import_cycles.py reads it: deferred and TYPE_CHECKING
imports count too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_import_cycles import ROOT, _modules, import_graph

SERVE = "pdd_sidecar.serve"
ROOMS = ("openai", "router", "instance")
# What each room may import inside serve/: its own modules, the rooms listed, the shared modules.
ALLOWED = {
    "openai": {"openai"},
    "router": {"router", "openai"},
    "instance": {"instance", "openai"},
}
SHARED = {"event_loop", "discovery", "access_log"}  # serve/ modules any room may import
LAUNCHER = "local_stack"  # imports any room; imported by none


def room_of(module: str) -> str | None:
    """The room (or serve/ module name) a module of serve/ lives in; None outside serve/."""
    if module == SERVE:
        return ""
    if not module.startswith(SERVE + "."):
        return None
    return module[len(SERVE) + 1:].split(".")[0]


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import inside serve/ against the rooms' direction, as 'importer -> imported'."""
    found = []
    for module, targets in sorted(graph.items()):
        here = room_of(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = room_of(target)
            if there is None or there == "" or there == here:
                continue
            if here in ROOMS:
                ok = there in ALLOWED[here] or there in SHARED
            elif here in SHARED:
                ok = False  # the shared modules sit under every room
            else:  # the launcher imports any room; serve/__init__ none
                ok = here == LAUNCHER
            if not ok:
                found.append(f"{module} -> {target}")
    return found


def _serve_graph() -> dict[str, set[str]]:
    return import_graph(_modules(ROOT / "sidecar", "pdd_sidecar"))


def test_serve_is_split_into_its_rooms() -> None:
    modules = _modules(ROOT / "sidecar", "pdd_sidecar")
    for room in ROOMS:
        assert len([m for m in modules if room_of(m) == room]) >= 4, room
    loose = sorted(m for m in modules if room_of(m) not in (*ROOMS, *SHARED, LAUNCHER, "", None))
    assert not loose, f"serve/ modules outside a room and not shared: {loose}"


def test_serve_rooms_import_one_way() -> None:
    graph = _serve_graph()
    assert f"{SERVE}.openai.openai_request" in graph[f"{SERVE}.router.router"], "walk broke"
    found = violations(graph)
    assert not found, f"imports against serve/'s rooms (openai <- router, instance): {found}"


@pytest.mark.parametrize("files, bad", [
    pytest.param({"openai/a.py": "from pdd_sidecar.serve.router import r\n"},
                 "pdd_sidecar.serve.openai.a -> pdd_sidecar.serve.router.r", id="openai-up"),
    pytest.param({"router/b.py": "def f():\n    from pdd_sidecar.serve.instance.i import X\n"},
                 "pdd_sidecar.serve.router.b -> pdd_sidecar.serve.instance.i", id="sideways"),
    pytest.param({"instance/c.py": "import pdd_sidecar.serve.local_stack\n"},
                 "pdd_sidecar.serve.instance.c -> pdd_sidecar.serve.local_stack", id="launcher"),
    pytest.param({"discovery.py": "from pdd_sidecar.serve.openai import o\n"},
                 "pdd_sidecar.serve.discovery -> pdd_sidecar.serve.openai.o", id="shared-up"),
])
def test_an_import_against_the_rooms_is_found(tmp_path: Path, files: dict[str, str],
                                              bad: str) -> None:
    tree = {
        "pdd_sidecar/__init__.py": "", "pdd_sidecar/serve/__init__.py": "",
        "pdd_sidecar/serve/local_stack.py": "from pdd_sidecar.serve.router import r\n",
        "pdd_sidecar/serve/discovery.py": "", "pdd_sidecar/serve/event_loop.py": "",
        **{f"pdd_sidecar/serve/{room}/__init__.py": "" for room in ROOMS},
        "pdd_sidecar/serve/openai/o.py": "", "pdd_sidecar/serve/router/r.py": "",
        "pdd_sidecar/serve/instance/i.py": "from pdd_sidecar.serve.openai.o import Y\n",
        **{f"pdd_sidecar/serve/{rel}": text for rel, text in files.items()},
    }
    for rel, text in tree.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = violations(import_graph(_modules(tmp_path, "pdd_sidecar")))
    assert bad in found
    assert {edge.split(" -> ")[0] for edge in found} == {bad.split(" -> ")[0]}

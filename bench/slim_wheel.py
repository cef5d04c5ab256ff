"""Drop the members of a wheel that a GPU run never imports, so the wheels it must carry fit
the 64 MiB a call may bring.

Why: nixl-cu13's wheel (59 MB) ships its expert-parallel extension built once per torch
release (nixl_ep_cu13/*torch21*.so, 27 MB compressed); pdd never imports it, and with it the
wheels pdd carries (nixl, nixl-cu13, pydantic and its dependencies, llguidance) pass the limit.
The wheel's RECORD loses the same lines, so pip installs the rest as it would the whole.

    python bench/slim_wheel.py .whl/nixl_cu13-*.whl            # rewritten in place
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import zipfile

DROP = ("nixl_ep_cu13/*torch21*.so",)


def slim(path: str, patterns: tuple[str, ...] = DROP) -> int:
    """Rewrite ``path`` without members matching ``patterns``; the bytes saved."""
    def dropped(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    before = os.path.getsize(path)
    tmp = path + ".slim"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line + b"\n" for line in data.split(b"\n")
                                if line and not dropped(line.split(b",")[0].decode()))
            dst.writestr(info, data)
    os.replace(tmp, path)
    return before - os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="+")
    for path in ap.parse_args().wheels:
        print(f"{path}: {slim(path) / 2**20:.1f} MiB less")


if __name__ == "__main__":
    main()

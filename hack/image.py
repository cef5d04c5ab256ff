"""`make image`: the Dockerfile's images built here, without Docker or a registry.

    debootstrap (Debian bookworm, python3 3.11, python3-venv, python-is-python3)
    -> a local base image in buildah's store (localhost/pdd-base:bookworm)
    -> buildah bud --target sidecar / operator, --build-arg PYTHON_IMAGE=<that base>
    -> when the local cluster's real node runs: imported into its containerd (k8s.io namespace)

The public base (python:3.11.x-slim-bookworm) cannot be pulled here, so the base is made from
the same Debian release and Python minor. Everything cached lives under ``.cache/image``: the
base root file system (made once), the wheels the images install (downloaded once per set of
requirements, mounted into the build, which then needs no index), buildah's TMPDIR and the OCI
layout the import goes through. buildah's layer cache (``--layers``) and the dependencies-first
Dockerfile make a rebuild after a source change take seconds.

Images: ``pdd:<tag>`` (sidecar, the examples' ``spec.image``) and ``pdd-operator:<tag>``.
Imported as ``docker.io/library/pdd:<tag>``, the name a pod's ``image: pdd:<tag>`` means, so
pods run it with the default pull policy (IfNotPresent) or ``Never``. The import sends only the
blobs containerd lacks (see ``import_image``); an image containerd already holds (same config
digest) is not imported at all.

Needs root and the Debian packages buildah and debootstrap (``make image-deps``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "cluster"))

import realnode  # noqa: E402

CACHE = Path(os.environ.get("PDD_IMAGE_CACHE") or REPO_ROOT / ".cache" / "image")
SUITE = "bookworm"
MIRROR = os.environ.get("PDD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What python:3.11-slim-bookworm gives the Dockerfile: `python`, `python -m venv` (ensurepip),
# Python 3.11; passwd (groupadd, useradd) is in every Debian base already.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3")
BASE_PYTHON = (3, 11)
BASE_IMAGE = f"localhost/pdd-base:{SUITE}"
BASE_LABEL = "dev.pdd.base"
DEFAULT_TAG = os.environ.get("PDD_IMAGE_TAG", "0.1.0")
# Dockerfile target -> repository; `pdd` is what the examples and manifests name.
TARGETS = {"sidecar": "pdd", "operator": "pdd-operator"}


class ImageError(RuntimeError):
    """A step failed; the message says which and why."""


def say(msg: str) -> None:
    print(f"image: {msg}", flush=True)


def runtime_env() -> dict[str, str]:
    """runc for buildah's RUN steps when it is there: crun (which Debian's buildah pulls in when
    no runtime is installed yet) refuses these machines' hybrid cgroups ("cgroups in hybrid
    mode not supported"); runc, which the real node installs, runs them."""
    runc = shutil.which("runc")
    if runc and "BUILDAH_RUNTIME" not in os.environ:
        return {"BUILDAH_RUNTIME": runc}
    return {}


def run(
    argv: list[str], *, env: dict[str, str] | None = None, capture: bool = False, **kw: object
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            argv,
            env={**os.environ, **runtime_env(), **(env or {})},
            text=True,
            capture_output=capture,
            check=False,
            **kw,  # type: ignore[call-overload]
        )
    except FileNotFoundError as e:
        raise ImageError(f"{argv[0]} is not installed: run `make image-deps`") from e
    if proc.returncode != 0:
        detail = (proc.stderr or "")[-3000:] if capture else "(output above)"
        raise ImageError(f"`{' '.join(argv[:4])} ...` exited {proc.returncode}: {detail}")
    return proc


def image_id(name: str) -> str | None:
    """buildah's image ID (the config digest, without ``sha256:``), or None if absent."""
    proc = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


# --------------------------------------------------------------------------- base


def base_key() -> str:
    """What the base is made from; a change makes it again (and so every image)."""
    spec = {"suite": SUITE, "mirror": MIRROR, "packages": sorted(BASE_PACKAGES)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def check_rootfs(rootfs: Path) -> str | None:
    """None when the root file system can be the Dockerfile's base, else what is wrong."""
    if (rootfs / "debootstrap").exists():
        return "debootstrap did not finish (its work folder is still there)"
    probe = (
        "import sys, venv, ensurepip; "
        f"assert sys.version_info[:2] == {BASE_PYTHON!r}, sys.version; print(sys.version)"
    )
    proc = subprocess.run(
        ["chroot", str(rootfs), "python", "-c", probe], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return f"`python -c ...` in it failed: {(proc.stderr or proc.stdout).strip()[-500:]}"
    return None


def make_rootfs() -> Path:
    """Debian minbase with the base packages, made once into .cache/image/base."""
    base_dir = CACHE / "base"
    rootfs = base_dir / "rootfs"
    stamp = base_dir / "stamp"
    key = base_key()
    if stamp.exists() and stamp.read_text().strip() == key and check_rootfs(rootfs) is None:
        return rootfs
    tmp = base_dir / "rootfs.tmp"
    for old in (tmp, rootfs):
        if old.exists():
            shutil.rmtree(old)
    base_dir.mkdir(parents=True, exist_ok=True)
    say(f"debootstrap {SUITE} ({', '.join(BASE_PACKAGES)}) from {MIRROR}")
    t0 = time.monotonic()
    run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            SUITE,
            str(tmp),
            MIRROR,
        ],
        capture=True,
    )
    # Package lists and downloaded .debs are not part of a base image.
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (tmp / sub).glob("*"):
            if entry.is_file() and entry.name != "lock":
                entry.unlink()
    problem = check_rootfs(tmp)
    if problem:
        raise ImageError(f"the debootstrap'd base in {tmp} is not usable: {problem}")
    tmp.rename(rootfs)
    stamp.write_text(key + "\n")
    say(f"base root file system made in {time.monotonic() - t0:.0f}s: {rootfs}")
    return rootfs


def base_image() -> str:
    """The root file system as an image in buildah's store, labelled with its key, so a
    rebuild of the base (another key) replaces it and an unchanged one is reused."""
    rootfs = make_rootfs()
    key = base_key()
    if image_id(BASE_IMAGE) is not None:
        proc = run(["buildah", "inspect", "--type", "image", BASE_IMAGE], capture=True)
        labels = json.loads(proc.stdout).get("OCIv1", {}).get("config", {}).get("Labels") or {}
        if labels.get(BASE_LABEL) == key:
            return BASE_IMAGE
    t0 = time.monotonic()
    ctr = run(["buildah", "from", "scratch"], capture=True).stdout.strip()
    try:
        mnt = run(["buildah", "mount", ctr], capture=True).stdout.strip()
        run(["cp", "-a", f"{rootfs}/.", f"{mnt}/"])
        run(
            [
                "buildah", "config",
                "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8",
                "--cmd", "python3",
                "--label", f"{BASE_LABEL}={key}",
                ctr,
            ]  # fmt: skip
        )
        run(["buildah", "commit", "--quiet", "--rm", ctr, BASE_IMAGE], capture=True)
    except BaseException:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)
        raise
    say(f"base image {BASE_IMAGE} committed in {time.monotonic() - t0:.0f}s")
    return BASE_IMAGE


# --------------------------------------------------------------------------- build


def image_name(target: str, tag: str) -> str:
    return f"{TARGETS[target]}:{tag}"


def requirements() -> list[str]:
    """Everything the images install: the package's dependencies, both targets' extras, and
    its build backend (pip builds the package in an isolated environment)."""
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    reqs = [*meta["project"]["dependencies"], *meta["build-system"]["requires"]]
    for target in TARGETS:
        reqs += extras[target]
    return sorted(set(reqs))


def wheelhouse() -> Path:
    """The wheels the images install, downloaded on the host into .cache/image/wheels (only
    what is missing) and bind-mounted into the build, which then needs no index. A pip cache
    alone does not make rebuilds quick everywhere: a proxy that drops the index's caching
    headers (this machine's does) leaves pip's HTTP cache empty."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # Complete for exactly these requirements: no index round trips (a minute and a half here).
    stamp = CACHE / "wheels.stamp"
    key = hashlib.sha256("\n".join(requirements()).encode()).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == key:
        return wheels
    t0 = time.monotonic()
    run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--dest", str(wheels), *requirements()],
    )  # fmt: skip
    stamp.write_text(key + "\n")
    size = sum(f.stat().st_size for f in wheels.iterdir()) / 1e6
    say(f"wheels for the build: {wheels} ({size:.0f} MB, {time.monotonic() - t0:.0f}s)")
    return wheels


def build(targets: list[str], tag: str) -> dict[str, float]:
    """buildah bud of each target against the local base; seconds per target."""
    base = base_image()
    tmpdir = CACHE / "buildah"  # TMPDIR: buildah keeps RUN --mount=type=cache here
    tmpdir.mkdir(parents=True, exist_ok=True)
    wheels = wheelhouse()
    pip_args = [
        "--volume", f"{wheels}:/wheels:ro",
        "--build-arg", "PIP_FIND_LINKS=/wheels",
        "--build-arg", "PIP_NO_INDEX=1",
    ]  # fmt: skip
    took = {}
    for target in targets:
        name = image_name(target, tag)
        say(f"buildah bud --target {target} -t {name} (base {base})")
        t0 = time.monotonic()
        run(
            [
                "buildah", "bud", "--layers", "--force-rm", "--target", target,
                "--build-arg", f"PYTHON_IMAGE={base}", *pip_args,
                "-t", name, "-f", str(REPO_ROOT / "Dockerfile"), str(REPO_ROOT),
            ],  # fmt: skip
            env={"TMPDIR": str(tmpdir)},
        )
        took[target] = time.monotonic() - t0
        say(f"{name} built in {took[target]:.0f}s, {size_mb(name):.0f} MB")
    return took


def size_mb(name: str) -> float:
    """The image's size as buildah reports it (a string such as ``6.44 GB``), in MB."""
    proc = run(["buildah", "images", "--json", name], capture=True)
    images = json.loads(proc.stdout)
    if not images:
        return 0.0
    number, _, unit = str(images[0]["size"]).partition(" ")
    scale = {"B": 1e-6, "kB": 1e-3, "KB": 1e-3, "MB": 1.0, "GB": 1e3, "TB": 1e6}
    return float(number) * scale.get(unit, 1.0)


# --------------------------------------------------------------------------- import


def node_running() -> bool:
    """The local cluster's real node is up: its containerd answers on its socket."""
    if not (realnode.HOST_MARK.exists() and realnode.CONTAINERD_SOCK.exists()):
        return False
    try:
        realnode.ctr("version", timeout=10)
    except (subprocess.SubprocessError, realnode.RealNodeError):
        return False
    return True


def containerd_name(name: str) -> str:
    """The reference a pod's ``image: <name>`` means (Docker Hub's library namespace)."""
    return name if "/" in name.split(":")[0] else f"docker.io/library/{name}"


def in_containerd(name: str, config_id: str) -> bool:
    """containerd holds ``name`` with this exact config (buildah's image ID)."""
    for line in realnode.ctr("images", "ls").stdout.splitlines()[1:]:
        cols = line.split()
        if cols and cols[0] == containerd_name(name):
            try:
                manifest = realnode.ctr("content", "get", cols[2]).stdout
            except subprocess.CalledProcessError:
                return False
            return f"sha256:{config_id}" in manifest
    return False


# The import sends containerd only the blobs it lacks. buildah pushes into a persistent OCI
# layout (.cache/image/oci) and skips any blob whose file is already there, checking no more
# than that the file exists and its size; so each layer containerd holds is left there as a
# sparse file of the right size, and a push after a source change writes (and the import
# sends) only the new top layers: no 6 GB stream, no 6 GB on disk twice.
SPARSE_MIN = 1 << 20
OCI_REF = "org.opencontainers.image.ref.name"


def oci_dir() -> Path:
    return CACHE / "oci"


def _blob(digest: str) -> Path:
    return oci_dir() / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _is_sparse(path: Path) -> bool:
    st = path.stat()
    return st.st_blocks * 512 < st.st_size // 2


def _make_sparse(path: Path, size: int) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def containerd_layers() -> dict[str, int]:
    """Digest -> size of every blob containerd holds that its images' manifests name."""
    present = {
        line.strip() for line in realnode.ctr("content", "ls", "--quiet").stdout.splitlines()
    }
    sizes: dict[str, int] = {}
    for line in realnode.ctr("images", "ls").stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 3 or cols[2] not in present:
            continue
        try:
            manifest = json.loads(realnode.ctr("content", "get", cols[2]).stdout)
        except (subprocess.CalledProcessError, ValueError):
            continue
        for desc in [manifest.get("config", {}), *manifest.get("layers", [])]:
            if desc.get("digest") in present:
                sizes[desc["digest"]] = int(desc["size"])
    return sizes


def _prepare_layout(have: dict[str, int]) -> None:
    blobs = oci_dir() / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    if not (oci_dir() / "oci-layout").exists():
        (oci_dir() / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (oci_dir() / "index.json").write_text('{"schemaVersion": 2, "manifests": []}')
    for blob in blobs.iterdir():  # a stand-in for what containerd lost: let the push rewrite it
        if f"sha256:{blob.name}" not in have and _is_sparse(blob):
            blob.unlink()
    for digest, size in have.items():
        if size >= SPARSE_MIN and not _blob(digest).exists():
            _make_sparse(_blob(digest), size)


# Above this many missing bytes (a first import, new dependencies) the image is streamed
# whole instead: the layout would otherwise hold a full copy of the big layers until the import
# is done (6 GB more disk at the peak).
STREAM_ABOVE = 256 << 20


def storage_layer_sizes() -> dict[str, int]:
    """Diff digest -> uncompressed size of every layer in buildah's store (its layers.json)."""
    info = json.loads(run(["buildah", "info"], capture=True).stdout)
    layers = Path(info["store"]["GraphRoot"]) / "overlay-layers" / "layers.json"
    try:
        entries = json.loads(layers.read_text())
    except (OSError, ValueError):
        return {}
    return {e["diff-digest"]: int(e.get("diff-size", 0)) for e in entries if "diff-digest" in e}


def import_image(name: str) -> float | None:
    """Import the image into the node's containerd. When containerd lacks little (after a
    source change: the top layers, under a megabyte), only those blobs are sent; when it lacks
    much (first import, new dependencies) the image is streamed whole as a docker-archive. The
    layers' digests are the same either way, so the next import finds them. Seconds taken, or
    None when containerd already had it."""
    config_id = image_id(name)
    if config_id is None:
        raise ImageError(f"{name} is not in buildah's store: build it first (make image)")
    ensure_pause_image()
    if in_containerd(name, config_id):
        say(f"{containerd_name(name)} already in the real node's containerd")
        return None
    have = containerd_layers()
    proc = run(["buildah", "inspect", "--type", "image", name], capture=True)
    diff_ids = json.loads(proc.stdout)["OCIv1"]["rootfs"]["diff_ids"]
    sizes = storage_layer_sizes()
    missing = sum(sizes.get(d, STREAM_ABOVE + 1) for d in diff_ids if d not in have)
    if missing > STREAM_ABOVE:
        return _import_stream(name, config_id, missing)
    return _import_missing(name, config_id, have)


def _import_stream(name: str, config_id: str, missing: int) -> float:
    """The whole image as a docker-archive stream into ``ctr images import`` (no file)."""
    t0 = time.monotonic()
    push = subprocess.Popen(
        ["buildah", "push", "--quiet", name,
         f"docker-archive:/dev/stdout:{containerd_name(name)}"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        run(
            ["ctr", "--address", str(realnode.CONTAINERD_SOCK), "--namespace", "k8s.io",
             "images", "import", "-"],
            stdin=push.stdout, capture=True,
        )  # fmt: skip
    finally:
        assert push.stdout is not None
        push.stdout.close()
        push.wait()
    if push.returncode != 0:
        raise ImageError(f"buildah push {name} exited {push.returncode}")
    if not in_containerd(name, config_id):
        raise ImageError(f"{containerd_name(name)} is not in containerd after the import")
    took = time.monotonic() - t0
    say(f"{containerd_name(name)} streamed whole into the real node's containerd in {took:.0f}s "
        f"({missing / 1e6:.0f} MB of layers were missing)")  # fmt: skip
    return took


def _import_missing(name: str, config_id: str, have: dict[str, int]) -> float:
    """Only the blobs containerd lacks, through the OCI layout."""
    t0 = time.monotonic()
    ref = containerd_name(name)
    _prepare_layout(have)
    run(["buildah", "push", "--quiet", "--disable-compression", name, f"oci:{oci_dir()}:{ref}"],
        capture=True)  # fmt: skip
    index = json.loads((oci_dir() / "index.json").read_text())
    descs = [d for d in index["manifests"] if d.get("annotations", {}).get(OCI_REF) == ref]
    if not descs:
        raise ImageError(f"{ref} is not in {oci_dir()}/index.json after the push")
    desc = dict(descs[-1])
    manifest = json.loads(_blob(desc["digest"]).read_text())
    # ctr names an imported image after this annotation (a full reference).
    desc["annotations"] = {"io.containerd.image.name": ref, OCI_REF: ref.rsplit(":", 1)[1]}
    layers = [layer["digest"] for layer in manifest["layers"]]
    send = [desc["digest"], manifest["config"]["digest"], *(d for d in layers if d not in have)]
    for digest in send:
        if _is_sparse(_blob(digest)):
            raise ImageError(f"{digest} is a stand-in in {oci_dir()}: remove that folder")
    index_bytes = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
    ctr = subprocess.Popen(
        ["ctr", "--address", str(realnode.CONTAINERD_SOCK), "--namespace", "k8s.io",
         "images", "import", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert ctr.stdin is not None and ctr.stdout is not None
    try:
        with tarfile.open(fileobj=ctr.stdin, mode="w|") as tar:
            _add_bytes(tar, "oci-layout", (oci_dir() / "oci-layout").read_bytes())
            _add_bytes(tar, "index.json", index_bytes)
            for digest in send:
                tar.add(_blob(digest), arcname=f"blobs/sha256/{digest.removeprefix('sha256:')}")
        ctr.stdin.close()
        out = ctr.stdout.read().decode(errors="replace")
    finally:
        ctr.wait()
    if ctr.returncode != 0:
        raise ImageError(f"ctr images import exited {ctr.returncode}: {out[-2000:]}")
    if not in_containerd(name, config_id):
        raise ImageError(f"{ref} is not in containerd after the import: {out[-2000:]}")
    sent = sum(_blob(d).stat().st_size for d in send) / 1e6
    for digest in layers:
        size = _blob(digest).stat().st_size
        if size >= SPARSE_MIN and not _is_sparse(_blob(digest)):
            _make_sparse(_blob(digest), size)
    took = time.monotonic() - t0
    say(f"{ref} imported into the real node's containerd in {took:.0f}s "
        f"({len(send)} of {len(layers) + 2} blobs sent, {sent:.1f} MB)")  # fmt: skip
    return took


def ensure_pause_image() -> None:
    """The node's sandbox image, imported again if the kubelet removed it: its eviction
    manager deletes unused images when the disk runs short (seen here while 6 GB imports and
    other builds filled it), and then no pod starts ("failed to get sandbox image")."""
    names = {line.split()[0] for line in realnode.ctr("images", "ls").stdout.splitlines()[1:]}
    if realnode.IMAGE in names:
        return
    pause = REPO_ROOT / ".cache" / "cluster" / "bin" / "pause"
    tar = realnode.image_tar(pause, CACHE / "pause-image.tar")
    realnode.import_image(tar)
    say(f"{realnode.IMAGE} was gone from containerd; imported it again")


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "step", nargs="?", default="all", choices=["all", "base", "build", "import"],
        help="all (default): build, then import if the real node runs",
    )  # fmt: skip
    ap.add_argument("--target", action="append", choices=list(TARGETS),
                    help="a Dockerfile target (repeatable; default: all)")  # fmt: skip
    ap.add_argument("--tag", default=DEFAULT_TAG)
    args = ap.parse_args(argv)
    targets = args.target or list(TARGETS)
    if os.geteuid() != 0:
        say("needs root (debootstrap, buildah's store, the node's containerd)")
        return 2
    t0 = time.monotonic()
    try:
        if args.step == "base":
            base_image()
        if args.step in ("all", "build"):
            build(targets, args.tag)
        if args.step == "import" and not node_running():
            raise ImageError("the real node is not running: make cluster-up NODE=real")
        if args.step in ("all", "import"):
            if node_running():
                for target in targets:
                    import_image(image_name(target, args.tag))
            else:
                say("the real node is not running; nothing imported")
    except ImageError as e:
        say(f"failed: {e}")
        return 1
    say(f"done in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

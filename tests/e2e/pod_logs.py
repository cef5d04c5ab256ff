"""Every pdd pod's log, kept on the host past the pod's deletion.

A roll replaces pods: by the time a test sees that a request failed mid-roll, the pods that
served it are gone, and `kubectl logs` has nothing of them. One `kubectl logs -f` per pod, from
the moment its container runs, writes ``<namespace>_<pod>_<uid>.log`` into a folder of the
stack's work dir; a test's diagnostics print the tails of those gone since.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from localcluster import Cluster

from pdd_api import keys

SELECTOR = f"{keys.LABEL_NAME}={keys.APP_NAME}"  # every pdd pod
POLL_S = 1.0


@dataclass
class PodLogs:
    cluster: Cluster
    folder: Path
    _followers: dict[str, tuple[subprocess.Popen[bytes], Path]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="pod-logs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for popen, _ in self._followers.values():
            with contextlib.suppress(ProcessLookupError):
                popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with contextlib.suppress(subprocess.SubprocessError, OSError, ValueError):
                self._follow_new()

    def _follow_new(self) -> None:
        listed = self.cluster.kubectl("get", "pods", "-A", "-l", SELECTOR, "-o", "json",
                                      check=False, timeout=30)
        if listed.returncode != 0:
            return
        for pod in json.loads(listed.stdout)["items"]:
            meta = pod["metadata"]
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            if meta["uid"] in self._followers or not any(
                    "running" in (s.get("state") or {}) for s in statuses):
                continue
            path = self.folder / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}.log"
            with open(path, "ab") as out:
                popen = subprocess.Popen(
                    ["kubectl", "--kubeconfig", str(self.cluster.kubeconfig), "logs", "-f",
                     "-n", meta["namespace"], meta["name"]],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self._followers[meta["uid"]] = (popen, path)

    def gone(self, namespace: str | None = None) -> list[Path]:
        """The logs of pods whose follower ended (the pod's container stopped)."""
        return sorted(path for popen, path in list(self._followers.values())
                      if popen.poll() is not None
                      and (namespace is None or path.name.startswith(f"{namespace}_")))

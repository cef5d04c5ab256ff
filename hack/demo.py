"""`make demo`: the whole pdd path on this machine, the way a user meets it.

    local control plane + a real node (kubelet, containerd, runc; the image of `make image`)
    -> CRD -> operator -> kubectl apply (P TP2/DCP2 -> D TP4/DCP4)
    -> pods with the operator's routing -> sidecars -> NIXL hand-off -> completion via the router

It prints `kubectl get pdd`, the conditions and the routing summary, sends one prompt through
the router Service, and compares the completion with the single-process reference. Exit status
0 only when everything worked and the tokens are equal. Everything it starts is stopped on exit,
Ctrl-C included (PDD_DEMO_KEEP=1 leaves the stack running for a look around).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

import harness  # noqa: E402

DEFAULT_PROMPT = (
    "Prefill and decode run on different pods; the KV cache of this prompt moves between "
    "them over NIXL, each decode rank reading exactly the chunks the routing plan gives it. "
    "One byte, one token: five blocks of sixty-four, so each of the four decode ranks reads."
)


def say(msg: str) -> None:
    print(msg, flush=True)


def banner(msg: str) -> None:
    say(f"\n==> {msg}")


def show(stack: harness.Stack, *args: str) -> str:
    say(f"$ kubectl {shlex.join(args)}")
    out = stack.kubectl(*args)
    say(out.rstrip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--example", default="p-tp2-dcp2-to-d-tp4-dcp4",
                    help="name of a manifests/examples/*.yaml")  # fmt: skip
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--namespace", default="pdd-demo")
    ap.add_argument("--work-dir", type=Path)
    args = ap.parse_args(argv)
    work_dir = args.work_dir or REPO_ROOT / ".cache" / "demo"
    if os.geteuid() != 0:
        say("make demo needs root: it runs a kubelet, containerd and the node's network")
        return 2

    # SIGTERM (and a closed terminal) clean up like Ctrl-C does.
    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)

    t0 = time.monotonic()
    stack = harness.Stack(work_dir, say=say)
    text, doc = harness.example(args.example)
    name = doc["metadata"]["name"]
    dtype = harness.spec_dtype(doc)
    ids = harness.prompt_ids(args.prompt)
    ref: dict[str, Any] = {}

    def compute_reference() -> None:
        try:
            ref["ids"] = harness.reference(ids, args.max_tokens, dtype)
        except Exception as e:  # noqa: BLE001 - reported when the result is needed
            ref["error"] = e

    ok = False
    try:
        banner("starting the local control plane, the real node, the CRD and the operator")
        stack.start()
        t_stack = time.monotonic()
        # The reference runs meanwhile: one process, one instance, no Kubernetes.
        ref_thread = threading.Thread(target=compute_reference, daemon=True)
        ref_thread.start()

        banner(f"applying the reference example {args.example}")
        stack.create_namespace(args.namespace)
        path = harness.EXAMPLES / f"{args.example}.yaml"
        # The demo's prompt is short: by default the router would prefill it on its decode
        # (spec.router.localPrefillTokens); with 0 it shows the prefill and the NIXL hand-off.
        say(f"$ kubectl apply -n {args.namespace} -f {path.relative_to(REPO_ROOT)}  "
            "# with spec.router.localPrefillTokens: 0, so the prompt takes the P/D path")
        say(stack.kubectl("apply", "-n", args.namespace, "-f", "-", input=text).rstrip())

        banner("waiting for the operator's pods to become Ready (sidecars load the model)")
        stack.wait_ready(name, args.namespace, timeout=900)
        t_ready = time.monotonic()
        say(f"Ready after {t_ready - t_stack:.0f}s")

        banner("what the user sees")
        show(stack, "get", "pdd", "-n", args.namespace)
        show(stack, "get", "pods", "-n", args.namespace, "-o", "wide")
        obj = stack.get("pddeployment", name, args.namespace) or {}
        status = obj.get("status") or {}
        say("\nconditions:")
        for c in status.get("conditions", []):
            say(f"  {c['type']:<17} {c['status']:<6} {c.get('reason', ''):<18} "
                f"{c.get('message', '')}")  # fmt: skip
        say(f"\nrouting: {status.get('routingCase')}: {status.get('routingSummary')}")

        banner(
            f"sending the prompt through the router ({stack.router_url(name, args.namespace)})"
        )
        say(f"prompt ({len(ids)} tokens): {args.prompt!r}")
        t_req = time.monotonic()
        result = stack.complete(name, args.namespace, ids, args.max_tokens)
        choice = result["choices"][0]
        got = list(choice["token_ids"])
        say(f"completion token ids: {got}  ({time.monotonic() - t_req:.1f}s)")
        say(f"completion text:      {bytes(t for t in got if t < 256)!r}")
        transfer = (result.get("pdd") or {}).get("transfer") or {}
        if transfer:
            per_rank = ", ".join(f"D{r['rank']}:{r['bytes']}B" for r in transfer.get("ranks", []))
            say(f"NIXL hand-off:        {transfer.get('bytes')} bytes "
                f"({per_rank})")  # fmt: skip
        served = {k: v for k, v in (result.get("pdd") or {}).items() if k != "transfer"}
        say(f"served by:            {json.dumps(served)}")

        ref_thread.join()
        if "error" in ref:
            raise ref["error"]
        say(
            f"reference token ids:  {ref['ids']}  "
            f"(python -m pdd_sidecar generate, one process, {dtype})"
        )
        ok = got == ref["ids"]
        banner("completion EQUALS the single-process reference" if ok else
               "completion DIFFERS from the single-process reference")  # fmt: skip
        say(f"wall time: {time.monotonic() - t0:.0f}s (stack {t_stack - t0:.0f}s, "
            f"to Ready {t_ready - t_stack:.0f}s)")  # fmt: skip
    except KeyboardInterrupt:
        say("\ninterrupted; cleaning up")
    except (harness.StackError, harness.localcluster.ClusterError) as e:
        say(f"\nFAILED: {e}")
    except Exception as e:  # noqa: BLE001 - anything else fails the demo loudly too
        say(f"\nFAILED: {type(e).__name__}: {e}")
        say(stack.diagnostics(20))
    finally:
        if os.environ.get("PDD_DEMO_KEEP") == "1" and stack.cluster is not None:
            say(f"\nPDD_DEMO_KEEP=1: left running; KUBECONFIG={stack.kubeconfig}")
            if stack.pod_logs is not None:  # its followers end with the demo
                stack.pod_logs.stop()
        else:
            banner("cleaning up")
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not strand pods
            if stack.cluster is not None:
                stack.kubectl("delete", "namespace", args.namespace, "--wait=false", check=False)
            stack.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

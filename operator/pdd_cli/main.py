"""`pdd`: the checks and plans a user runs before (or instead of) applying to a cluster."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdd_api.crd import crd_yaml, role_scale_crd_yaml
from pdd_api.models import KIND, ROLE_SCALE_KIND
from pdd_api.models_catalog import KNOWN_MODELS
from pdd_api.plan import RoutingPlan
from pdd_api.routing import bytes_per_decode_rank, plan_for_spec
from pdd_api.validation import (
    UnusableInputError,
    describe_document,
    load_documents,
    parse_spec,
    validate_document,
)
from pdd_cli.diagram import render_diagram, sides_title

EXIT_OK, EXIT_INVALID, EXIT_UNUSABLE = 0, 1, 2


def _read(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UnusableInputError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UnusableInputError(f"cannot read {path}: not UTF-8 text") from None


def _load(path: str) -> list[Any]:
    return load_documents(_read(path))


def cmd_validate(args: argparse.Namespace) -> int:
    docs = _load(args.file)
    bad = 0
    for i, doc in enumerate(docs):
        problems = validate_document(doc)
        if problems:
            bad += 1
            where = describe_document(i, doc)
            for p in problems:
                print(f"{args.file}: {where}: {p}", file=sys.stderr)
    if bad:
        print(f"{args.file}: {bad} of {len(docs)} document(s) invalid", file=sys.stderr)
        return EXIT_INVALID
    print(f"{args.file}: {len(docs)} document(s) valid")
    return EXIT_OK


def plan_for(doc: Any) -> RoutingPlan:
    return plan_for_spec(parse_spec(doc.get("spec") if isinstance(doc, dict) else None))


def _chunk_class(modulus: int, residue: int) -> str:
    return "all chunks" if modulus == 1 else f"g%{modulus}=={residue}"


def plan_text(name: str, plan: RoutingPlan, tokens: int | None, bpt: int | None) -> str:
    p, d = plan.prefill, plan.decode
    lines = [
        f"{name}: P TP{p.tensor_parallel_size}/DCP{p.decode_context_parallel_size} -> "
        f"D TP{d.tensor_parallel_size}/DCP{d.decode_context_parallel_size}  "
        f"case {plan.case}  blockSize {plan.block_size}",
        f"summary: {plan.summary()}",
    ]
    sizes = bytes_per_decode_rank(plan, tokens, bpt) if tokens and bpt else None
    header = ["decode rank", "reads from (prefill rank: chunks)", "notifies"]
    if tokens is not None:
        header.append(f"bytes for {tokens} tokens" if sizes else f"tokens of {tokens}")
    rows = [header]
    for dr in plan.decode_ranks:
        row = [
            f"D{dr.rank}",
            ", ".join(f"P{r.prefill_rank}: {_chunk_class(r.chunk_modulus, r.chunk_residue)}"
                      for r in dr.reads),
            ",".join(f"P{n}" for n in dr.notifies),
        ]
        if sizes:
            row.append(f"{sizes[dr.rank]:,}")
        elif tokens is not None:
            row.append(f"{bytes_per_decode_rank(plan, tokens, 1)[dr.rank]:,}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines.append(
        "expected notifications: "
        + ", ".join(f"P{pr.rank}={pr.expected_notifications}" for pr in plan.prefill_ranks)
    )
    if sizes:
        lines.append(f"total bytes per request: {sum(sizes):,} ({bpt:,} bytes per token)")
    return "\n".join(lines)


def _bytes_per_token(doc: Any, override: int | None) -> int | None:
    if override is not None:
        return override
    model = doc["spec"]["model"]
    shape = KNOWN_MODELS.get(model.get("name", ""))
    return shape.bytes_per_token(model.get("dtype", "bfloat16")) if shape else None


def cmd_plan(args: argparse.Namespace) -> int:
    docs = _load(args.file)
    invalid = False
    for i, doc in enumerate(docs):
        problems = validate_document(doc)
        if problems:
            invalid = True
            for prob in problems:
                print(f"{args.file}: {describe_document(i, doc)}: {prob}", file=sys.stderr)
            continue
        plan = plan_for(doc)
        if args.output == "json":
            print(plan.to_json())
        elif args.output == "diagram":
            if i:
                print()
            print(render_diagram(plan, f"{doc['metadata']['name']}: " + sides_title(plan)))
        else:
            if i:
                print()
            bpt = _bytes_per_token(doc, args.bytes_per_token)
            if args.tokens is not None and bpt is None:
                print(f"# unknown model {doc['spec']['model']['name']!r}: showing tokens per "
                      "rank; pass --bytes-per-token for bytes")
            print(plan_text(doc["metadata"]["name"], plan, args.tokens, bpt))
    return EXIT_INVALID if invalid else EXIT_OK


def cmd_crd(args: argparse.Namespace) -> int:
    sys.stdout.write(role_scale_crd_yaml() if args.kind == ROLE_SCALE_KIND else crd_yaml())
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdd", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check PDDeployment and PDDRoleScale documents; exit 1 "
                       "when invalid")
    v.add_argument("-f", "--file", required=True, help="YAML file ('-' for stdin)")
    v.set_defaults(func=cmd_validate)
    p = sub.add_parser("plan", help="show which decode rank reads which prefill ranks")
    p.add_argument("-f", "--file", required=True, help="YAML file ('-' for stdin)")
    p.add_argument("-o", "--output", choices=["text", "json", "diagram"], default="text")
    p.add_argument("--tokens", type=int, help="prompt length for per-rank bytes")
    p.add_argument("--bytes-per-token", type=int, help="KV bytes per token (all layers)")
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser("crd", help="print a CustomResourceDefinition")
    c.add_argument("--kind", choices=[KIND, ROLE_SCALE_KIND], default=KIND,
                   help=f"which one (default {KIND})")
    c.set_defaults(func=cmd_crd)
    g = sub.add_parser("generate", help="greedy generation in one instance (needs torch)",
                       add_help=False)
    g.set_defaults(func=None)
    s = sub.add_parser("serve", help="prefill, decode and router as local processes, no cluster "
                       "(needs torch)", add_help=False)
    s.set_defaults(func=None)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        from pdd_sidecar.engine.generate import main as generate_main  # torch lives in the sidecar

        return generate_main(argv[1:])
    if argv[:1] == ["serve"]:
        from pdd_sidecar.serve.local_stack import main as serve_main  # imports no torch itself

        return serve_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UnusableInputError as exc:
        print(f"pdd {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except BrokenPipeError:
        # The reader (`| head`) left; point stdout at /dev/null so the exit flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

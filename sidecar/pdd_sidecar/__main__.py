"""`python -m pdd_sidecar serve|router`: the entry points the operator starts in pods.

`serve` reads the role and everything else from the environment (see pdd_sidecar.env);
`router` likewise. `generate` is the single-instance reference (`pdd generate`).
"""

from __future__ import annotations

import sys

USAGE = "usage: python -m pdd_sidecar {serve|router|generate} (configuration from environment)"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from pdd_sidecar.serve.instance.server import serve

        return serve()
    if command == "router":
        from pdd_sidecar.serve.router.router import main as router_main

        return router_main()
    if command == "generate":
        from pdd_sidecar.engine.generate import main as generate_main

        return generate_main(rest)
    print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

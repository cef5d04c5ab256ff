"""The optional vLLM tier (`make test-vllm`): runs in its own venv with the `vllm` package.

Elsewhere (the project venv, a bare `pytest`) vLLM is absent and the tier is not collected;
`make test-vllm` sets PDD_TEST_VLLM=1, and then a missing vLLM is a failure, not a skip.
"""

import importlib.util
import os

collect_ignore_glob: list[str] = []
if not os.environ.get("PDD_TEST_VLLM") and importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

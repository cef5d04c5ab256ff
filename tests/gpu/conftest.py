"""tests/gpu/ holds scripts run by hand on GPU machines (README.md). Pytest collects only
``test_kernels.py``, which skips itself without CUDA; the other scripts are programs."""

collect_ignore_glob = ["sweep.py", "bf16_margin.py"]

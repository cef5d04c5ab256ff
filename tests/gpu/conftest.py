"""tests/gpu/ holds what runs by hand on GPU machines (README.md). Pytest collects the
``test_*.py`` files, which skip themselves without CUDA; ``sweep.py`` and ``bf16_margin.py`` are
programs."""

collect_ignore_glob = ["sweep.py", "bf16_margin.py"]

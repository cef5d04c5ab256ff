"""tests/gpu/ holds scripts run by hand on GPU machines (README.md): pytest collects none."""

collect_ignore_glob = ["*.py"]

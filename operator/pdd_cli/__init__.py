"""The `pdd` command line: validate, plan, crd, generate."""

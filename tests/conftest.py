"""Shared by every tier: tests/ on sys.path so tiers share case tables (spec_cases.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

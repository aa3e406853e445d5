"""Tests of dsv41attn/ops, one module per op folder (a package, so that its conftest's oracles
import as ``.conftest`` and never shadow tests/conftest.py)."""

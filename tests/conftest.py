import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def fixture_files() -> list[Path]:
    """Every golden fixture: $DSV41ATTN_FIXTURES, then ../shared/fixtures beside the checkout,
    then the copies committed in tests/fixtures (by file name, the first found wins)."""
    dirs = [os.environ.get("DSV41ATTN_FIXTURES"), ROOT.parent / "shared" / "fixtures",
            ROOT / "tests" / "fixtures"]
    found: dict[str, Path] = {}
    for d in dirs:
        if d and Path(d).is_dir():
            for f in sorted(Path(d).glob("*.safetensors")):
                found.setdefault(f.name, f)
    return [found[k] for k in sorted(found)]


@pytest.fixture(scope="session")
def tiny():
    from dsv41attn import preset
    return preset("tiny")


@pytest.fixture(scope="session")
def flash():
    from dsv41attn import preset
    return preset("v41-flash")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield

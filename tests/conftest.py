import pytest

from vlmrl.testing.assets import TinyAssets, ensure_tiny_assets


@pytest.fixture(scope="session")
def tiny_assets() -> TinyAssets:
    """The shared tiny Qwen2.5-VL and synthetic colour data (built once, cached on disk)."""
    return ensure_tiny_assets()

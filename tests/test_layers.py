"""The package map holds: every import-linter contract in pyproject.toml is kept.

The contracts encode the package table of docs/architecture/index.md (each package imports only the
layers below it; nothing imports the driver). An import that runs upward, or
a cycle between layers, fails here with the import chain that breaks it.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_imports_only_the_layers_below_it():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in proc.stdout


def test_every_package_is_placed_in_a_layer():
    # A new package left out of the layers would be free to import anything.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    placed = {name.strip() for layer in config["layers"] for name in layer.split("|")}
    packages = {
        f"vlmrl.{p.stem if p.is_file() else p.name}"
        for p in (ROOT / "vlmrl").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert packages <= placed, sorted(packages - placed)


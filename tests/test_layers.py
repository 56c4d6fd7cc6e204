"""The import layers of docs/design.md, as import-linter contracts in pyproject.toml: a new cycle between layers, the
trainer reaching above the rule book and the checkpoint format, or typer/rich outside the CLI fails the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is missing: pip install -e '.[test]'"
    done = subprocess.run([lint], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout, done.stdout[-2000:]

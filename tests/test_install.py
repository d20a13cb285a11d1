"""What a plain install puts into site-packages: `tokenizer_service` and `tokenizer_client`, nothing named
`app` or `client` (issue 35). The checkout keeps the layers' folders (app/, client/); pyproject maps them.

The slow test builds the wheel, installs it into a fresh virtual environment and imports both packages
from a folder that holds a `client.py` and an `app/` package of a user's own, as a newcomer's project does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"tokenizer_service": "app", "tokenizer_client": "client"}


def test_pyproject_lists_every_package_of_the_tree_under_its_installed_name():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == FOLDERS
    in_tree = {
        ".".join((name, *init.parent.relative_to(ROOT / folder).parts))
        for name, folder in FOLDERS.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(config["packages"]) == in_tree


def test_the_installed_names_are_the_ones_imported():
    import tokenizer_client
    import tokenizer_service

    assert Path(tokenizer_service.__file__).resolve().parent == ROOT / "app"
    assert Path(tokenizer_client.__file__).resolve().parent == ROOT / "client"


@pytest.mark.slow
def test_the_wheel_installs_names_that_cannot_collide(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("tokenizer_service-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"{wheel}[server]"],
        check=True,
        timeout=600,
    )
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    assert (site / "tokenizer_service" / "models" / "default.model").is_file()
    assert (site / "tokenizer_client" / "prefetch" / "__init__.py").is_file()
    assert not (site / "app").exists() and not (site / "client").exists()

    # A newcomer's project: its own client.py and app/ beside the script, first on sys.path.
    project = tmp_path / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("OWN = 'the project app'\n")
    (project / "client.py").write_text("OWN = 'the project client'\n")
    script = (
        "import app, client\n"
        "assert app.OWN == 'the project app' and client.OWN == 'the project client'\n"
        "from tokenizer_client import TokenizerClient, PackSpec, TokenDataset, Mixture\n"
        "import tokenizer_service.cli\n"
        "print('ok')\n"
    )
    done = subprocess.run([python, "-c", script], cwd=project, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    helped = subprocess.run(
        [python, "-m", "tokenizer_service", "--help"], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0, helped.stderr
    assert "--model" in helped.stdout
    command = subprocess.run(
        [venv / "bin" / "tokenizer-server", "--help"], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert command.returncode == 0, command.stderr

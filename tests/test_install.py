"""The README's set-up: its first screen (clone, venv, the two commands), and that
constraints-cpu.txt makes pip pick torch's CPU build where PyPI offers only the CUDA one.

The resolution test runs the real pip (``--dry-run``, without this machine's pip config) against
two local indexes standing in for PyPI (torch X, as PyPI's Linux wheel is the CUDA build) and
for PyTorch's CPU index (torch X+cpu): the committed constraints file, with its index URL
pointed at the stand-in, must pick X+cpu, and without that index must stop rather than take X.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints-cpu.txt"
INSTALL = "pip install -c constraints-cpu.txt -e"


def first_block(text: str) -> str:
    """The README's first fenced shell block."""
    match = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no ```bash block"
    return match.group(1)


def test_readme_first_screen_is_clone_venv_and_two_commands():
    readme = (REPO / "README.md").read_text()
    block = first_block(readme)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands[0].startswith("git clone ") and commands[1].startswith("python3 -m venv ")
    setup = commands[2:]
    assert setup == [f"{INSTALL} . && arbor train configs/quickstart.yaml",
                     f"{INSTALL} '.[dev,gguf,bench,envs,programs]' && pytest"], setup
    # Each command says what it takes, in a comment line above it.
    comments = [line for line in block.splitlines() if line.startswith("# ")]
    assert len(comments) >= 2 and all(re.search(r"\d+(\.\d+)? ?(GB|MB)", c) for c in comments[-2:]), comments
    # What the quickstart is comes before the CI paragraph.
    assert readme.index("The quickstart is") < readme.index(".ci/run")


def test_ci_and_development_docs_install_as_the_readme_does():
    second = f"{INSTALL} '.[dev,gguf,bench,envs,programs]'"
    assert f"python3 -m {second}" in (REPO / ".ci" / "run").read_text().replace(" -q", "")
    assert second in (REPO / "docs" / "development.md").read_text()


def _wheel(directory: Path, version: str) -> Path:
    """A minimal pure-Python wheel of a package named torch at ``version`` (metadata only)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version.split('+')[0]}.dist-info"
    files = {
        "torch/__init__.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(text)}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def _index(root: Path, wheel: Path) -> str:
    """A PEP 503 simple index at ``root`` holding ``wheel``; its file:// URL."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    (root / "index.html").write_text('<a href="torch/">torch</a>\n')
    return root.as_uri()


def _resolve(tmp_path: Path, public: str, constraints: Path) -> subprocess.CompletedProcess:
    # No pip configuration of this machine (its files and PIP_* variables: find-links, mirrors, constraints).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
         "--disable-pip-version-check", "--retries", "0", "--index-url", public, "-c", str(constraints),
         "--report", str(tmp_path / "report.json"), "torch"],
        capture_output=True, text=True, timeout=120, env=env,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the +cpu pin is Linux's (PyPI's macOS and Windows wheels are CPU builds)")
def test_constraints_pick_the_cpu_build_over_pypis_cuda_build(tmp_path):
    text = CONSTRAINTS.read_text()
    (url,) = re.findall(r"^--extra-index-url (\S+)$", text, re.M)
    (pin,) = re.findall(r'^torch==(\S+\+cpu); platform_system == "Linux"$', text, re.M)
    public = _index(tmp_path / "public", _wheel(tmp_path / "w-public", pin.removesuffix("+cpu")))
    cpu = _index(tmp_path / "cpu", _wheel(tmp_path / "w-cpu", pin))
    with_index = tmp_path / "with-index.txt"
    with_index.write_text(text.replace(url, cpu))
    done = _resolve(tmp_path, public, with_index)
    assert done.returncode == 0, done.stderr
    (install,) = json.loads((tmp_path / "report.json").read_text())["install"]
    assert install["metadata"]["version"] == pin and "/w-cpu/" in install["download_info"]["url"]
    # Only the public index (the CPU index left out or unreachable): pip stops, it takes no CUDA build.
    public_only = tmp_path / "public-only.txt"
    public_only.write_text(text.replace(f"--extra-index-url {url}", ""))
    done = _resolve(tmp_path, public, public_only)
    assert done.returncode != 0 and f"torch=={pin}" in done.stderr + done.stdout

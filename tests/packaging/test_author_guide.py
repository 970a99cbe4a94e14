"""The backend-author guide, followed literally: from an empty folder to a passing ``check``.

``docs/backend-authors.md`` must be usable without a docs build (issue 14, items 6 and
7): its table lists exactly the files that its ``literalinclude`` blocks show, and its
"Try it" block, run command by command in an empty folder of a fresh venv, installs core
and ``cpu`` from a clone, builds the worked example's wheel, runs its tests and passes
the conformance suite. The venv holds nothing of this project beforehand, and of the
test environment only torch and numpy, standing for "your engine's torch build" (the
guide never installs torch). Everything else comes from the clone and the package index
pip is configured with.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from support.venvs import add_site

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "backend-authors.md"
WALK_MARKER = "<!-- tests/packaging/test_author_guide.py runs the next block, command by command -->"
#: What a fresh venv is given besides the guide's commands: the engine's torch build.
ENGINE_DISTS = ("torch", "numpy")


def guide() -> str:
    return GUIDE.read_text()


# -- the guide can be read without a build -------------------------------------------------


def included() -> list[tuple[str, dict[str, str]]]:
    """(path relative to the repository, options) of every literalinclude in the guide."""
    out = []
    for m in re.finditer(r"```\{literalinclude\} (\S+)\n((?::\w[\w-]*:.*\n)*)```", guide()):
        options = dict(re.findall(r"^:([\w-]+): ?(.*)$", m.group(2), re.M))
        out.append((os.path.normpath(os.path.join("docs", m.group(1))), options))
    return out


def test_the_guide_lists_exactly_the_files_it_includes() -> None:
    rows = re.findall(r"^\| \[`([^`]+)`\]\(([^)]+)\) \|", guide(), re.M)
    assert rows, "the guide has no table of included files"
    for shown, link in rows:
        assert os.path.normpath(os.path.join("docs", link)) == shown, f"the link of {shown} points elsewhere"
    assert sorted(shown for shown, _ in rows) == sorted({path for path, _ in included()})


def top_level_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def test_every_included_snippet_resolves() -> None:
    """What Sphinx would show exists: the file, its ``pyobject`` and its ``start-at``/``end-at`` lines."""
    for path, options in included():
        source = (ROOT / path).read_text()
        if "pyobject" in options:
            assert options["pyobject"] in top_level_names(source), f"{path} has no {options['pyobject']}"
        for key in ("start-at", "end-at"):
            if key in options:
                assert options[key] in source, f"{path} has no line with {options[key]!r}"


def walk_commands() -> list[str]:
    """The commands of the guide's "Try it" block, without their ``$`` prompts."""
    text = guide()
    assert text.count(WALK_MARKER) == 1, "the guide's walk block lost its marker"
    block = text.split(WALK_MARKER, 1)[1].split("```console\n", 1)[1].split("```", 1)[0]
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")]


# -- the walk ------------------------------------------------------------------------------


def clone_of_the_working_tree(dest: Path) -> Path:
    """What ``git clone`` of this working tree would hold: tracked and unignored files only."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def engine_site(mirror: Path) -> Path:
    """A directory of links to torch, numpy and their dependencies, and nothing else."""
    wanted, seen = list(ENGINE_DISTS), set()
    mirror.mkdir()
    while wanted:
        name = wanted.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        dist = importlib.metadata.distribution(name)
        for req in map(Requirement, dist.requires or ()):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                wanted.append(req.name)
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (mirror / top).exists() and top != "__pycache__":
                (mirror / top).symlink_to(src)
    return mirror


def fresh_venv(root: Path) -> Path:
    """A venv with pip and the engine's torch, without this project or the test tools."""
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    add_site(root / "venv" / "bin" / "python", engine_site(root / "engine-site"), "_engine_torch")
    return root / "venv" / "bin"


def shell_env(bin_dir: Path) -> dict[str, str]:
    """An activated venv: no PYTHONPATH, no lmcache-platform variables of the test run."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LMCACHE_", "PYTHON", "PYTEST", "VIRTUAL_ENV"))
    }
    return {**keep, "VIRTUAL_ENV": str(bin_dir.parent), "PATH": f"{bin_dir}{os.pathsep}{keep['PATH']}"}


def run_walk(root: Path) -> tuple[Path, dict[str, str], str]:
    """Run the walk: (the new project folder, the venv's environment, output per command)."""
    bin_dir = fresh_venv(root)
    env = shell_env(bin_dir)
    probe = subprocess.run(
        [bin_dir / "pip", "download", "--no-deps", "-q", "-d", root / "probe", "pluggy"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"no package index is reachable, and the walk installs core's dependencies: {probe.stderr}"
        )
    checkout = clone_of_the_working_tree(root / "checkout")
    commands = walk_commands()
    assert commands[0].startswith("CHECKOUT="), "the walk starts by naming the clone"
    commands[0] = f"CHECKOUT={checkout}"
    script = "set -euo pipefail\n" + "".join(f"echo '@@@ {c}'\n{c}\n" for c in commands)
    work = root / "empty"
    work.mkdir()
    proc = subprocess.run(
        ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, check=False
    )
    failed = (re.findall(r"^@@@ (.*)$", proc.stdout, re.M) or ["(none)"])[-1]
    assert proc.returncode == 0, (
        f"the guide's command `{failed}` failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    )
    return work / "lmcache-platform-cpu-file", env, proc.stdout


def output_of(stdout: str, command_prefix: str) -> str:
    part = stdout.split(f"@@@ {command_prefix}", 1)[1]
    return part.split("\n@@@ ", 1)[0]


@pytest.mark.slow
def test_a_newcomer_follows_the_guide_from_an_empty_folder_to_a_passing_check(tmp_path: Path) -> None:
    """One test, in order: the walk, what it installed, then the same venv without pytest."""
    project, env, stdout = run_walk(tmp_path)
    listing = output_of(stdout, "lmcache-platform list")
    assert re.search(r"^cpu \*\s+cpu\s+lmcache-platform-cpu\s+0\.1\.0\s+ok", listing, re.M), listing
    assert re.search(r"^cpu\.file\s+cpu\s+lmcache-platform-cpu-file\s+0\.1\.0\s+unavailable", listing, re.M)
    assert re.search(r"\b2 passed in ", output_of(stdout, "pytest tests"))
    check = output_of(stdout, "lmcache-platform check cpu.file")
    assert "lmcache-platform check cpu.file: PASS" in check and " 0 failed, 0 errors, 0 skipped" in check
    assert os.listdir(project / "kv") == [], "the conformance suite left KV files behind"

    # Everything ran from the venv: the clone's wheels and the index's pytest, not this checkout.
    code = (
        "import lmcache_platform, lmcache_platform_cpu, lmcache_platform_cpu_file, pytest\n"
        "for m in (lmcache_platform, lmcache_platform_cpu, lmcache_platform_cpu_file, pytest):\n"
        "    print(m.__file__)\n"
    )
    files = subprocess.run(
        ["python", "-c", code], cwd=project, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(files) == 4 and all(f.startswith(env["VIRTUAL_ENV"]) for f in files), files

    # The same venv without the [check] extra's pytest: no verdict, the command that installs it.
    subprocess.run(
        ["pip", "uninstall", "-y", "-q", "pytest"], cwd=project, env=env, check=True, capture_output=True
    )
    proc = subprocess.run(
        ["lmcache-platform", "check", "cpu.file"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'install it with: pip install "lmcache-platform[check]"' in proc.stderr
    assert "FAIL" not in proc.stdout + proc.stderr

"""scripts/ensure-system-deps.sh: `make test` gets the programs its tests drive, or says how.

The script runs with a PATH that holds only stand-ins (for prometheus, promtool, openssl,
``id`` and ``apt-get``), so every branch is exercised without touching the system.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ensure-system-deps.sh"
BASH = shutil.which("bash") or "/bin/bash"
CHMOD = shutil.which("chmod") or "/bin/chmod"
PROGRAMS = ("prometheus", "promtool", "openssl")
# What each stand-in package puts on PATH.
PACKAGE_PROGRAMS = {"prometheus": ("prometheus", "promtool"), "openssl": ("openssl",)}


def write_program(directory: Path, name: str, body: str = "exit 0") -> None:
    path = directory / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def make_bin(
    tmp_path: Path, programs: tuple[str, ...], *, uid: int | None, apt: str | None
) -> Path:
    """A PATH directory with stand-ins: ``programs``, ``id -u`` printing ``uid`` (when
    given) and an apt-get that logs its calls and, when ``apt`` is "installs", puts the
    requested packages' programs on PATH."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for name in programs:
        write_program(directory, name)
    if uid is not None:
        write_program(directory, "id", f'[ "$1" = -u ] && echo {uid}')
    if apt is not None:
        log = tmp_path / "apt.log"
        lines = [f'echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> {log}']
        if apt == "installs":
            for package, names in PACKAGE_PROGRAMS.items():
                touches = "; ".join(
                    f"printf '#!{BASH}\\nexit 0\\n' > {directory / name}; "
                    f"{CHMOD} 755 {directory / name}"
                    for name in names
                )
                lines.append(f'case " $* " in *" {package} "*) {touches};; esac')
        write_program(directory, "apt-get", "\n".join(lines))
    return directory


def run_script(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT)],
        env={"PATH": str(directory)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_all_present_does_nothing(tmp_path: Path) -> None:
    directory = make_bin(tmp_path, PROGRAMS, uid=0, apt="installs")
    result = run_script(directory)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert apt_calls(tmp_path) == []


def test_missing_without_apt_stops_with_the_install_command(tmp_path: Path) -> None:
    directory = make_bin(tmp_path, ("openssl",), uid=0, apt=None)
    result = run_script(directory)
    assert result.returncode != 0
    assert "not on PATH: prometheus promtool." in result.stderr
    assert "sudo apt-get install -y -q --no-install-recommends prometheus\n" in result.stderr, (
        result.stderr
    )


def test_missing_as_non_root_stops_with_sudo_command(tmp_path: Path) -> None:
    directory = make_bin(tmp_path, (), uid=1000, apt="installs")
    result = run_script(directory)
    assert result.returncode != 0
    assert "needs root" in result.stderr
    assert (
        "sudo apt-get update && sudo apt-get install -y -q --no-install-recommends "
        "prometheus openssl\n" in result.stderr
    ), result.stderr
    assert apt_calls(tmp_path) == [], "a non-root run must not call apt-get"


def test_missing_as_root_installs_with_apt(tmp_path: Path) -> None:
    directory = make_bin(tmp_path, ("prometheus", "promtool"), uid=0, apt="installs")
    result = run_script(directory)
    assert result.returncode == 0, result.stderr
    assert apt_calls(tmp_path) == [
        "DEBIAN_FRONTEND=noninteractive update -q",
        "DEBIAN_FRONTEND=noninteractive install -y -q --no-install-recommends openssl",
    ]
    assert (directory / "openssl").exists()


def test_install_that_leaves_programs_missing_fails(tmp_path: Path) -> None:
    directory = make_bin(tmp_path, ("openssl",), uid=0, apt="does nothing")
    result = run_script(directory)
    assert result.returncode != 0
    assert "prometheus promtool is still not on PATH" in result.stderr
    assert len(apt_calls(tmp_path)) == 2


def test_make_test_ensures_system_deps_first() -> None:
    makefile = (ROOT / "Makefile").read_text()
    prerequisites = re.search(r"^test:(.*)$", makefile, re.MULTILINE)
    assert prerequisites is not None
    assert prerequisites.group(1).split()[0] == "system-deps"
    assert re.search(r"^system-deps:\n\tbash scripts/ensure-system-deps.sh$", makefile, re.M)


def test_ci_runs_only_the_readme_commands() -> None:
    """CI adds nothing a user's fresh machine would lack: it runs the README's commands."""
    readme = (ROOT / "README.md").read_text()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines if line.strip() and not line.startswith("#")]
    assert commands[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    make_commands = commands[2:]
    assert make_commands == [
        "make install", "make proto-check", "make lint", "make typecheck", "make test"
    ]  # fmt: skip
    for command in make_commands:
        assert f"`{command}`" in readme, f"the README does not name `{command}`"

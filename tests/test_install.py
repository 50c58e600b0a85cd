"""Installs are what was tested: every dependency of pyproject.toml has a lower bound,
requirements/lowest.txt pins exactly those bounds (`make test-lowest` runs the suite on
them) and requirements/lock-cpu.txt pins every dependency at a version the bounds allow
(`make test` runs the suite on it)."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra if not r.startswith("moremoe")]
    return reqs


def _lower_bounds() -> dict[str, Version]:
    bounds: dict[str, Version] = {}
    for req in _requirements():
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert len(lows) == 1, f"{req}: every dependency needs one >= lower bound"
        name = canonicalize_name(req.name)
        assert bounds.setdefault(name, lows[0]) == lows[0], \
            f"{req.name} has two lower bounds in pyproject.toml: {bounds[name]} and {lows[0]}"
    return bounds


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==(\S+)", line.strip()).groups()
            pins[canonicalize_name(name)] = version
    return pins


def test_lowest_pins_exactly_the_lower_bounds():
    lowest = {name: Version(v) for name, v in _pins(ROOT / "requirements/lowest.txt").items()}
    assert lowest == _lower_bounds()


def test_the_lock_pins_every_dependency_within_its_bounds():
    lock = _pins(ROOT / "requirements/lock-cpu.txt")
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} is not in the lock: run make lock"
        version = Version(lock[name]).public      # torch's +cpu is a local label
        assert req.specifier.contains(version, prereleases=True), \
            f"the lock's {req.name}=={lock[name]} is outside pyproject's {req}"

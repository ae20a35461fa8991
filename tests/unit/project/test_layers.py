"""The house's floors (README, "Architecture"): every import between top-level packages points
down, so a reader knows what a module can depend on from where it lives.

    floor 5  sim/                              the model service and what drives the product
    floor 4  hardelete/                        the CLI and the operator commands
    floor 3  tracker/  reaper/  reconciler/    the components; none imports another
    floor 2  core/                             what every process shares (settings, gate, clock)
    floor 1  schemas/                          the contracts; imports nothing of the project

Imports inside functions count too: a late import is still a dependency. Tests import the
packages, never each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FLOORS = {"schemas": 1, "core": 2, "tracker": 3, "reaper": 3, "reconciler": 3,
          "hardelete": 4, "sim": 5}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def upward(floors: dict[str, int], root: Path) -> list[str]:
    """Every import that runs back up a floor or sideways into another package of its floor."""
    found = []
    for package, floor in floors.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported(path):
                top = module.split(".")[0]
                if top in floors and top != package and floors[top] >= floor:
                    found.append(f"{path.relative_to(root)}:{line} imports {module} "
                                 f"(floor {floors[top]} from floor {floor})")
    return found


def test_every_import_between_packages_points_down() -> None:
    assert upward(FLOORS, ROOT) == []


def test_the_check_sees_an_import_that_runs_back_up(tmp_path: Path) -> None:
    for package, body in {"schemas": "from core.settings import Settings\n",
                          "core": "import schemas.events\n",
                          "tracker": "def f() -> None:\n    from reaper import daemon\n",
                          "reaper": "from core import gate\n"}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text(body)
    found = upward({"schemas": 1, "core": 2, "tracker": 3, "reaper": 3}, tmp_path)
    assert found == ["schemas/m.py:1 imports core.settings (floor 2 from floor 1)",
                     "tracker/m.py:2 imports reaper (floor 3 from floor 3)"]


def test_no_test_module_imports_another() -> None:
    """Shared fixtures live in conftest.py, shared helpers in sim/ (no test imports conftest)."""
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / "tests").rglob("*.py"))
             for line, module in imported(path)
             if module == "tests" or module.startswith("tests.")]
    assert found == []


def test_every_package_has_a_floor() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(FLOORS)


def test_a_unit_test_that_reaches_a_server_is_named() -> None:
    from sim.testing import misplaced_tests

    found = misplaced_tests([("tests/unit/test_a.py::test_pure", False, ["tmp_path"]),
                             ("tests/unit/test_a.py::test_redis", False, ["redis_client", "s3"]),
                             ("tests/integration/test_b.py::test_kafka", True, ["settings"])])
    assert found == ["tests/unit/test_a.py::test_redis uses redis_client, s3"]


def test_every_test_sits_in_its_components_folder() -> None:
    """tests/<unit|integration>/<component>/test_*.py, the component a package of the house
    (or ``project`` for the checks of the whole tree): one place to look for a component's
    tests."""
    components = set(FLOORS) | {"project"}
    misplaced = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
                 if len(p.relative_to(ROOT / "tests").parts) != 3
                 or p.relative_to(ROOT / "tests").parts[0] not in ("unit", "integration")
                 or p.parent.name not in components]
    assert misplaced == []

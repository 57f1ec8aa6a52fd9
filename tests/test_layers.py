"""The layer rule of DESIGN section 2 holds, and its check catches a breach."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _checker() -> ModuleType:
    name = "_sessionactors_tests_check_layers"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "check_layers.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "sessionactors", tmp_path / "sessionactors")
    return tmp_path


def test_the_package_keeps_its_layers() -> None:
    """No core module imports a plug-in or a higher layer, and no import goes in a circle."""
    assert _checker().breaches(ROOT) == []


def test_a_core_module_importing_a_plug_in_is_a_breach(tmp_path: Path) -> None:
    """A function-local import of a plug-in from the actor is reported."""
    root = _copy(tmp_path)
    actor = root / "sessionactors" / "_actor.py"
    actor.write_text(
        actor.read_text()
        + "\n\ndef _peek() -> None:\n    from .stores._sqlite import SQLiteStore\n"
    )
    found = _checker().breaches(root)
    assert any("_actor" in line and "stores._sqlite" in line for line in found), found


def test_an_upward_import_under_type_checking_is_a_breach(tmp_path: Path) -> None:
    """An import of the registry from the journal writer, even for types only, is reported."""
    root = _copy(tmp_path)
    journal = root / "sessionactors" / "_journal.py"
    journal.write_text(
        journal.read_text().replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n\n"
            "if TYPE_CHECKING:\n    from ._registry import Registry\n",
            1,
        )
    )
    found = _checker().breaches(root)
    assert any("_journal" in line and "_registry" in line for line in found), found


def test_an_import_cycle_within_a_layer_is_a_breach(tmp_path: Path) -> None:
    """Two modules of one layer that import each other are reported as a cycle."""
    root = _copy(tmp_path)
    hub = root / "sessionactors" / "_hub.py"
    hub.write_text(hub.read_text() + "\n\ndef _late() -> None:\n    from . import _subscription\n")
    found = _checker().breaches(root)
    assert any(line.startswith("import cycle") and "_hub" in line for line in found), found


def test_a_module_without_a_layer_is_a_breach(tmp_path: Path) -> None:
    """A new module must be given a layer before the check passes."""
    root = _copy(tmp_path)
    (root / "sessionactors" / "_stray.py").write_text("X = 1\n")
    assert any(line.startswith("_stray: no layer") for line in _checker().breaches(root))

"""The project's modules import each other without cycles (tools/structure.py)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_between_the_projects_modules(structure):
    graph = structure.import_graph()
    assert "tapesac.recorder" in graph and "tapesac.handoff" in graph["tapesac.recorder"]
    assert structure.cycles(graph) == []


def test_a_cycle_through_a_deferred_import_is_found(structure, tmp_path):
    pkg = tmp_path / "tapesac"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from tapesac.a import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert structure.cycles(structure.import_graph(tmp_path)) == [["tapesac.a", "tapesac.b"]]

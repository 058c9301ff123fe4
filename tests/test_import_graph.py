"""scripts/import_graph.py on small package trees: a submodule imported through a package
whose __init__ leads back to the importer fails; the same submodule imported by its full
name, or through a package that does not lead back, passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"


@pytest.fixture(scope="module")
def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Writes {path under root: source} and returns root."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def check(import_graph, root: Path, capsys) -> tuple[int, str]:
    code = import_graph.main(root)
    return code, capsys.readouterr().out


def models_tree(layers_import: str, init_imports_layers: bool = True) -> dict[str, str]:
    """runtime/models: __init__ imports llama, llama imports layers, layers imports plan."""
    init = "from spruce.runtime.models.llama import Llama\n" if init_imports_layers else ""
    return {
        "runtime/__init__.py": "",
        "runtime/models/__init__.py": init,
        "runtime/models/llama.py": "from spruce.runtime.models.layers import Layer as Llama\n",
        "runtime/models/layers.py": f"{layers_import}\n\nLayer = object\n",
        "runtime/models/plan.py": "def build():\n    return None\n",
    }


def test_a_submodule_through_a_package_that_imports_the_importer_fails(
    import_graph, tmp_path, capsys
):
    root = write_tree(tmp_path, models_tree("from spruce.runtime.models import plan"))
    code, out = check(import_graph, root, capsys)
    assert code == 1
    assert "runtime/models/layers.py imports spruce.runtime.models.plan through the package" in out
    chain = "spruce.runtime.models -> spruce.runtime.models.llama -> spruce.runtime.models.layers"
    assert chain in out


@pytest.mark.parametrize(
    "layers_import",
    ["from spruce.runtime.models.plan import build", "import spruce.runtime.models.plan"],
)
def test_the_same_submodule_by_its_full_name_passes(import_graph, tmp_path, capsys, layers_import):
    root = write_tree(tmp_path, models_tree(layers_import))
    code, out = check(import_graph, root, capsys)
    assert code == 0, out
    assert "no submodule through its importer's package" in out


def test_a_package_that_does_not_lead_back_passes(import_graph, tmp_path, capsys):
    root = write_tree(tmp_path, models_tree("from spruce.runtime.models import plan", False))
    code, out = check(import_graph, root, capsys)
    assert code == 0, out


def test_a_package_above_the_target_counts_as_imported(import_graph, tmp_path, capsys):
    # llama imports kernels.ops, which runs kernels/__init__, which imports layers
    files = models_tree("from spruce.runtime.models import plan", False)
    files["runtime/models/__init__.py"] = "from spruce.runtime.models.llama import Llama\n"
    files["runtime/models/llama.py"] = "from spruce.runtime.kernels.ops import op\n\nLlama = op\n"
    files["runtime/kernels/__init__.py"] = "from spruce.runtime.models.layers import Layer\n"
    files["runtime/kernels/ops.py"] = "op = None\n"
    code, out = check(import_graph, write_tree(tmp_path, files), capsys)
    assert code == 1
    chain = "spruce.runtime.models.llama -> spruce.runtime.kernels -> spruce.runtime.models.layers"
    assert chain in out


def test_a_package_taking_its_own_submodule_passes(import_graph, tmp_path, capsys):
    files = models_tree("from spruce.runtime.models.plan import build")
    files["runtime/models/__init__.py"] += (
        "from spruce.runtime.models import plan\nfrom . import rope\n"
    )
    files["runtime/models/rope.py"] = ""
    code, out = check(import_graph, write_tree(tmp_path, files), capsys)
    assert code == 0, out

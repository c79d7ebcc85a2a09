"""Rules the suite keeps about itself: every module has its markers in conftest.py, tests start
subprocesses with the interpreter they run under; and the package's layers: each imports only the ones
below it, the core (the op, layouts, kernels, collectives, rules) nothing but torch, and no product code
knows about the tests (their faults are injected from tests/faults.py); the tests import the scripts' commands
from the package, and each script is a thin entry."""

import ast
import json
import os
import subprocess
import sys

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

def _test_modules():
    return sorted(name[:-3] for name in os.listdir(TESTS) if name.startswith("test_") and name.endswith(".py"))


def test_every_test_module_has_its_markers_in_conftest():
    missing = [name for name in _test_modules() if name not in conftest.MODULE_MARKERS]
    assert not missing, f"add these modules to tests/conftest.py MODULE_MARKERS: {missing}"
    assert set(conftest.MODULE_MARKERS) <= set(_test_modules()), "conftest.py lists modules that do not exist"


_LAUNCHERS = ("run", "Popen", "check_call", "check_output", "call", "execv", "execvp", "spawnv")


def _bare_interpreters(source: str) -> list[str]:
    """Interpreters named by PATH lookup ('python', 'python3') as the program of a subprocess call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = getattr(getattr(node, "func", None), "attr", getattr(getattr(node, "func", None), "id", None))
        if not (isinstance(node, ast.Call) and name in _LAUNCHERS and node.args):
            continue
        program = node.args[0]
        if isinstance(program, (ast.List, ast.Tuple)) and program.elts:
            program = program.elts[0]
        if isinstance(program, ast.Constant) and isinstance(program.value, str) \
                and program.value.split()[0].split("/")[-1].startswith("python"):
            found.append(program.value)
    return found


def test_subprocesses_use_the_suites_interpreter():
    """`sys.executable`, never a bare `python`: on a fresh machine the PATH Python has no torch."""
    offenders = {}
    for name in _test_modules() + ["pretrain_runs", "slurm_standin_trainer", "spawn", "conftest"]:
        with open(os.path.join(TESTS, name + ".py"), encoding="utf-8") as handle:
            found = _bare_interpreters(handle.read())
        if found:
            offenders[name] = found
    assert not offenders, offenders
    assert _bare_interpreters("subprocess.run(['python', 'x.py'])") == ["python"], "the check must catch one"
    assert _bare_interpreters("subprocess.Popen(('python3', '-c', 'pass'))") == ["python3"]
    assert _bare_interpreters("subprocess.run([sys.executable, 'x.py'])") == []


def _modules_added_by(imports: list[str], after: str | None = "torch") -> list[str]:
    """Top-level modules that importing `imports` loads beyond what `import torch` (`after`) alone loads."""
    code = (f"import sys, json; {f'import {after}; ' if after else ''}before = set(sys.modules); "
            + "; ".join(f"import {name}" for name in imports)
            + "; print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


LAYERS = ("core", "mcore", "bdlm", "training", "tools")  # each imports only itself and the ones before it
PACKAGE = os.path.join(REPO, "megatron_csbp")


def _imported_layers(source: str) -> set[str]:
    """The layers of `megatron_csbp` a module's source imports, anywhere in it (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_csbp" and len(parts) > 1:
                found.add(parts[1])
            elif parts == ["megatron_csbp"] and isinstance(node, ast.ImportFrom):
                found.update(alias.name for alias in node.names)
    return found


def test_each_layer_imports_only_the_layers_below_it():
    offenders = {}
    for index, layer in enumerate(LAYERS):
        for folder, _, files in os.walk(os.path.join(PACKAGE, layer)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as handle:
                        above = {imported for imported in _imported_layers(handle.read())
                                 if imported not in LAYERS[:index + 1]}
                    if above:
                        offenders[os.path.relpath(path, REPO)] = sorted(above)
    assert not offenders, offenders
    assert sorted(name for name in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, name))
                  and not name.startswith("__")) == sorted(LAYERS), "a package folder outside the layers"
    # Negative control: an upward import, plain or inside a function, is seen.
    assert _imported_layers("def f():\n    from megatron_csbp.training import arguments\n") == {"training"}
    assert _imported_layers("from megatron_csbp import tools\nimport megatron_csbp.mcore.spec\n") == {"tools", "mcore"}


def test_the_core_imports_nothing_but_torch():
    import pkgutil

    core = ["megatron_csbp.core." + module.name for module in pkgutil.iter_modules([os.path.join(PACKAGE, "core")])]
    assert {"megatron_csbp.core.ops", "megatron_csbp.core.layout"} <= set(core)
    added = set(_modules_added_by(core)) - set(sys.stdlib_module_names)
    assert added == {"megatron_csbp"}, added
    # Negative control: the Megatron glue does pull megatron in, and the check sees it.
    assert "megatron" in _modules_added_by(["megatron_csbp.mcore.model"])


def test_every_module_has_one_import_path():
    """The layouts and the op are imported from their layer only (no top-level re-exports to drift)."""
    def imports(statement):
        return subprocess.run([sys.executable, "-c", statement], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, PYTHONPATH=REPO)).returncode == 0

    assert imports("from megatron_csbp.core.layout import CSBPLayout, CPLayout, layout_for; "
                   "from megatron_csbp.core.ops import context_sharded_block_attention")
    assert not imports("import megatron_csbp.layout") and not imports("import megatron_csbp.ops")


def _imported_modules(path: str) -> set[str]:
    """The `megatron_csbp` modules a source file imports, anywhere in it."""
    with open(os.path.join(PACKAGE, path), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_csbp"):
            found.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("megatron_csbp"))
    return found


def test_the_data_modules_do_not_import_the_arguments():
    """Arguments import the tokenizers and datasets (data-path parsing, the tokenizer file), never the reverse."""
    for path in ("training/tokenizers.py", "training/datasets.py"):
        assert "megatron_csbp.training.arguments" not in _imported_modules(path), path
    assert "megatron_csbp.training.datasets" in _imported_modules("training/arguments.py")  # the check sees imports


def _imports_megatron(path: str) -> bool:
    """Whether a source file imports megatron (core or Megatron-LM) anywhere, function-level imports too."""
    with open(os.path.join(PACKAGE, path), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    names = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)] + \
        [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    return any(name.split(".")[0] == "megatron" for name in names)


def test_the_objective_imports_no_megatron():
    """`bdlm.objective` is torch only (noise, rows, loss); megatron-core's forward step on it is `bdlm.forward_step`."""
    assert not _imports_megatron("bdlm/objective.py")
    assert _imports_megatron("bdlm/forward_step.py")  # negative control: the check sees lazy imports


def _test_hooks(source: str) -> list[str]:
    """Test-only environment variables a source names (`MEGATRON_CSBP_TEST_*`)."""
    import re

    return re.findall(r"MEGATRON_CSBP_TEST_\w*", source)


def test_product_code_holds_no_test_hooks():
    """Faults are injected by tests/faults.py wrapping the package's functions; the package and the scripts
    read no test switch."""
    offenders = {}
    for root in (PACKAGE, os.path.join(REPO, "scripts")):
        for folder, _, files in os.walk(root):
            for name in files:
                if name.endswith((".py", ".sh")):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as handle:
                        found = _test_hooks(handle.read())
                    if found:
                        offenders[os.path.relpath(path, REPO)] = found
    assert not offenders, offenders
    # Negative control: the check sees the variables where they live.
    with open(os.path.join(TESTS, "faults.py"), encoding="utf-8") as handle:
        assert "MEGATRON_CSBP_TEST_FAIL" in _test_hooks(handle.read())


_BY_PATH = ("spec_from_file_location", "SourceFileLoader", "run_path", "import runpy")


def _scripts_loaded_by_path(source: str) -> list[str]:
    """The ways of loading a file as a module that a source uses (a script's logic belongs in the package)."""
    return [way for way in _BY_PATH if way in source]


def test_tests_import_the_package_not_scripts_by_path_and_scripts_are_thin_entries():
    """A script's logic is a package module the tests import; a test runs `scripts/` only as the user does, in a
    subprocess. Each script is an entry: it imports its command from the package, and defines nothing."""
    offenders = {}
    for name in os.listdir(TESTS):
        if name.endswith(".py") and name != "test_suite_rules.py":
            with open(os.path.join(TESTS, name), encoding="utf-8") as handle:
                found = _scripts_loaded_by_path(handle.read())
            if found:
                offenders[name] = found
    assert not offenders, offenders
    definers = {}
    for folder, _, files in os.walk(os.path.join(REPO, "scripts")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read())
                defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
                if defined:
                    definers[os.path.relpath(path, REPO)] = defined
    assert not definers, definers
    # Negative controls: a by-path load is seen.
    assert _scripts_loaded_by_path("spec = importlib.util.spec_from_file_location('x', 'scripts/x.py')") == \
        ["spec_from_file_location"]
    assert _scripts_loaded_by_path("import runpy\nrunpy.run_path('scripts/x.py')") == ["run_path", "import runpy"]

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


LAYERS = ("core", "runtime", "data", "mcore", "bdlm", "training", "tools")  # each imports only itself and the ones before it
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


# What the tools may use of `training`: a run's arguments, its providers and loops, its checkpoints, its progress
# line. The rest of what entry points share lives in `runtime` and `data`, and Hugging Face's forms in `tools`.
TRAINING_FACE = {"arguments", "checkpointing", "config", "flags", "loops", "megatron_config", "pretrain", "progress",
                 "providers"}


def _training_modules_imported(source: str) -> set[str]:
    """The modules of `megatron_csbp.training` a source imports (`from megatron_csbp.training import x` or
    `from megatron_csbp.training.x import ...`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "megatron_csbp.training":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_csbp.training."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[2] for alias in node.names
                         if alias.name.startswith("megatron_csbp.training."))
    return found


def test_the_tools_use_only_the_training_face():
    """The tools (and the scripts) reach `training` through `TRAINING_FACE` only, not its other modules."""
    used = {}
    for folder in (os.path.join(PACKAGE, "tools"), os.path.join(REPO, "scripts")):
        for root, _, files in os.walk(folder):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(root, name), encoding="utf-8") as handle:
                        for module in _training_modules_imported(handle.read()):
                            used.setdefault(module, []).append(os.path.relpath(os.path.join(root, name), REPO))
    assert {module: files for module, files in used.items() if module not in TRAINING_FACE} == {}
    assert {"checkpointing", "providers"} <= set(used) <= TRAINING_FACE
    assert _training_modules_imported("from megatron_csbp.training import loop\nimport megatron_csbp.training.flag_table"
                                      "\nfrom megatron_csbp.training.layer_pattern import x") == \
        {"loop", "flag_table", "layer_pattern"}  # the reader sees all three spellings


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
    for path in ("data/tokenizers.py", "data/datasets.py"):
        assert "megatron_csbp.training.arguments" not in _imported_modules(path), path
    assert "megatron_csbp.data.datasets" in _imported_modules("training/arguments.py")  # the check sees imports


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


def _module_of(path: str) -> str:
    """`megatron_csbp/core/ops.py` -> `megatron_csbp.core.ops` (a package's `__init__.py`: the package)."""
    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _import_graph() -> dict[str, set[str]]:
    """Each package module -> the package modules it imports anywhere (function-level imports too); `from
    package import name` counts as importing `package.name` where that is a module, else `package`."""
    sources = {_module_of(os.path.join(folder, name)): os.path.join(folder, name)
               for folder, _, files in os.walk(PACKAGE) for name in files if name.endswith(".py")}
    graph = {}
    for module, path in sources.items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up `level - 1` levels
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base
                               for alias in node.names)
        graph[module] = {target for target in targets if target in sources and target != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    """No import cycle anywhere in the package, within a layer too (function-level imports count: a lazy import
    hides a cycle from Python, not from a reader)."""
    assert _cycles(_import_graph()) == []
    # Negative control: a loop of three is found, a chain is not.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _variant_registries() -> list[tuple[str, object]]:
    """(module path, names) of every registry of variants: a kind of thing the run or a tool can be, chosen by
    name at an edge (a flag, a checkpoint's record) and held as an object everywhere else."""
    from megatron_csbp.core import clean_attention, kernel_work, modes, objectives, schedule, transports
    from megatron_csbp.tools import harness, sampling
    from megatron_csbp.tools import hf, hf_formats

    return [("core/modes.py", modes.PARALLEL_MODES), ("core/objectives.py", objectives.OBJECTIVES),
            ("core/objectives.py", objectives.LOSS_WEIGHTINGS), ("core/transports/__init__.py", transports.TRANSPORTS),
            ("core/schedule.py", schedule.SCHEDULES), ("core/schedule.py", schedule.CLEAN_LAYOUTS),
            ("core/clean_attention.py", clean_attention.CLEAN_ATTENTIONS), ("core/kernel_work.py", kernel_work.KINDS),
            ("tools/hf.py", hf.FAMILIES), ("tools/hf_formats.py", hf_formats.FORMATS),
            ("tools/sampling.py", sampling.STRATEGY), ("tools/harness.py", harness.ESTIMATORS)]


# Constants that spell a variant's name and mean something else: (module, the name they are assigned to) -> why.
NOT_VARIANTS = {("tools/convert_hf.py", "HF_SIDE"): "the checkpoint's hf/ folder (its tokenizer and HF config), not "
                                                     "the export format"}


def _variant_literals(source: str, names: dict, module: str = "") -> list[tuple[int, str]]:
    """(line, name) of each string constant of `source` that is a variant's name (docstrings, and the constants of
    `NOT_VARIANTS` of `module`, aside)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    other = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(target, ast.Name) and (module, target.id) in NOT_VARIANTS for target in node.targets)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in docstrings | other]


def test_no_variant_is_named_outside_its_own_module():
    """A variant's name is written once, where its object is made: code elsewhere holds the object or asks it,
    and names are looked up only through the registry (`core.variants`). So no string literal equal to a
    registry's name appears in the package or the scripts outside the module that defines that registry."""
    homes = {}
    for home, registry in _variant_registries():
        for name in registry:
            homes.setdefault(name, set()).add(os.path.join(PACKAGE, home))
    offenders = []
    sources = [os.path.join(folder, name) for root in (PACKAGE, os.path.join(REPO, "scripts"))
               for folder, _, files in os.walk(root) for name in files if name.endswith(".py")]
    for path in sources:
        with open(path, encoding="utf-8") as handle:
            for line, name in _variant_literals(handle.read(), homes, os.path.relpath(path, PACKAGE)):
                if path not in homes[name]:
                    offenders.append(f"{os.path.relpath(path, REPO)}:{line}: {name!r}")
    assert offenders == []
    # Negative control: a name tested as a string is seen, in a docstring it is not.
    assert _variant_literals('"""csbp is fine here."""\nif mode == "csbp":\n    pass\n', homes) == [(2, "csbp")]

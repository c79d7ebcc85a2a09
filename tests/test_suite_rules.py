"""Rules the suite keeps about itself: every module has its markers in conftest.py, tests start
subprocesses with the interpreter they run under, and the op and layout import nothing but torch."""

import ast
import json
import os
import subprocess
import sys

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
CORE = ("megatron_csbp.layout", "megatron_csbp.ops", "megatron_csbp.kernels", "megatron_csbp.comm",
        "megatron_csbp.process_groups", "megatron_csbp.device")


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


def test_the_op_and_layout_import_only_torch():
    added = set(_modules_added_by(list(CORE))) - set(sys.stdlib_module_names)
    assert added == {"megatron_csbp"}, added
    # Negative control: the Megatron glue does pull megatron in, and the check sees it.
    assert "megatron" in _modules_added_by(["megatron_csbp.model"])

"""lm-eval's own inputs to `python -m megatron_csbp.harness`, checked before the model loads, and its results
written whole.

* The tasks: lm-eval loads a task (its YAML, its dataset) only after it has built the model, and passes the
  errors of `datasets` through (an unknown task, a data file that is missing or not JSON). `load_tasks`
  loads them first and names the task, its YAML and its data files in one line.
* `--output_path`, as lm-eval 0.4 reads it: a path ending `.json` names files beside it (`NAME_<date>.json`,
  and with `--log_samples` `samples_<task>_<date>.jsonl`, in its directory); any other path is a directory
  (results under `PATH/<model>/`). An existing file there, or a directory that cannot be written or lacks
  room for a results file, is refused before any request runs (lm-eval would log a warning at the end and
  exit 0 having saved nothing). lm-eval writes its files in place and swallows a failed write, so
  `StagedOutput` gives it a private directory beside the target and publishes its files by link once the
  run is done: a reader never sees half a file, and a save that failed is one line, not a warning.
"""

import json
import os
from pathlib import Path

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.runtime import publish

RESULTS_BYTES = 2 ** 20  # room a results file needs (lm-eval's are tens of kB; samples files are written after it)


def reasons(error: BaseException, limit: int = 400) -> str:
    """`error` and what it came from, on one line: `Type: message; Cause: message ...` (first lines only)."""
    parts, seen = [], 0
    while error is not None and seen < 6:
        first = (str(error).strip().splitlines() or [""])[0].strip()
        part = f"{type(error).__name__}: {first}" if first else type(error).__name__
        if part not in parts:
            parts.append(part)
        error, seen = error.__cause__ or error.__context__, seen + 1
    text = "; ".join(parts)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------------------------------ the tasks
def _name(spec) -> str:
    return spec if isinstance(spec, str) else str(spec.get("task") or spec.get("group") or spec)


def _data_files(config: dict) -> list[str]:
    files = ((config or {}).get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        files = list(files.values())
    found = []
    for item in files if isinstance(files, list) else [files]:
        found += [str(name) for name in (item if isinstance(item, list) else [item]) if name]
    return found


def _members(manager, spec) -> list:
    """The registered tasks a group (its `task:` list) or a tag stands for; [] for a task."""
    entry = manager.task_index.get(_name(spec))
    config = spec if isinstance(spec, dict) else (entry.cfg if entry is not None else None) or {}
    listed = config.get("task")
    if isinstance(listed, list):
        return [member for member in listed if isinstance(member, str) and member in manager.task_index]
    if entry is not None and entry.kind.name == "TAG":
        return [name for name, other in manager.task_index.items() if entry.name in other.tags]
    return []


def _failing(manager, specs: list):
    """(spec, error) of the first of `specs` lm-eval cannot load alone, narrowed to the member of a group or tag
    that fails alone; None when each loads alone."""
    for spec in specs:
        try:
            manager.load([spec])
        except Exception as error:  # noqa: BLE001 - whatever lm-eval or `datasets` raise for this one
            return _failing(manager, _members(manager, spec)) or (spec, error)
    return None


def task_problem(manager, specs: list, error: BaseException) -> str:
    """One line naming the task that cannot be loaded (its YAML, its data files) and why."""
    found = _failing(manager, specs)
    if found is None:  # each loads alone: the list as a whole (e.g. one task in two groups)
        return f"--tasks {','.join(map(_name, specs))}: lm-eval cannot load them together: {reasons(error)}"
    spec, error = found
    entry = manager.task_index.get(_name(spec))
    config = (entry.cfg if entry is not None else None) or (spec if isinstance(spec, dict) else {})
    where = [f"task file {entry.yaml_path}"] if entry is not None and entry.yaml_path else []
    files = _data_files(config)
    if files:
        where.append(f"data {', '.join(files)}")
    elif config.get("dataset_path"):
        where.append(f"dataset {config['dataset_path']}")
    named = f" ({'; '.join(where)})" if where else ""
    return (f"--tasks {_name(spec)}{named}: lm-eval cannot load it: {reasons(error)}; fix the task or its data, or "
            f"leave it out")


def load_tasks(manager, specs: list) -> list:
    """The tasks `specs` names (as lm-eval's `process_tasks` resolved them), loaded now, their data read: the
    top-level `Task` and `Group` objects, which lm-eval's `TaskManager.load` takes as they are once the model
    is built. A task lm-eval cannot load is `task_problem`'s one line."""
    from lm_eval.api.group import Group

    try:
        loaded = manager.load(list(specs))
    except Exception as error:  # noqa: BLE001 - lm-eval's and `datasets`' own errors: a task or its data
        raise ConfigError(task_problem(manager, list(specs), error)) from None
    children = {name for group in loaded["groups"].values() for name in group.child_names}
    items = [*loaded["groups"].values(), *loaded["tasks"].values()]
    return [item for item in items if (item.name if isinstance(item, Group) else item.task_name) not in children]


# ------------------------------------------------------------------------------------------- the output
def output_directory(path: str) -> str:
    """The directory lm-eval writes in for `--output_path PATH` (the module doc)."""
    path = os.path.abspath(path)
    return os.path.dirname(path) if Path(path).suffix == ".json" else path


def check_output_path(path: str) -> str:
    """`--output_path` refused unless lm-eval can write its results there (the module doc); its directory."""
    directory = output_directory(path)
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == os.path.abspath(path):
            raise ConfigError(f"--output_path {path} is a file; give a directory (lm-eval writes its results under "
                              f"it) or a name ending .json (written beside it as NAME_<date>.json)")
        raise ConfigError(f"--output_path {path}: {existing} is a file, not a directory; give a path in a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output_path {path}: {existing} cannot be written (permissions or a read-only file "
                          f"system); give another path")
    publish.require_free_space(directory, RESULTS_BYTES, "--output_path")
    return directory


def _lines(path: str) -> int | None:
    """The lines of a text file, or None when its last one is cut short."""
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(2 ** 20), b""):
            count, last = count + chunk.count(b"\n"), chunk[-1:]
    return count if last == b"\n" else None


class StagedOutput:
    """lm-eval's output written into a private directory in the target directory, checked complete (the
    results file, and with `samples` one samples file per task) and published file by file (samples first,
    the results file last) by link when the run is done; discarded whole otherwise."""

    def __init__(self, path: str, samples: bool):
        self.path, self.directory, self.samples = path, check_output_path(path), samples
        self.created, self.published = not os.path.exists(self.directory), False
        self.private = publish.make_private(os.path.join(self.directory, "lm-eval"), "--output_path")
        # lm-eval keeps the form of the path: a `.json` name stays a file name, anything else a directory
        self.staged = os.path.join(self.private, os.path.basename(os.path.abspath(path))) \
            if Path(path).suffix == ".json" else self.private

    def _written(self) -> list[str]:
        files = [os.path.relpath(os.path.join(folder, name), self.private)
                 for folder, _, names in os.walk(self.private) for name in names]
        return sorted(files, key=lambda name: (name.endswith(".json"), name))

    def _incomplete(self, written: list[str]) -> str | None:
        """What lm-eval failed to write (it logs a warning and goes on): no results file, one that does not
        parse, or a samples file short of the task's samples (`n-samples` in the results); else None."""
        results = [name for name in written if name.endswith(".json")]
        if len(results) != 1:
            return "no results file"
        try:
            with open(os.path.join(self.private, results[0]), encoding="utf-8") as handle:
                counts = {task: info["effective"] for task, info in json.load(handle)["n-samples"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return f"its results file {os.path.basename(results[0])} is incomplete"
        samples = {os.path.basename(name)[len("samples_"):].rsplit("_", 1)[0]: name  # samples_<task>_<date>.jsonl
                   for name in written if name.endswith(".jsonl")}
        for task, count in counts.items() if self.samples else ():
            if task not in samples or _lines(os.path.join(self.private, samples[task])) != count:
                return f"the samples of {task} are missing or incomplete"
        return None

    def publish(self) -> list[str]:
        """Links every file lm-eval wrote onto its place in the target directory; the paths published."""
        written = self._written()
        incomplete = self._incomplete(written)
        if incomplete:
            raise ConfigError(f"--output_path {self.path}: lm-eval could not write its output ({incomplete}; its "
                              f"warning above says why); nothing was saved there")
        published = []
        for name in written:
            target = os.path.join(self.directory, name)
            try:
                with open(os.path.join(self.private, name), "rb") as handle:
                    os.fsync(handle.fileno())  # lm-eval writes without syncing
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.link(os.path.join(self.private, name), target)
            except OSError as error:
                raise ConfigError(f"--output_path {self.path}: cannot publish {target} ({error.strerror}); "
                                  f"{len(published)} of the {len(written)} files were published") from None
            published.append(target)
        for folder in sorted({os.path.dirname(target) for target in published}):
            publish.fsync_path(folder)
        publish.discard(self.private)
        self.published = True
        return published

    def discard(self) -> None:
        """Removes what lm-eval wrote (a run that failed or was refused), and the directory if made for it."""
        if self.published:
            return
        publish.discard(self.private)
        if self.created:
            try:
                os.rmdir(self.directory)  # made for this run, left empty
            except OSError:
                pass

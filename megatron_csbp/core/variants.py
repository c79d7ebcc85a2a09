"""What every kind of variant shares: a registry of named objects, and the one place a name becomes an object.

A parallel mode, an objective, a transport, a block schedule, a clean layout, a clean-attention rule: each
is a small frozen object stating its own facts, made once in its own module, where its name is written.
Code holds and passes the object. A name is read only at an edge — a flag's value, a checkpoint's record, a
tool's option — through the kind's `Registry`, which refuses an unknown name in one line naming the flag and
the choices. So `registry(name_or_object)` is the only lookup, and a new variant is one object in one module
plus one entry in its registry (tests/test_suite_rules.py holds the code to that: no registry's name is
written as a string literal outside the module that defines it).

Standard library only (the planner runs without torch).
"""

import importlib
from collections.abc import Mapping

_REGISTERED = []  # every registered variant: what a pickled reference to one is resolved against


class Registry(Mapping):
    """The variants of one kind by name, in the flag's order (iterating gives the names: a flag's `choices`)."""

    def __init__(self, flag: str, *variants):
        self.flag = flag
        self._by_name = {variant.name: variant for variant in variants}
        _REGISTERED.extend(variants)

    def __getitem__(self, name: str):
        return self._by_name[name]

    def __iter__(self):
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __call__(self, choice):
        """The variant `choice` names (a flag's value), or `choice` itself when it is one of them already;
        `ValueError` naming the flag and the choices otherwise."""
        problem = self.problem(choice)
        if problem:
            raise ValueError(problem)
        return self._by_name[choice] if isinstance(choice, str) else choice

    def problem(self, choice, flag: str | None = None) -> str | None:
        """Why `choice` is neither one of these variants nor one's name (one line naming `flag`, default the
        registry's), or None."""
        if choice in self._by_name if isinstance(choice, str) else any(
                choice is variant for variant in self._by_name.values()):
            return None
        return f"{flag or self.flag} {choice!r}: choose one of {', '.join(self._by_name)}"

    @property
    def names(self) -> tuple:
        return tuple(self._by_name)


def _registered(module: str, kind: str, name: str):
    """The registered variant of class `kind` (in `module`) called `name`: unpickling a variant gives this same
    object, in a spawned rank too, so `registry(variant)` and `is` hold across processes."""
    importlib.import_module(module)
    return next(variant for variant in _REGISTERED if type(variant).__module__ == module
                and type(variant).__qualname__ == kind and variant.name == name)


def named(cls):
    """Class decorator for a variant: its repr is its kind and name (layouts, plans and errors print it), and it
    pickles (and copies) as a reference to the registered object, never as a second one."""
    cls.__repr__ = lambda self: f"{type(self).__name__.lstrip('_')}({self.name})"
    cls.__str__ = lambda self: self.name
    cls.__reduce__ = lambda self: (_registered, (type(self).__module__, type(self).__qualname__, self.name))
    return cls

"""The one way this package changes code it does not own (megatron-core, Megatron-LM, torch).

Every change rests on what the upstream code looks like today. A :class:`Spot` names one
upstream object (module and qualified name) and the source fragments a patch relies on;
:func:`check_spots` checks a whole registry before anything is patched, so an upstream change
stops with :class:`UpstreamChanged` -- naming the spot, what is different, the installed
megatron-core and the file of this package to review -- instead of running a stale patch.

Where the supported upstream versions differ, a registry entry is a :class:`OneOf`: the
alternatives are tried in order and the first that resolves and passes its check is the one
used, so a version is recognised by what its code contains, never by its version number.

:class:`Patches` makes the changes and undoes them, last first. ``replace`` rebinds a name in
every loaded module that imported it too (``from x import f`` binds ``f`` in the importer, so
patching only the defining module would miss those calls), and ``undo`` also puts the original
back in modules imported while the patch was active.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

__all__ = [
    "OneOf",
    "Patches",
    "Spot",
    "UpstreamChanged",
    "check_signature",
    "check_spots",
    "in_megatron",
    "megatron_core_version",
    "release_name",
]

_MISSING = object()


class UpstreamChanged(RuntimeError):
    """Upstream code no longer looks like what a patch of this package relies on."""


def megatron_core_version() -> str:
    """The loaded megatron-core's release, ``MAJOR.MINOR.PATCH[PRE_RELEASE]``. Not its ``__version__``:
    megatron-core 0.19 appends the commit of whatever git repository holds the install, so a virtual
    environment inside a project would report the project's commit as megatron-core's."""
    try:
        from megatron.core import package_info

        return release_name(package_info.VERSION)
    except Exception:  # megatron-core absent, or without package_info
        return "unknown"


def release_name(version: tuple) -> str:
    """``(0, 19, 2, "rc1")`` -> ``"0.19.2rc1"``, as megatron-core's package_info spells a release."""
    major, minor, patch, *pre_release = version
    return f"{major}.{minor}.{patch}{''.join(map(str, pre_release))}"


@dataclasses.dataclass(frozen=True)
class Spot:
    """One upstream object a patch relies on, and how it is changed.

    ``expects``: source fragments that must still be in the object's source (and in the sources
    of ``also_reads``, ``(module, qualname)`` pairs whose code the patch depends on too);
    ``lacks``: fragments that must not be there (an alternative of a :class:`OneOf` saying "this
    version needs nothing here", e.g. no CUDA call to redirect).

    ``kind``, one vocabulary for every registry:

    * ``"check"`` -- nothing is replaced; only what the source does is relied on;
    * ``"scope"`` -- the object is called inside :func:`~.cpu_compat.cuda_as_cpu`;
    * ``"body"`` -- CUDA device requests made directly in its body land on the CPU, and the
      ``torch.cuda`` functions named in ``cuda`` answer for the CPU there (the launcher);
    * ``"replace"`` -- ``replacement(original)`` takes its place in every module that bound it.
    """

    module: str
    qualname: str
    expects: tuple[str, ...]
    why: str = ""
    kind: str = "check"
    replacement: Optional[Callable[[Any], Any]] = None
    cuda: tuple[str, ...] = ()
    also_reads: tuple[tuple[str, str], ...] = ()
    lacks: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.module.replace('.', '/')}.py:{self.qualname}"

    def changed(self, what: str, review: str) -> UpstreamChanged:
        error = UpstreamChanged(
            f"{self.label}: {what} (megatron-core {megatron_core_version()}); upstream changed: "
            f"review {review}")
        error.what = f"{self.label}: {what}"  # type: ignore[attr-defined]
        return error

    def resolve(self, review: str) -> tuple[Any, str, Any]:
        """(owner, attribute name, current object); :class:`UpstreamChanged` if it is gone."""
        try:
            owner, name = _resolve(self.module, self.qualname)
        except LookupError as error:
            raise self.changed(str(error), review) from None
        return owner, name, vars(owner)[name]

    def check(self, original: Any, review: str) -> None:
        """Raise :class:`UpstreamChanged` unless every expected fragment is in ``original``'s
        source (or in one of ``also_reads``) and no fragment it ``lacks`` is."""
        try:
            objects = [original] + [_lookup(*where) for where in self.also_reads]
            source = "\n".join(inspect.getsource(inspect.unwrap(obj)) for obj in objects)
        except LookupError as error:
            raise self.changed(str(error), review) from None
        except (OSError, TypeError) as error:
            raise self.changed(f"its source is not available ({error})", review) from None
        for fragment in self.expects:
            if fragment not in source:
                raise self.changed(f"expected {fragment!r} in its source, it is no longer there", review)
        for fragment in self.lacks:
            if fragment in source:
                raise self.changed(f"expected no {fragment!r} in its source, it has one", review)


@dataclasses.dataclass(frozen=True)
class OneOf:
    """Where supported upstream versions differ: the first of ``alternatives`` that resolves and
    passes its check is used (newest first where an older name survives in newer versions)."""

    alternatives: tuple[Spot, ...]

    def __init__(self, *alternatives: Spot):
        if not alternatives:
            raise ValueError("OneOf needs at least one alternative")
        object.__setattr__(self, "alternatives", tuple(alternatives))

    @property
    def label(self) -> str:
        return " | ".join(dict.fromkeys(spot.label for spot in self.alternatives))

    def choose(self, review: str, originals: Mapping[str, Any] = {}) -> tuple[Spot, Any, str, Any]:
        """``(spot, owner, name, original)`` of the first alternative that resolves and checks;
        :class:`UpstreamChanged` naming why each failed when none does."""
        failures = []
        for spot in self.alternatives:
            try:
                return _checked(spot, review, originals)
            except UpstreamChanged as error:
                failures.append(error.what)  # type: ignore[attr-defined]
        raise UpstreamChanged(f"no supported version of {self.label} found ({'; '.join(failures)}; "
                              f"megatron-core {megatron_core_version()}); upstream changed: review {review}")


def _resolve(module: str, qualname: str) -> tuple[Any, str]:
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as error:
        raise LookupError(f"module {module} cannot be imported ({error})") from None
    *path, name = qualname.split(".")
    for part in path:
        owner = vars(owner).get(part) if hasattr(owner, "__dict__") else None
        if owner is None:
            raise LookupError(f"{part!r} no longer exists in {module}")
    if name not in vars(owner):
        raise LookupError(f"{qualname!r} no longer exists in {module}")
    return owner, name


def _lookup(module: str, qualname: str) -> Any:
    owner, name = _resolve(module, qualname)
    return vars(owner)[name]


def check_spots(spots: "Iterable[Spot | OneOf]", review: str,
                originals: Mapping[str, Any] = {}) -> list[tuple[Spot, Any, str, Any]]:
    """Resolve and check every spot (before any is patched); ``(spot, owner, name, original)``
    each, the alternative chosen for a :class:`OneOf`. ``originals`` (label -> object) is what to
    check where the spot is patched already."""
    return [spot.choose(review, originals) if isinstance(spot, OneOf) else _checked(spot, review, originals)
            for spot in spots]


def _checked(spot: Spot, review: str, originals: Mapping[str, Any]) -> tuple[Spot, Any, str, Any]:
    owner, name, current = spot.resolve(review)
    original = originals.get(spot.label, current)
    spot.check(original, review)
    return spot, owner, name, original


def check_signature(fn: Callable, expected: Sequence[str], review: str) -> None:
    """Raise :class:`UpstreamChanged` unless ``fn`` takes exactly the parameters ``expected``."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as error:
        raise UpstreamChanged(f"cannot read the signature of {name}: {error}; review {review}") from None
    if params != tuple(expected):
        raise UpstreamChanged(f"{name} takes {params}, {review} was written for {tuple(expected)}; "
                              "check what it does now before updating the stand-in")


def in_megatron(module_name: str) -> bool:
    return module_name.startswith("megatron.")


class Patches:
    """Changes to upstream names, undone last first (also as a context manager).

    ``undo`` restores a name only while it still holds this object's value, so a later patch of
    the same name that was not undone is not clobbered.
    """

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any, Any]] = []  # (owner, name, previous, new)
        self._swept: list[tuple[Any, Any, Callable[[str], bool]]] = []  # (new, original, where)

    def __bool__(self) -> bool:
        return bool(self._done)

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    @property
    def bindings(self) -> list[tuple[Any, str, Any, Any]]:
        """Every ``(owner, name, previous, new)`` changed so far, oldest first."""
        return list(self._done)

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` (``owner`` a module or class; the name may be new)."""
        self._done.append((owner, name, vars(owner).get(name, _MISSING), value))
        setattr(owner, name, value)

    def rebind(self, replacements: Mapping[Any, Any] | Iterable[tuple[Any, Any]],
               where: Callable[[str], bool] = in_megatron) -> list[str]:
        """Replace every binding of each original (``{original: new}``) in the loaded modules
        whose name ``where`` accepts, in one pass; returns the ``module.name`` bindings changed."""
        pairs = list(replacements.items() if isinstance(replacements, Mapping) else replacements)
        by_id = {id(original): (original, new) for original, new in pairs}
        found = []
        for module_name, module in list(sys.modules.items()):
            if module is None or not where(module_name):
                continue
            for attr, value in list(vars(module).items()):
                entry = by_id.get(id(value))
                if entry is not None and entry[0] is value:
                    found.append((module, attr, entry[1]))
        for module, attr, new in found:
            self.set(module, attr, new)
        self._swept += [(new, original, where) for original, new in pairs]
        return [f"{module.__name__}.{attr}" for module, attr, _new in found]

    def replace(self, owner: Any, name: str, new: Any, where: Callable[[str], bool] = in_megatron) -> None:
        """``owner.name = new``, and where ``owner`` is a module, in every module that bound the
        same object too."""
        original = vars(owner)[name]
        if inspect.ismodule(owner):
            self.rebind({original: new}, where)
        if vars(owner).get(name) is not new:
            self.set(owner, name, new)

    def undo(self) -> None:
        while self._done:
            owner, name, previous, new = self._done.pop()
            if vars(owner).get(name, _MISSING) is not new:
                continue
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        swept = {id(new): (new, original, where) for new, original, where in self._swept}
        self._swept = []
        if not swept:
            return
        # modules imported while a rebind was active may have bound the new object by name
        wheres = {id(where): where for _new, _original, where in swept.values()}.values()
        for module_name, module in list(sys.modules.items()):
            if module is None or not any(where(module_name) for where in wheres):
                continue
            for attr, value in list(vars(module).items()):
                entry = swept.get(id(value))
                if entry is not None and entry[0] is value and entry[2](module_name):
                    setattr(module, attr, entry[1])

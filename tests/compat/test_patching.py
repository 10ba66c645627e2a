"""The one patching mechanism (compat/patching.py) on small modules written for the test: names
rebound wherever they were imported, undone last first, and upstream checks that name the spot
and the file to review."""

import sys
import textwrap

import pytest

from megatron_dynapipe.compat.patching import OneOf, Patches, Spot, UpstreamChanged, check_signature, check_spots

UPSTREAM = '''
def helper(x):
    return x + 1

class Box:
    def get(self):
        return "upstream"
'''

IMPORTER = '''
from megatron.fakeup import helper

def call(x):
    return helper(x)
'''


@pytest.fixture
def fake_megatron(tmp_path, monkeypatch):
    """``megatron.fakeup`` and ``megatron.fakeimporter``: real modules under the megatron name
    (so that the default ``in_megatron`` filter applies), removed afterwards."""
    import megatron

    root = tmp_path / "megatron"
    root.mkdir()
    (root / "fakeup.py").write_text(textwrap.dedent(UPSTREAM))
    (root / "fakeimporter.py").write_text(textwrap.dedent(IMPORTER))
    (root / "fakelate.py").write_text(textwrap.dedent(IMPORTER))
    monkeypatch.setattr(megatron, "__path__", [*megatron.__path__, str(root)])
    import megatron.fakeimporter as importer
    import megatron.fakeup as up

    yield up, importer
    for name in ("megatron.fakeup", "megatron.fakeimporter", "megatron.fakelate"):
        sys.modules.pop(name, None)


def test_replace_reaches_every_importer_and_undo_restores_all(fake_megatron):
    up, importer = fake_megatron
    original = up.helper
    patches = Patches()
    patches.replace(up, "helper", lambda x: x * 10)
    assert up.helper(2) == 20 and importer.call(2) == 20  # the importer's own binding followed
    import megatron.fakelate as late  # imported while patched: binds the replacement by name

    assert late.call(3) == 30
    patches.undo()
    assert up.helper is original and importer.helper is original and late.helper is original
    assert not patches


def test_set_on_a_class_and_a_new_name_is_undone_last_first(fake_megatron):
    up, _ = fake_megatron
    with Patches() as patches:
        patches.set(up.Box, "get", lambda self: "first")
        patches.set(up.Box, "get", lambda self: "second")
        patches.set(up, "brand_new", 1)
        assert up.Box().get() == "second" and up.brand_new == 1
    assert up.Box().get() == "upstream"
    assert not hasattr(up, "brand_new")


def test_undo_leaves_a_later_patch_of_the_same_name_alone(fake_megatron):
    up, _ = fake_megatron
    first, second = Patches(), Patches()
    first.set(up, "helper", "mine")
    second.set(up, "helper", "theirs")
    first.undo()  # out of order: the name now holds the other patch's value
    assert up.helper == "theirs"
    second.undo()
    assert up.helper == "mine"  # what was there when the second patch came


def test_check_spots_names_the_spot_what_changed_and_the_file_to_review(fake_megatron):
    ok = Spot("megatron.fakeup", "Box.get", ('return "upstream"',))
    (resolved,) = check_spots([ok], review="x.py")
    assert resolved[2] == "get" and resolved[3] is vars(fake_megatron[0].Box)["get"]
    stale = Spot("megatron.fakeup", "helper", ("return x + 2",))
    with pytest.raises(UpstreamChanged, match=r"megatron/fakeup\.py:helper: expected 'return x \+ 2'.*review here\.py"):
        check_spots([ok, stale], review="here.py")
    gone = Spot("megatron.fakeup", "Box.put", ())
    with pytest.raises(UpstreamChanged, match=r"fakeup\.py:Box\.put: 'Box\.put' no longer exists"):
        check_spots([gone], review="here.py")
    missing = Spot("megatron.no_such_module", "f", ())
    with pytest.raises(UpstreamChanged, match="cannot be imported"):
        check_spots([missing], review="here.py")


def test_one_of_uses_the_first_alternative_whose_code_matches(fake_megatron):
    """Versions are told apart by what their code contains: a name that is gone, or a fragment the
    source has (``expects``) or must not have (``lacks``)."""
    newer = Spot("megatron.fakeup", "Box.fetch", ("return",), "a newer upstream's name")
    same_name_newer = Spot("megatron.fakeup", "helper", ("return x + 2",), "a newer upstream's body")
    nothing_to_do = Spot("megatron.fakeup", "helper", (), "this upstream needs nothing", lacks=("import torch",))
    current = Spot("megatron.fakeup", "Box.get", ('return "upstream"',))
    [(chosen, owner, name, original)] = check_spots([OneOf(newer, same_name_newer, current)], review="r.py")
    assert chosen is current and name == "get" and original is vars(fake_megatron[0].Box)["get"]
    assert check_spots([OneOf(same_name_newer, nothing_to_do)], review="r.py")[0][0] is nothing_to_do
    still_there = Spot("megatron.fakeup", "helper", (), lacks=("return x + 1",))
    with pytest.raises(UpstreamChanged) as info:  # none matches: each alternative's reason, and what to review
        check_spots([OneOf(newer, still_there)], review="r.py")
    message = str(info.value)
    assert message.startswith("no supported version of megatron/fakeup.py:Box.fetch | megatron/fakeup.py:helper")
    assert "'Box.fetch' no longer exists" in message and "expected no 'return x + 1'" in message
    assert message.endswith("review r.py") and len(message.splitlines()) == 1


def test_check_signature():
    def create(ranks=None, timeout=None):
        pass

    check_signature(create, ("ranks", "timeout"), "g.py")
    with pytest.raises(UpstreamChanged, match=r"takes \('ranks', 'timeout'\), g\.py was written for \('ranks',\)"):
        check_signature(create, ("ranks",), "g.py")

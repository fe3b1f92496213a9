"""The agent's change (corral.rollout.change): which paths differ from the set-up sandbox, which
the rules leave out, and how a change is read from one sandbox and applied to another (on the
fake backend); and a clean evaluation through the pipeline, against one in place."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from corral.daemon.config import Config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import fake_backends
from corral.rollout import change as change_module
from corral.rollout.change import (
    ChangeSpec,
    ChangeTooLarge,
    Entry,
    Manifest,
    apply_change,
    capture_change,
    change_spec,
    compare,
    spec_key,
    take_manifest,
)
from corral.rollout.tasks import TaskError, check_task
from corral.sdk import AsyncClient
from corral.v1 import rollout_pb2 as pb
from tests.rollout_tasks import call, repair_task, replay_server

FILE = Entry("file", size=3, mode=0o644, modified_ms=1)
DIRECTORY = Entry("directory", size=4096, mode=0o755, modified_ms=1)
SPEC = ChangeSpec(root="/0", extra_paths=("/1",), protected=frozenset({"/0/tests/test_x.py", "/0/hidden"}))


def manifest(*paths: str, changed: dict[str, Entry] | None = None) -> Manifest:
    """A tree of `paths` (directories end with "/") and `changed`'s entries."""
    entries = {"/0": DIRECTORY}
    for path in paths:
        entries[path.rstrip("/")] = DIRECTORY if path.endswith("/") else FILE
    entries.update(changed or {})
    return Manifest(entries=entries)


BASE = manifest(
    "/0/pkg/",
    "/0/pkg/__init__.py",
    "/0/pkg/core.py",
    "/0/tests/",
    "/0/tests/test_x.py",
    "/0/tests/test_y.py",
    "/0/setup.cfg",
    "/0/README.md",
)


def test_added_modified_and_deleted_files_and_symlinks_are_the_change() -> None:
    agent = manifest(
        "/0/pkg/",
        "/0/pkg/__init__.py",
        "/0/tests/",
        "/0/tests/test_x.py",
        "/0/setup.cfg",
        "/0/README.md",
        "/0/pkg/new.py",
        changed={
            "/0/pkg/core.py": dataclasses.replace(FILE, size=9),
            "/0/pkg/link": Entry("symlink", target="core.py"),
            "/0/README.md": dataclasses.replace(FILE, mode=0o755),
        },
    )
    difference = compare(BASE, agent, SPEC)
    assert difference.files == ["/0/README.md", "/0/pkg/core.py", "/0/pkg/new.py"]
    assert difference.symlinks == {"/0/pkg/link": "core.py"}
    # A modified file is removed first (its mode is then the agent's); tests/test_y.py was deleted.
    assert difference.removed == ["/0/README.md", "/0/pkg/core.py", "/0/tests/test_y.py"]
    assert difference.dropped == {}


def test_a_file_with_the_manifests_size_mode_and_time_is_unchanged() -> None:
    same = compare(BASE, Manifest(entries=dict(BASE.entries)), SPEC)
    assert same == change_module.Difference(removed=[], files=[], symlinks={}, dropped={})


def test_a_deleted_directory_goes_as_a_whole_unless_it_holds_a_kept_path() -> None:
    without_pkg = manifest("/0/tests/", "/0/tests/test_x.py", "/0/tests/test_y.py", "/0/setup.cfg", "/0/README.md")
    assert compare(BASE, without_pkg, SPEC).removed == ["/0/pkg"]
    # tests/test_x.py is protected: the rest of tests/ goes one by one, it stays.
    without_tests = manifest("/0/pkg/", "/0/pkg/__init__.py", "/0/pkg/core.py", "/0/setup.cfg", "/0/README.md")
    difference = compare(BASE, without_tests, SPEC)
    assert difference.removed == ["/0/tests/test_y.py"]
    assert difference.dropped == {"/0/tests/test_x.py": "protected"}


def test_kinds_that_change_remove_what_was_there() -> None:
    # pkg/core.py becomes a directory holding a file, README.md a fifo.
    agent = manifest(
        "/0/pkg/",
        "/0/pkg/__init__.py",
        "/0/pkg/core.py/",
        "/0/pkg/core.py/inner.py",
        "/0/tests/",
        "/0/tests/test_x.py",
        "/0/tests/test_y.py",
        "/0/setup.cfg",
        changed={"/0/README.md": Entry("other")},
    )
    difference = compare(BASE, agent, SPEC)
    assert difference.removed == ["/0/README.md", "/0/pkg/core.py"]
    assert difference.files == ["/0/pkg/core.py/inner.py"]
    # A directory replaced by a file: the directory goes first.
    agent = manifest("/0/pkg", "/0/tests/", "/0/tests/test_x.py", "/0/tests/test_y.py", "/0/setup.cfg", "/0/README.md")
    difference = compare(BASE, agent, SPEC)
    assert difference.removed == ["/0/pkg"] and difference.files == ["/0/pkg"]
    # ... but not one holding a protected path: the file is left out, and so is the rest.
    agent = manifest("/0/pkg/", "/0/pkg/__init__.py", "/0/pkg/core.py", "/0/tests", "/0/setup.cfg", "/0/README.md")
    difference = compare(BASE, agent, SPEC)
    assert difference.files == [] and "/0/tests" in difference.dropped
    assert difference.dropped["/0/tests/test_x.py"] == "protected"
    assert difference.removed == ["/0/tests/test_y.py"]


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/0/conftest.py", "a pytest conftest"),
        ("/0/pkg/tests/conftest.py", "a pytest conftest"),
        ("/0/pytest.ini", "test configuration"),
        ("/0/tests/pytest.ini", "test configuration"),
        ("/0/tox.ini", "test configuration"),
        ("/0/pyproject.toml", "test configuration"),
        ("/0/pkg/sitecustomize.py", "run when Python starts"),
        ("/0/usercustomize.py", "run when Python starts"),
        ("/0/pkg/zz.pth", "a .pth file (run when Python starts)"),
        ("/0/pkg-1.0.dist-info/entry_points.txt", "package entry points (pytest plugins)"),
        ("/0/pkg/__pycache__/core.cpython-311.pyc", "bytecode"),
        ("/0/pkg/core.pyc", "bytecode"),
        ("/0/.pytest_cache/v/cache/lastfailed", "pytest's cache"),
        ("/0/tests/test_x.py", "protected"),
        ("/0/hidden/deep/file", "protected"),
        ("/1/app.conf.d/conftest.py", "a pytest conftest"),
        ("/0/.gitattributes", "git attributes (how the test patch is applied)"),
    ],
)
def test_what_reaches_the_test_run_is_left_out(path: str, reason: str) -> None:
    agent = Manifest(entries={**BASE.entries, path: dataclasses.replace(FILE, size=7)})
    difference = compare(BASE, agent, SPEC)
    assert difference.dropped.get(path) == reason and path not in difference.files


def test_changes_and_deletions_of_test_configuration_are_left_out_too() -> None:
    agent = Manifest(entries={**BASE.entries, "/0/setup.cfg": dataclasses.replace(FILE, size=99)})
    assert compare(BASE, agent, SPEC).dropped == {"/0/setup.cfg": "test configuration"}
    agent = Manifest(entries={p: e for p, e in BASE.entries.items() if p != "/0/setup.cfg"})
    difference = compare(BASE, agent, SPEC)
    assert difference.removed == [] and difference.dropped == {"/0/setup.cfg": "test configuration"}


@pytest.mark.parametrize(
    ("added", "dropped"),
    [
        (["/0/pytest/", "/0/pytest/__init__.py", "/0/pytest/__main__.py"], True),  # a new package
        (["/0/pluggy.py"], True),
        (["/0/_speedups.so"], True),
        (["/0/ns/", "/0/ns/google/", "/0/ns/google/protobuf.py"], True),  # a directory holding Python
        (["/0/reproduce.py"], True),  # harmless, and dropped all the same
        (["/0/NOTES.md"], False),
        (["/0/data/", "/0/data/x.csv"], False),
        (["/0/pkg/helpers.py"], False),  # inside an existing package: the code under test
        (["/1/tool.py"], False),  # an extra path is no module root
    ],
)
def test_new_top_level_python_modules_of_the_root_are_left_out(added: list[str], dropped: bool) -> None:
    agent = Manifest(entries={**BASE.entries, **manifest(*added).entries})
    difference = compare(BASE, agent, SPEC)
    files = [path for path in added if not path.endswith("/")]
    assert all((path in difference.dropped) == dropped for path in files), difference
    assert all((path in difference.files) != dropped for path in files), difference
    # A top-level module the repository already has is the code under test.
    modified = Manifest(entries={**BASE.entries, "/0/pkg/__init__.py": dataclasses.replace(FILE, size=1)})
    assert compare(BASE, modified, SPEC).files == ["/0/pkg/__init__.py"]


def test_a_directory_only_the_evaluation_writes_is_protected_as_a_whole() -> None:
    # Hidden tests go to tests_hidden/, which the set-up sandbox does not have: a module the agent
    # plants beside them is left out; one in tests/, which it has, only where named.
    spec = dataclasses.replace(SPEC, protected=frozenset({"/0/tests_hidden/deep/t.py", "/0/tests/test_new.py"}))
    planted = {"/0/tests_hidden/": 0, "/0/tests_hidden/test_zz.py": 0, "/0/tests/test_zz.py": 0}
    agent = Manifest(entries={**BASE.entries, **manifest(*planted).entries})
    difference = compare(BASE, agent, spec)
    assert difference.dropped == {"/0/tests_hidden/test_zz.py": "protected"}
    assert difference.files == ["/0/tests/test_zz.py"]


def test_what_could_not_be_read_on_either_side_is_left_as_it_is() -> None:
    agent = manifest("/0/README.md", "/0/setup.cfg", "/0/tests/", "/0/tests/test_x.py", "/0/tests/test_y.py")
    agent.entries["/0/pkg"] = DIRECTORY
    agent.unreadable.add("/0/pkg")
    assert compare(BASE, agent, SPEC).removed == []
    base = Manifest(entries=dict(BASE.entries), unreadable={"/0/tests"})
    agent = Manifest(entries={**BASE.entries, "/0/tests/new.py": FILE})
    assert compare(base, agent, SPEC).files == []


def test_the_spec_names_paths_in_a_view_every_sandbox_shares() -> None:
    evaluation = pb.TaskEvaluation(
        files=[pb.TaskFile(path="tests_hidden/t.py")],
        change=pb.TaskChange(
            root="repo", extra_paths=["/etc/app.conf", "/w1/repo/sub"], protected_paths=["tests/a.py", "/opt"]
        ),
    )
    evaluation.junit.report_path = "/tmp/report.xml"
    spec = change_spec(evaluation, "/w1")
    assert spec.root == "/w1/repo" and spec.extra_paths == ("/etc/app.conf",)  # one inside the root is the root's
    assert spec.protected == {"/w1/repo/tests/a.py", "/opt", "/w1/tests_hidden/t.py", "/tmp/report.xml"}
    view = spec.view()
    assert (view.root, view.extra_paths, view.protected) == ("/0", ("/1",), {"/0/tests/a.py"})
    assert spec.virtual("/w1/repo/x/y.py") == "/0/x/y.py" and spec.virtual("/w1/other") is None
    other = change_spec(evaluation, "/w2")
    assert other.actual("/0/x/y.py") == "/w2/repo/x/y.py" and other.actual("/1") == "/etc/app.conf"
    assert spec_key(evaluation) == spec_key(pb.TaskEvaluation.FromString(evaluation.SerializeToString()))
    assert spec_key(evaluation) != spec_key(pb.TaskEvaluation(change=evaluation.change))
    # A protected directory above a top protects all of it.
    assert change_spec(pb.TaskEvaluation(change=pb.TaskChange(protected_paths=["/"])), "/w").view().protected == {"/0"}


@pytest.mark.parametrize(
    "change",
    [
        pb.TaskChange(root="/"),
        pb.TaskChange(extra_paths=["relative/path"]),
        pb.TaskChange(extra_paths=["/"]),
        pb.TaskChange(root="../up"),
        pb.TaskChange(protected_paths=["a/../../b"]),
    ],
)
def test_a_task_whose_change_cannot_be_taken_is_refused(change: pb.TaskChange) -> None:
    task = repair_task("bad-change")
    task.evaluation.change.CopyFrom(change)
    with pytest.raises(TaskError, match="evaluation.change"):
        check_task(task)


# -- on the fake backend -----------------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[AsyncClient]:
    config = Config()
    config.daemon.memory_overcommit = 0
    async with embedded_daemon(config, backend_classes=fake_backends()) as address, AsyncClient(address) as client:
        yield client


SET_UP = (
    "mkdir -p repo/pkg repo/tests repo/gone && printf 'a\\n' > repo/pkg/core.py && printf x > repo/gone/f "
    "&& printf t > repo/tests/test_x.py && printf k > repo/keep.txt && printf m > repo/mode.sh && mkdir -p repo/.git "
    "&& printf h > repo/.git/HEAD"
)


async def test_a_change_is_read_from_one_sandbox_and_applied_to_another(client) -> None:
    evaluation = pb.TaskEvaluation(change=pb.TaskChange(root="repo", protected_paths=["tests/test_x.py"]))
    agent, clean = await client.create_sandbox(), await client.create_sandbox()
    for sandbox in (agent, clean):
        assert (await sandbox.exec(SET_UP)).ok
    spec = change_spec(evaluation, agent.info.workdir)
    base = await take_manifest(agent, spec)
    assert "/0/.git" not in base.entries and "/0/pkg/core.py" in base.entries
    agent_edits = (
        "cd repo && printf 'b\\n' >> pkg/core.py && printf n > pkg/new.py && rm -r gone && chmod 755 mode.sh "
        "&& ln -s pkg/core.py link && printf evil > conftest.py && printf t2 > tests/test_x.py "
        "&& printf '\\x00\\xff' > blob.bin && printf g > .git/HEAD"
    )
    assert (await agent.exec(agent_edits)).ok
    change = await capture_change(agent, spec, base)
    assert sorted(change.files) == ["/0/blob.bin", "/0/mode.sh", "/0/pkg/core.py", "/0/pkg/new.py"]
    assert change.files["/0/blob.bin"] == (0o644, b"\x00\xff") and change.files["/0/mode.sh"][0] == 0o755
    assert change.symlinks == {"/0/link": "pkg/core.py"}
    assert change.dropped == {"/0/conftest.py": "a pytest conftest", "/0/tests/test_x.py": "protected"}
    await apply_change(clean, change, change_spec(evaluation, clean.info.workdir), timeout_s=30)
    tree = await clean.exec(
        "cd repo && for f in pkg/core.py pkg/new.py keep.txt tests/test_x.py .git/HEAD; do cat $f; echo; done "
        "&& readlink link && stat -c %a mode.sh && test ! -e gone && test ! -e conftest.py && od -An -tx1 blob.bin"
    )
    assert tree.ok, tree
    assert tree.stdout.decode().split() == ["a", "b", "n", "k", "t", "h", "pkg/core.py", "755", "00", "ff"]


async def test_a_change_past_the_caps_is_too_large(client, monkeypatch) -> None:
    evaluation = pb.TaskEvaluation(change=pb.TaskChange(root="repo"))
    agent = await client.create_sandbox()
    assert (await agent.exec(SET_UP)).ok
    spec = change_spec(evaluation, agent.info.workdir)
    base = await take_manifest(agent, spec)
    assert (await agent.exec("cd repo/pkg && for i in 1 2 3; do printf x > f$i.py; done")).ok
    monkeypatch.setattr(change_module, "MAX_CHANGE_FILES", 2)
    with pytest.raises(ChangeTooLarge, match="3 files"):
        await capture_change(agent, spec, base)
    monkeypatch.setattr(change_module, "MAX_CHANGE_FILES", 10)
    monkeypatch.setattr(change_module, "MAX_CHANGE_BYTES", 2)
    with pytest.raises(ChangeTooLarge, match="bytes"):
        await capture_change(agent, spec, base)


def scoped_task(task_id: str, isolation: pb.EvaluationIsolation) -> pb.Task:
    """A task whose change is src/ only: the agent fixes calc.py there and also writes a marker
    beside src/, which the check reads. In a clean sandbox the marker is not the agent's change."""
    solution = [
        call("editor", command="str_replace", path="src/calc.py", old_str="a - b", new_str="a + b"),
        call("bash", command="echo planted > marker.txt"),
        call("submit"),
    ]
    task = repair_task(task_id, solution=solution, eval_command="cat marker.txt 2>/dev/null; python3 check.py")
    del task.setup.files[:]
    task.setup.files.add(path="src/calc.py", content=b"def add(a, b):\n    return a - b\n")
    task.evaluation.files[0].content = b"import sys\nsys.path.insert(0, 'src')\n" + task.evaluation.files[0].content
    task.evaluation.change.root = "src"
    task.evaluation.isolation = isolation
    return task


async def test_the_pipeline_evaluates_the_change_in_a_clean_sandbox_unless_told_in_place(client) -> None:
    clean = scoped_task("scoped-clean", pb.EVALUATION_ISOLATION_UNSPECIFIED)
    in_place = scoped_task("scoped-in-place", pb.EVALUATION_ISOLATION_IN_PLACE)
    async with replay_server([clean, in_place]) as server:
        await client.rollouts.register_llm(server.url)
        results = {r.task_id: r async for r in client.rollouts.stream([clean, in_place])}
    for result in results.values():
        assert (result.status, result.reward) == ("completed", 1.0), (result.error, result.eval_output)
    # The fake backend cannot snapshot: a new sandbox, set up again, with the fix applied.
    assert results["scoped-clean"].eval_sandbox == "new"
    assert b"planted" not in results["scoped-clean"].eval_output
    assert b"the agent's change: 1 files written" in results["scoped-clean"].eval_output
    assert results["scoped-clean"].timings["eval_sandbox"] > 0
    assert results["scoped-in-place"].eval_sandbox == "in_place"
    assert b"planted" in results["scoped-in-place"].eval_output
    assert await client.list_sandboxes() == []

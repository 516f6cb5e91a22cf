"""Learned imports (rove.agent.imports, rove.agent.forkservers.learn): what warm workers
imported is imported by the next warm server, and a module that a server must not
import is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from rove.agent import imports


class _Lazy(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"importing {name} failed")


def _module(name: str, file: str | None) -> types.ModuleType:
    m = types.ModuleType(name)
    if file is not None:
        m.__file__ = file
    return m


def test_what_a_worker_learned_leaves_out_the_servers_modules_its_own_code_and_aliases(
    tmp_path: Path,
) -> None:
    lib, own = tmp_path / "site-packages", tmp_path / "project"
    (own / "sub").mkdir(parents=True)
    linked = tmp_path / "linked"
    linked.symlink_to(own)
    modules = {
        "torch": _module("torch", str(lib / "torch/__init__.py")),
        "yaml": _module("yaml", str(lib / "yaml/__init__.py")),
        "yaml.cyaml": _module("yaml.cyaml", str(lib / "yaml/cyaml.py")),
        "model": _module("model", str(own / "model.py")),
        "helpers": _module("helpers", str(linked / "sub" / "helpers.py")),  # (via a link)
        "os.path": _module("posixpath", str(lib / "posixpath.py")),  # an alias
        "sys": _module("sys", None),  # built in
        "__mp_main__": _module("__mp_main__", str(lib / "x.py")),
        "relative": _module("relative", "relative/path.py"),
        "jinja2": _module("jinja2", str(lib / "jinja2/__init__.py")),
        "lazy": _Lazy("lazy"),  # (its attributes raise: skipped, nothing raised)
    }
    assert imports.learnable(modules, {"torch"}, [str(own)]) == ["yaml", "yaml.cyaml", "jinja2"]
    assert imports.learnable(modules, {"torch", "yaml"}, [str(own), str(lib / "jinja2")]) == [
        "yaml.cyaml"
    ]
    # a virtual environment in the project's folder, the working directory: installed
    in_project = tmp_path / "project" / ".venv" / "site-packages"
    venv = {"tqdm": _module("tqdm", str(in_project / "tqdm" / "__init__.py")), **modules}
    assert imports.learnable(venv, {"torch"}, [str(own)], [str(in_project)]) == [
        "tqdm",
        "yaml",
        "yaml.cyaml",
        "jinja2",
    ]
    assert "tqdm" not in imports.learnable(venv, {"torch"}, [str(own)])
    assert str(Path(json.__file__).parents[1]) in imports.installed_dirs(), "the standard library"


def test_a_workers_list_is_read_whole_and_its_bad_entries_are_left_out(tmp_path: Path) -> None:
    path = imports.path_for(tmp_path / "round1-local0")
    assert path.name == "round1-local0.imports"
    assert imports.read(path) is None, "not written yet"
    imports.write(path, ["yaml", "yaml.cyaml"])
    assert imports.read(path) == imports.Listed(("yaml", "yaml.cyaml"), final=True)
    imports.write(path, ["yaml"], final=False)
    assert imports.read(path) == imports.Listed(("yaml",), final=False)
    assert not list(tmp_path.glob("*.tmp"))
    path.write_text(json.dumps({"modules": ["ok.mod", "not a name", "", 3, "os;rm"]}))
    assert imports.read(path) == imports.Listed(("ok.mod",), final=True)
    for garbage in ("{", "[]", '{"modules": 3}', "null"):
        path.write_text(garbage)
        assert imports.read(path) == imports.Listed((), final=True), garbage
    assert imports.union([("a", "b"), ("b", "c"), ()]) == ("a", "b", "c")
    assert imports.top("transformers.models.gpt2") == "transformers"


#: Modules for `take`, on the path of a child interpreter (each case taints its process).
_LIBRARY = {
    "plain_one.py": "VALUE = 1\n",
    "noisy.py": "import warnings\nprint('noisy says hello')\nwarnings.warn('careful')\n",
    "broken.py": "raise RuntimeError('broken on purpose')\n",
    "reads_then_breaks.py": "import os\nos.environ.get('RANK')\nraise ImportError('no')\n",
    "reads_rank.py": "import os\nRANK = os.environ.get('RANK', '0')\n",
    "wraps_reader/__init__.py": "import deep_reader\n",
    "deep_reader.py": "import os\nLOCAL = os.getenv('LOCAL_RANK')\n",
    "reads_home.py": "import os\nHOME = os.environ.get('HOME')\n",
    "starts_thread.py": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    ),
    "starts_process.py": (
        "import subprocess\n"
        "P = subprocess.Popen(['sleep', '30'], stdin=subprocess.DEVNULL,\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    ),
}


_TOPS = sorted({rel.split("/")[0].removesuffix(".py") for rel in _LIBRARY})


def _take(tmp_path: Path, names: list[str], keys: list[str]) -> tuple[dict[str, object], str]:
    lib = tmp_path / "lib"
    for rel, text in _LIBRARY.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(lib)!r})
        from rove.agent import imports
        taken = imports.take({names!r}, {keys!r})
        print(json.dumps({{**taken.__dict__, "loaded": sorted(m for m in sys.modules
                          if m in {_TOPS!r})}}))
        if "starts_process" in sys.modules:
            sys.modules["starts_process"].P.kill()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]), out.stdout + out.stderr


def test_a_server_takes_what_it_can_and_keeps_the_imports_output_off_the_console(
    tmp_path: Path,
) -> None:
    taken, output = _take(
        tmp_path, ["noisy", "broken", "plain_one", "reads_home"], ["RANK", "LOCAL_RANK"]
    )
    assert taken["culprit"] is None, taken
    assert (taken["imported"], taken["failed"]) == (3, 1), "the broken one skipped"
    assert taken["loaded"] == ["noisy", "plain_one", "reads_home"]
    assert "noisy says hello" not in output and "careful" not in output, output


@pytest.mark.parametrize(
    ("names", "culprit", "why"),
    [
        (["plain_one", "reads_rank", "noisy"], "reads_rank", "reads RANK as it is imported"),
        (["wraps_reader"], "deep_reader", "reads LOCAL_RANK as it is imported"),
        (["starts_thread", "noisy"], "starts_thread", "starts a thread as it is imported"),
        (["starts_process"], "starts_process", "starts a process as it is imported"),
        (["reads_then_breaks", "plain_one"], "reads_then_breaks", "reads RANK as it is"),
    ],
)
def test_a_module_that_a_forked_worker_could_not_use_is_refused_by_name(
    tmp_path: Path, names: list[str], culprit: str, why: str
) -> None:
    taken, _ = _take(tmp_path, names, ["RANK", "LOCAL_RANK"])
    assert taken["culprit"] == culprit, taken
    assert str(taken["why"]).startswith(why), taken
    assert "noisy" not in taken["loaded"], "it stops at the first it refuses"  # type: ignore[operator]


def test_a_watched_worker_writes_what_it_imported_in_its_own_thread(tmp_path: Path) -> None:
    """In a real interpreter, without a thread of its own: a worker writes its list as
    its first process group is made (not final), then final at its FINAL_AFTER_STEPS-th
    step, or as its script ends; without the agent's word nothing is watched."""
    from rove.agent import progress

    lib = tmp_path / "lib"
    (lib / "learnme").mkdir(parents=True)
    (lib / "learnme" / "__init__.py").write_text("from learnme import part\n")
    (lib / "learnme" / "part.py").write_text("X = 1\n")
    (lib / "later.py").write_text("Z = 3\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "mine.py").write_text("Y = 2\n")
    for case in ("steps", "ends", "off"):
        prog = tmp_path / f"progress-{case}"
        progress.create(prog)
        code = textwrap.dedent(
            f"""
            import json, os, sys, threading
            sys.path[:0] = [{str(lib)!r}, {str(project)!r}]
            from rove.agent import groups, imports, progress
            watch = imports.watch(frozenset(sys.modules), {str(project / "script.py")!r})
            assert threading.active_count() == 1, "no thread of its own"
            import learnme, mine
            path = imports.path_for({str(prog)!r})
            said = []
            if {case!r} == "steps":
                groups.on_group()  # (as torch makes its first process group)
                said.append(imports.read(path))
                import later
                for step in range(1, imports.FINAL_AFTER_STEPS + 1):
                    said.append(imports.read(path))
                    progress.report(step)
                assert progress.on_step is None and groups.on_group is None
            elif watch is not None:
                watch.settle()
            print(json.dumps(said))
            """
        )
        env = {**os.environ, progress.ENV: str(prog)}
        if case != "off":
            env[imports.ENV] = "1"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90
        )
        assert out.returncode == 0, out.stdout + out.stderr
        learned = imports.read(imports.path_for(prog))
        if case == "off":
            assert learned is None
            continue
        assert learned is not None and learned.final
        assert {"learnme", "learnme.part"} <= set(learned.modules), learned
        assert "mine" not in learned.modules, "the script's own folder is not learned"
        assert not any(n.startswith("rove") for n in learned.modules), "(under the working folder)"
        if case == "steps":
            said = json.loads(out.stdout.strip().splitlines()[-1])
            first, *while_stepping = said
            assert first[1] is False and "later" not in first[0], "as its group was made"
            assert all(s == first for s in while_stepping), "nothing until the last step"
            assert "later" in learned.modules, "final: what it imported since"


def _found_imported(name: str) -> None:
    sys.exit(0 if name in sys.modules else 7)


def _stdlib_servers(monkeypatch: pytest.MonkeyPatch, lib: Path) -> types.ModuleType:
    """forkservers whose quick and full servers import one stdlib module (not torch),
    with `lib` on their path; multiprocessing's module functions put back afterwards."""
    import multiprocessing.forkserver as mpfs

    from rove.agent import forkservers

    for name in ("_forkserver", "ensure_running", "get_inherited_fds", "connect_to_new_process"):
        monkeypatch.setattr(mpfs, name, getattr(mpfs, name))
    monkeypatch.setattr(mpfs, "set_forkserver_preload", mpfs.set_forkserver_preload)
    # (a forkserver of Python 3.11 does not take its parent's sys.path: PYTHONPATH)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    monkeypatch.setattr(forkservers, "QUICK", ("json",))
    monkeypatch.setattr(forkservers, "FULL", ("json",))
    monkeypatch.setattr(forkservers, "_servers", forkservers._Servers())
    monkeypatch.setattr(forkservers, "LEARN_AT_LEAST", 1)
    return forkservers


@pytest.mark.slow
async def test_a_server_learns_the_workers_imports_restarts_fork_from_it_and_a_refusal_is_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import multiprocessing

    from tests.support import eventually

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "learn_a.py").write_text("A = 1\n")
    (lib / "learn_c.py").write_text("C = 3\n")
    (lib / "reads_rank_b.py").write_text("import os\nB = os.environ.get('RANK')\n")
    forkservers = _stdlib_servers(monkeypatch, lib)
    monkeypatch.setattr(forkservers, "MAX_LEARNING", 4)
    servers = forkservers._servers
    try:
        forkservers.start()  # (no quick server: the full one at once)
        assert forkservers.learn(["learn_a"], ["RANK"]) == forkservers.Lesson(), (
            "nothing to compare with until a server is ready"
        )
        await eventually(forkservers.serving_ready, timeout=60)
        monkeypatch.setattr(forkservers, "LEARN_AT_LEAST", 2)
        assert forkservers.learn(["learn_a"], ["RANK"]) == forkservers.Lesson(settled=True)
        assert servers.learning is None, "one new module is not worth a server"
        monkeypatch.setattr(forkservers, "LEARN_AT_LEAST", 1)
        lesson = forkservers.learn(["learn_a"], ["RANK"])
        assert lesson == forkservers.Lesson(started=True, new=("learn_a",))
        learning = servers.learning
        assert learning is not None and learning.nice == forkservers.BACKGROUND_NICE
        await eventually(learning.ready, timeout=60)
        assert "learn_a" in learning.modules() and "json" in learning.modules()
        assert forkservers.learn(["learn_a"], ["RANK"]) == forkservers.Lesson(settled=True)
        assert servers.coming is learning and servers.learning is None, "the one to come"
        assert forkservers.learn(["learn_a", "not_importable_here"], ["RANK"]).started
        await eventually(lambda: forkservers.learn(["learn_a"], []).settled, timeout=60)
        assert forkservers.learn(["not_importable_here"], []) == forkservers.Lesson(settled=True), (
            "what a server could not import is not tried again"
        )
        learning = servers.coming
        assert learning is not None and learning.learned == ("learn_a", "not_importable_here")
        full_pid = servers.serving.pid if servers.serving else None
        forkservers.promote()
        assert forkservers.serving() == ("learned", learning.pid)
        assert full_pid is not None and not Path(f"/proc/{full_pid}").exists(), "superseded"
        worker = multiprocessing.get_context("forkserver").Process(
            target=_found_imported, args=("learn_a",)
        )
        worker.start()
        worker.join(60)
        assert worker.exitcode == 0, "a worker forked from it finds learn_a imported"

        names = ["learn_a", "reads_rank_b", "learn_c"]
        assert forkservers.learn(names, ["RANK"]).started
        refusing = servers.learning
        lesson = await eventually(lambda: forkservers.learn(names, ["RANK"]).refused, timeout=60)
        assert lesson[0] == "reads_rank_b" and lesson[1].startswith("reads RANK"), lesson
        assert refusing is not None and not refusing.ready(), "a refusing server never serves"
        assert servers.learning is None and forkservers.serving() == ("learned", learning.pid)
        again = forkservers.learn(names, ["RANK"])
        assert again == forkservers.Lesson(started=True, new=("learn_c",)), "without it"
        assert servers.learning is not None
        assert servers.learning.learned == ("learn_a", "not_importable_here", "learn_c")
        await eventually(servers.learning.ready, timeout=60)
        assert forkservers.learn(["another"], []) == forkservers.Lesson(settled=True), (
            f"at most {forkservers.MAX_LEARNING} servers learn in a process"
        )
    finally:
        forkservers.stop()


class _Said:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []

    def info(self, text: str, **kw: object) -> None:
        self.lines.append(("info", text, kw))

    def warning(self, text: str, **kw: object) -> None:
        self.lines.append(("warning", text, kw))


def test_the_agent_hands_on_its_workers_lists_once_all_are_written_and_says_what_came_of_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from rove.agent import forkservers, progress
    from rove.agent.learning import Learning

    asked: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    answers = [
        forkservers.Lesson(started=True, new=("yaml", "yaml.cyaml", "jinja2")),
        forkservers.Lesson(refused=("jinja2", "reads RANK as it is imported (...)")),
        forkservers.Lesson(settled=True),
    ]

    def learn(names: tuple[str, ...], keys: tuple[str, ...]) -> forkservers.Lesson:
        asked.append((names, keys))
        return answers.pop(0) if answers else forkservers.Lesson(settled=True)

    monkeypatch.setattr(forkservers, "learn", learn)
    monkeypatch.setenv("SAME_EVERYWHERE", "1")
    said = _Said()
    now = [100.0]
    learning = Learning(True, said, clock=lambda: now[0])
    envs = learning.prepare(
        {0: {"RANK": "0", "SAME_EVERYWHERE": "1"}, 1: {"RANK": "1", "SAME_EVERYWHERE": "1"}}
    )
    assert all(env[imports.ENV] == "1" for env in envs.values()), "their watch is on"
    files = {lr: tmp_path / f"round1-local{lr}" for lr in (0, 1)}
    learning.started(files)
    imports.write(imports.path_for(files[0]), ["yaml", "yaml.cyaml"])
    learning.tick()
    assert asked == [], "not before every worker wrote its list"
    imports.write(imports.path_for(files[1]), ["yaml"], final=False)
    learning.tick()
    assert asked == [], "not before every list is final ..."
    now[0] += imports.FINAL_WITHIN_S
    imports.write(imports.path_for(files[1]), ["yaml", "jinja2"], final=False)
    learning.tick()
    names, keys = asked[0]
    assert names == ("yaml", "yaml.cyaml", "jinja2"), "... or the wait is over"
    assert set(keys) == {"RANK", imports.ENV, progress.ENV}, "what differs in the workers"
    assert said.lines[0][0] == "info" and "learns 3 modules" in said.lines[0][1]
    assert "(yaml, jinja2)" in said.lines[0][1]
    learning.tick()
    assert said.lines[1][0] == "warning" and said.lines[1][2] == {"say": True}
    assert said.lines[1][1].startswith("the warm server does not keep jinja2 imported: it reads")
    learning.tick()  # settled
    learning.tick()
    assert len(asked) == 3, "settled: not asked again until the workers name more"
    assert not Learning(False, said).prepare({0: {"RANK": "0"}})[0].get(imports.ENV)


@pytest.mark.slow
async def test_a_learning_server_that_dies_is_told_and_no_other_learns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A learning server that ends before it is ready (a module's import crashed it, or
    it was killed) is said once; no other learns in this process, and the full server
    goes on serving."""
    import signal

    from tests.support import eventually

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "slow_mod.py").write_text("import time\ntime.sleep(60)\n")
    forkservers = _stdlib_servers(monkeypatch, lib)
    servers = forkservers._servers
    try:
        forkservers.start()
        await eventually(forkservers.serving_ready, timeout=60)
        assert forkservers.learn(["slow_mod"], []).started
        learning = servers.learning
        assert learning is not None and learning.pid is not None
        os.kill(learning.pid, signal.SIGKILL)
        lesson = await eventually(lambda: forkservers.learn(["slow_mod"], []).refused, timeout=30)
        assert lesson == ("", "it ended before it was ready (killed by SIGKILL)")
        assert servers.learning is None and forkservers.serving_ready()
        assert forkservers.learn(["slow_mod", "other"], []) == forkservers.Lesson(settled=True)
    finally:
        forkservers.stop()

"""The README's and the reference pages' code blocks: the Python runs as written, the shell names real commands.

Fences, in ``README.md`` and every ``docs/*.md``:

- ` ```python `: runs. A page's blocks run in order in one namespace, like a notebook; each page
  starts from a fresh namespace (all pages share one process, so torch is imported once).
- ` ```python requires=PKG[,PKG] `: needs an optional package (the integrations extra); runs on its
  own, in a fresh namespace and working directory, and is skipped with the reason when a package
  is missing. These blocks share one process too (one import of each framework, 8-10 s apiece).
- ` ```python no-run `: not run (it needs a ``torchrun`` launch). The line before it is an HTML
  comment ``<!-- not run: why, and where it is tested instead -->``; each such block is reported
  as a skipped test with that reason, and there are few.

Shell blocks (` ```bash `) are not run, but every ``batchpilot ...`` line is parsed by the real
command-line parser, every ``make`` target exists, and every script a ``python`` / ``torchrun`` line
starts exists and declares the options it is given.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 400
MAX_NOT_RUN = 3  # the DDP, FSDP2 and uneven-shares launches (docs/distributed.md, docs/fsdp.md, docs/uneven.md)

_FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_NOT_RUN = re.compile(r"<!-- not run: (?P<reason>\S.*?) -->")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_SHELL_COMMANDS = {"batchpilot", "make", "python", "torchrun", "pip"}


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the block's first code line
    lang: str
    flags: tuple[str, ...]
    code: str
    before: str  # the last non-empty line before the fence

    @property
    def no_run(self) -> bool:
        return "no-run" in self.flags

    @property
    def requires(self) -> tuple[str, ...]:
        for flag in self.flags:
            if flag.startswith("requires="):
                return tuple(p for p in flag.split("=", 1)[1].split(",") if p)
        return ()

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, in order."""
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        info = m.group("info").split()
        preceding = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        out.append(Block(page=str(page.relative_to(ROOT)), line=text.count("\n", 0, m.start("code")) + 1,
                         lang=info[0] if info else "", flags=tuple(info[1:]), code=m.group("code"),
                         before=preceding[-1].strip() if preceding else ""))
    return out


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
PLAIN = [b for b in PYTHON if not b.no_run and not b.requires]
NOT_RUN = [b for b in PYTHON if b.no_run]
NEED_EXTRA = [b for b in PYTHON if b.requires and not b.no_run]
PLAIN_PAGES = sorted({b.page for b in PLAIN}, key=[str(p.relative_to(ROOT)) for p in PAGES].index)


def _env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            **({"PYTHONPATH": str(ROOT / "src")} if (ROOT / "src").exists() else {})}


# Runs each page's blocks in a fresh module namespace and its own working directory, in one process;
# a failing block ends its page (later blocks depend on it), not the run.
_RUNNER = r'''
import json, os, sys, traceback, types
pages, out = json.load(open(sys.argv[1])), {}
top = os.getcwd()
for i, (page, page_blocks) in enumerate(pages.items()):
    module = types.ModuleType(f"docs_page_{i}")
    sys.modules[module.__name__] = module
    os.makedirs(os.path.join(top, str(i)))
    os.chdir(os.path.join(top, str(i)))
    out[page] = None
    for line, code in page_blocks:
        try:
            exec(compile(code, f"{page} line {line}", "exec"), module.__dict__)
        except BaseException:
            out[page] = f"{page}, the block at line {line}:\n" + traceback.format_exc()[-6000:]
            break
    os.chdir(top)
json.dump(out, open(sys.argv[2], "w"))
'''


def _run_pages(tmp: Path, pages: dict[str, list[tuple[int, str]]]) -> dict[str, str | None]:
    """``{page: None | the failing block and its traceback}``: each page's ``(line, code)`` blocks in order."""
    (tmp / "blocks.json").write_text(json.dumps(pages))
    (tmp / "runner.py").write_text(_RUNNER)
    proc = subprocess.run([sys.executable, str(tmp / "runner.py"), str(tmp / "blocks.json"), str(tmp / "out.json")],
                          cwd=tmp, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0 and (tmp / "out.json").exists(), \
        f"the block runner itself failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads((tmp / "out.json").read_text())


def _missing(block: Block) -> list[str]:
    return [p for p in block.requires if importlib.util.find_spec(p) is None]


@pytest.fixture(scope="module")
def extra_blocks_run(tmp_path_factory) -> dict[str, str | None]:
    """Every block that needs an extra and has it, each as a page of its own, in one process."""
    runnable = [b for b in NEED_EXTRA if not _missing(b)]
    if not runnable:
        return {}
    return _run_pages(tmp_path_factory.mktemp("extras"), {b.where: [(b.line, b.code)] for b in runnable})


def test_the_pages_have_python_blocks_and_say_why_they_skip_any():
    assert len(PYTHON) >= 17, [b.where for b in PYTHON]
    assert sum(not b.no_run for b in PYTHON) >= len(PYTHON) - MAX_NOT_RUN, [b.where for b in NOT_RUN]
    for b in PYTHON:
        unknown = [f for f in b.flags if f != "no-run" and not f.startswith("requires=")]
        assert not unknown, f"{b.where}: unknown fence flag(s) {unknown}: use no-run or requires=PKG"
    for b in NOT_RUN:
        assert _NOT_RUN.fullmatch(b.before), (
            f"{b.where} is fenced no-run: put '<!-- not run: why, and where it is tested instead -->' on the "
            f"line before it (found {b.before!r})")


# One test for all pages, not one per page: they share one process (one torch import), and a test
# per page sharing a fixture would run every page once per pytest-xdist worker.
def test_every_python_block_of_every_page_runs_as_written(tmp_path):
    failures = _run_pages(tmp_path, {page: [(b.line, b.code) for b in PLAIN if b.page == page]
                                     for page in PLAIN_PAGES})
    assert set(failures) == set(PLAIN_PAGES)
    failed = [message for message in failures.values() if message is not None]
    assert not failed, f"{len(failed)} of {len(failures)} pages failed:\n\n" + "\n\n".join(failed)


# a test per block, judged on the one run of them all (make test keeps a file on one worker)
@pytest.mark.parametrize("block", NEED_EXTRA, ids=lambda b: f"{b.page}:{b.line}")
def test_blocks_that_need_an_extra_run_on_their_own(block, extra_blocks_run):
    missing = _missing(block)
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}: pip install -e '.[integrations]'")
    assert block.where in extra_blocks_run, f"{block.where} was not run"
    failure = extra_blocks_run[block.where]
    assert failure is None, f"{block.where} failed:\n{failure}"


@pytest.mark.parametrize("block", NOT_RUN, ids=lambda b: f"{b.page}:{b.line}")
def test_blocks_not_run_are_reported(block):
    m = _NOT_RUN.fullmatch(block.before)
    pytest.skip(f"{block.where}: not run: {m.group('reason') if m else '(no reason given)'}")


def _shell_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every command line in a bash block (continuations joined, comments dropped)."""
    out = []
    for b in ALL:
        if b.lang not in ("bash", "sh", "shell"):
            continue
        for i, line in enumerate(b.code.replace("\\\n", " ").splitlines()):
            argv = shlex.split(line, comments=True)
            if argv:
                out.append((f"{b.where}+{i}", argv))
    return out


SHELL = _shell_lines()


def test_shell_blocks_name_real_commands_and_options():
    from batchpilot.app.cli import build_parser

    assert any(argv[0] == "batchpilot" for _, argv in SHELL)
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    problems = []
    for where, argv in SHELL:
        if argv[0] not in _SHELL_COMMANDS:
            problems.append(f"{where}: {argv[0]!r} is not a command this test knows how to check")
        elif argv[0] == "batchpilot":
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit as exc:
                if exc.code not in (0, None):
                    problems.append(f"{where}: `{shlex.join(argv)}` does not parse (exit {exc.code})")
        elif argv[0] == "make":
            problems += [f"{where}: no make target {t!r}" for t in argv[1:] if "=" not in t and t not in targets]
        elif argv[0] in ("python", "torchrun"):
            scripts = [i for i, a in enumerate(argv) if a.endswith(".py")]
            if not scripts:
                continue  # python -m ..., torchrun of a module: nothing of ours to check
            script = ROOT / argv[scripts[0]]
            if not script.exists():
                problems.append(f"{where}: {argv[scripts[0]]} does not exist")
                continue
            source = script.read_text()
            for a in argv[scripts[0] + 1:]:
                if a.startswith("--") and f'"{a.split("=", 1)[0]}"' not in source:
                    problems.append(f"{where}: {script.name} declares no option {a.split('=', 1)[0]}")
    assert not problems, "\n".join(problems)


def test_every_option_the_cli_page_names_exists():
    from batchpilot.app.cli import build_parser

    parser = build_parser()
    known = set(parser._option_string_actions)
    for sub in parser._subparsers._group_actions[0].choices.values():
        known |= set(sub._option_string_actions)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", (ROOT / "docs" / "cli.md").read_text()))
    typo = {"--capcity"}  # the page's example of the near-miss hint
    assert typo <= named and not named - known - typo, sorted(named - known - typo)


def test_the_readme_is_short_and_links_every_reference_page():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= README_MAX_LINES
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"README.md links no docs page named {unlinked}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        for m in _LINK.finditer(page.read_text()):
            target, _, anchor = m.group("target").partition("#")
            if "://" in target:
                continue
            path = (page.parent / target) if target else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {m.group('target')}")
    assert not broken, "\n".join(broken)

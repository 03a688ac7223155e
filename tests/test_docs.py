"""The docs that cannot rot: every block of README.md and docs/*.md marked runnable runs here, on tiny stand-ins.

How a page marks its blocks (GitHub highlights by the info string's first word, so the marks cost nothing there):
- ```` ```bash run ```` / ```` ```python run ````: runnable. Each page's runnable blocks run in order in one fresh
  temporary directory (the page's working directory, so a block sees what the blocks before it wrote): a bash block
  with `bash -e` (a failing command stops it), a Python block as a script of its own, with `python` and zoo as
  installed (`pip install -e .`: here the checkout on PYTHONPATH).
- ```` ```text output ```` right after a runnable block: lines that block must print (compared with runs of spaces
  squeezed). A sample output anywhere else is labelled as an example in the text and not checked.
- Any other block is an example (GPUs, torchrun across nodes, multi-GB downloads) and is not run.

Before it runs, a block's text goes through SUBSTITUTIONS, the one table of what the test changes: a Hugging Face
download becomes a copy of a tiny checkpoint saved by transformers' own classes (STANDINS), step counts become 2,
generation lengths 8. A failure names the page, the block's line and the command that failed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ASSETS = ROOT / "recipes" / "assets"

# (pattern, replacement, why): applied in this order to every runnable block, each pattern a regex on the block text
SUBSTITUTIONS: list[tuple[str, str, str]] = [
    (r"hf download (\S+) --local-dir (\S+)", r'mkdir -p \2 && cp -r "$ZOO_DOCS_STANDINS/\1/." \2/',
     "a Hugging Face download: a copy of the tiny stand-in saved for that repository id (STANDINS)"),
    (r"--steps \d+", "--steps 2", "training runs: two steps"),
    (r"\bsteps=\d+", "steps=2", "training runs from Python: two steps"),
    (r"(python -m recipes\.(?:pretrain|sft|dpo|llava))(?=[ \t]*(?:#|$|&&))", r"\1 --steps 2",
     "a recipe on its built-in defaults (no --steps): two steps"),
    (r"--max-new-tokens \d+", "--max-new-tokens 8", "generation: 8 new tokens"),
    (r"(python -m zoo\.generate \S+ --prompt \"[^\"]*\")(?=[ \t]*(?:#|$))", r"\1 --max-new-tokens 8",
     "generation with the default length (256): 8 new tokens"),
    (r"\bmax_new_tokens=\d+", "max_new_tokens=8", "generation from Python: 8 new tokens"),
]


def qwen3(path: Path) -> None:
    """Qwen/Qwen3-0.6B's stand-in: transformers' Qwen3ForCausalLM at width 64 (tied head, q/k norms, GQA 4/2 heads)
    with zoo's bundled tokenizer (2,048 entries, a ChatML template) beside it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / name, path / name)


# a Hugging Face repository id the docs download -> how its stand-in is made
STANDINS = {"Qwen/Qwen3-0.6B": qwen3}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str  # bash | python
    text: str
    output: list[str]  # lines it must print (the ```text output block after it)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


def fenced(page: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, the rest of the info string, text) of every fenced block of `page`."""
    found, lines, i = [], page.read_text().split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a fenced block that never closes"
            found.append((i + 1, m.group(1), m.group(2).strip(), "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return found


def runnable(page: Path) -> list[Block]:
    blocks: list[Block] = []
    for line, lang, info, text in fenced(page):
        if info == "run":
            assert lang in ("bash", "python"), f"{page.relative_to(ROOT)}:{line}: only bash and python blocks run"
            blocks.append(Block(page, line, lang, text, []))
        elif lang == "text" and info == "output":
            assert blocks and not blocks[-1].output, f"{page.relative_to(ROOT)}:{line}: an output block must follow " \
                                                     "a runnable block"
            blocks[-1].output = [squeeze(s) for s in text.splitlines() if s.strip()]
    return blocks


def squeeze(s: str) -> str:
    return " ".join(s.split())


def substitute(text: str) -> str:
    for pattern, replacement, _ in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text, flags=re.M)
    return text


def parses(block: Block, text: str) -> str | None:
    """Why `text` (a block's text before or after the substitutions) does not parse, or None."""
    if block.lang == "python":
        try:
            compile(text, block.where, "exec")
        except SyntaxError as e:
            return str(e)
        return None
    r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    return r.stderr.strip() or None


def failed_command(block: Block, output: str) -> str:
    if block.lang == "bash":
        found = re.findall(r"^zoo-docs: failed: (.*)$", output, flags=re.M)
        if found:
            return found[-1]
    return next(s for s in block.text.splitlines() if s.strip() and not s.startswith(("#", "import", "from")))


def make_standins(root: Path) -> Path:
    """The stand-ins, made by a process of their own (transformers seeds torch's generator: never this process's,
    whose tests run meanwhile)."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import test_docs\n"
            "for repo, make in test_docs.STANDINS.items():\n"
            "    (Path(sys.argv[2]) / repo).mkdir(parents=True); make(Path(sys.argv[2]) / repo)\n")
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(root)], check=True,
                   capture_output=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return root


def environment(standins: Path) -> dict[str, str]:
    env = dict(os.environ, ZOO_DOCS_STANDINS=str(standins), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return env


RUN_PAGES = [p for p in PAGES if runnable(p)]
TEST = "test_the_runnable_blocks_run"


def run_page(page: Path, workdir: Path, env: dict[str, str], live: set[subprocess.Popen] | None = None) -> str | None:
    """Run the page's runnable blocks in order in `workdir`; why the first one that failed did, or None. `live` holds
    the block running now (PageRuns.stop ends it)."""
    for i, block in enumerate(runnable(page)):
        text = substitute(block.text)
        problem = parses(block, text)
        if problem is not None:
            return f"{block.where}: the block does not parse after the substitutions: {problem}"
        if block.lang == "python":
            script = workdir / f".zoo_docs_block_{i}.py"
            script.write_text(text)
            argv = [sys.executable, str(script)]
        else:
            argv = ["bash", "-e", "-c", "trap 'echo \"zoo-docs: failed: $BASH_COMMAND\" >&2' ERR\n" + text]
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        if live is not None:
            live.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"{block.where}: still running after 300 s"
        finally:
            if live is not None:
                live.discard(proc)
        output = stdout + stderr
        if proc.returncode != 0:
            return f"{block.where}: `{failed_command(block, output)}` exited with {proc.returncode}\n{output[-3000:]}"
        printed = {squeeze(s) for s in output.splitlines()}
        missing = [s for s in block.output if s not in printed]
        if missing:
            return f"{block.where}: the block did not print {missing}; it printed:\n{output[-3000:]}"
    return None


class PageRuns:
    """The selected pages, run two at a time on threads of this process, each block a fresh interpreter whose time
    goes mostly to importing torch on one core. conftest starts them once the session's tests are collected
    (`start_early`), so that they use the core the mostly single-threaded suite leaves idle; each page's test waits
    for its result."""

    def __init__(self, pages: list[Path]):
        self.root, self.stopped = Path(tempfile.mkdtemp(prefix="zoo-docs-")), False
        self.live: set[subprocess.Popen] = set()
        self.runs: dict[Path, Future[str | None]] = {page: Future() for page in pages}
        standins: Future[Path] = Future()
        queue = list(enumerate(pages))
        lock = threading.Lock()

        def worker(first: bool) -> None:
            if first:
                try:
                    standins.set_result(make_standins(self.root / "standins"))
                except BaseException as e:  # noqa: B036 - handed to every page's test
                    standins.set_exception(e)
            while True:
                with lock:
                    if not queue or self.stopped:
                        return
                    i, page = queue.pop(0)
                try:
                    workdir = self.root / f"page{i}"
                    workdir.mkdir()
                    env = dict(environment(standins.result()), OMP_NUM_THREADS="1")
                    self.runs[page].set_result(run_page(page, workdir, env, self.live))
                except BaseException as e:  # noqa: B036 - handed to the page's test
                    self.runs[page].set_exception(e)

        # daemon threads: a session that stops early (-x, Ctrl-C) does not wait for them (`stop` ends their blocks)
        self.threads = [threading.Thread(target=worker, args=(n == 0,), daemon=True) for n in range(2)]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """End what still runs and remove the pages' directories."""
        self.stopped = True
        while any(thread.is_alive() for thread in self.threads):
            for proc in list(self.live):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)


EARLY: dict[str, PageRuns] = {}


def start_early(items: list[pytest.Item]) -> None:
    """conftest calls this with this module's selected tests once the session's are collected: start their pages."""
    selected = [item.callspec.params["page"] for item in items
                if getattr(item, "originalname", None) == TEST and hasattr(item, "callspec")]
    if selected and "runs" not in EARLY:
        EARLY["runs"] = PageRuns(selected)


def stop_early() -> None:
    """conftest calls this when the session ends (as the module's tests end too)."""
    if "runs" in EARLY:
        EARLY.pop("runs").stop()


@pytest.fixture(scope="module")
def page_runs(request):
    start_early(request.session.items)  # started already, unless conftest's hook did not run
    yield EARLY["runs"].runs
    stop_early()


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_the_runnable_blocks_run(page, page_runs):
    failure = page_runs[page].result()
    assert failure is None, failure


def test_the_marks_and_substitutions_hold():
    """Every substitution is used (a table entry nothing needs is dead), every download has a stand-in, and every
    runnable block parses before and after its substitutions (the test changes values, never the command)."""
    blocks = [b for p in PAGES for b in runnable(p)]
    assert len(blocks) >= 15, len(blocks)
    text = "\n".join(b.text for b in blocks)
    for pattern, _, why in SUBSTITUTIONS:
        assert re.search(pattern, text, flags=re.M), f"no runnable block needs the substitution for {why}"
    for repo in re.findall(r"hf download (\S+)", text):
        assert repo in STANDINS, f"the docs download {repo}, which has no stand-in in STANDINS"
    for b in blocks:
        for version in (b.text, substitute(b.text)):
            problem = parses(b, version)
            assert problem is None, f"{b.where}: does not parse: {problem}"
    for page in PAGES:
        for line, _, info, _ in fenced(page):
            assert info in ("", "run", "output"), f"{page.relative_to(ROOT)}:{line}: unknown mark {info!r}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> list[tuple[int, str]]:
    """(level, text) of the page's headings outside fenced blocks."""
    found, fence = [], False
    for s in page.read_text().split("\n"):
        if s.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^(#{1,6}) (.*)$", s)):
            found.append((len(m.group(1)), m.group(2)))
    return found


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in {anchor(h) for _, h in headings(dest)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    readme = (ROOT / "README.md").read_text()
    unlisted = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name}" not in readme]
    assert not unlisted, f"README.md links no page {unlisted}"


def test_every_docs_page_opens_with_its_contents():
    """A docs page's contents list (before its first section) links every `##` section of the page."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        head = text[:text.index("\n## ")] if "\n## " in text else text
        listed = set(re.findall(r"\]\(#([^)]+)\)", head))
        missing = [h for level, h in headings(page) if level == 2 and anchor(h) not in listed]
        assert not missing, f"docs/{page.name}: the contents list lacks {missing}"


# the commands whose flags the docs name: each prints them with --help
COMMANDS = ["recipes.pretrain", "recipes.sft", "recipes.dpo", "recipes.llava", "recipes.vlm", "recipes.pretokenize",
            "convert.hf_to_zoo", "convert.zoo_to_hf", "convert.llava_layouts", "zoo.generate.cli"]
# flags of other programs the docs show: torchrun, Slurm's #SBATCH, pip, hf download, pytest, git show
OTHER_PROGRAMS = {"--nproc_per_node", "--nnodes", "--node-rank", "--max-restarts", "--rdzv-backend", "--rdzv-endpoint",
                  "--rdzv-id", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--index-url", "--local-dir",
                  "--dist", "--stat"}


def test_every_flag_the_docs_name_exists():
    """A flag in any block or sentence of the docs is one a zoo command takes (its --help lists it), one that a
    script of bench/ or tools/ defines, or another program's: a renamed flag fails here even where no block runs."""
    known = set(OTHER_PROGRAMS)
    for name in COMMANDS:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as e:
            importlib.import_module(name).main(["--help"])
        assert e.value.code == 0, f"python -m {name} --help exited with {e.value.code}"
        known |= set(re.findall(r"(?<![\w-])--[a-z][\w-]*", printed.getvalue()))
    scripts = "\n".join(p.read_text() for folder in ("bench", "tools") for p in (ROOT / folder).glob("*.py"))
    known |= set(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", scripts))
    unknown = sorted({f"{page.relative_to(ROOT)}: {flag}" for page in PAGES
                      for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", page.read_text()) if flag not in known})
    assert not unknown, "flags no command takes:\n" + "\n".join(unknown)


def test_the_modules_and_files_the_docs_name_exist():
    """`python -m zoo...|recipes...|convert...` names a module, a path such as bench/bench_sp.py or
    recipes/configs/llava-stage2.toml a file, and a test named in a table (test_recipes) a file of tests/."""
    missing = set()
    for page in PAGES:
        text, name = page.read_text(), page.relative_to(ROOT)
        for module in re.findall(r"python -m ((?:zoo|recipes|convert)\b[\w.]*)", text):
            if importlib.util.find_spec(module) is None:
                missing.add(f"{name}: module {module}")
        for path in re.findall(r"(?<![\w/.])((?:bench|tools|tests|zoo|recipes|convert)/[\w/.-]*\.(?:py|sh|toml|yaml))",
                               text):
            if not (ROOT / path).exists():
                missing.add(f"{name}: {path}")
        for test in re.findall(r"\b(test_[a-z0-9_]+)\b", text):
            if not (ROOT / "tests" / f"{test}.py").exists():
                missing.add(f"{name}: tests/{test}.py")
    assert not missing, "\n".join(sorted(missing))

"""The documentation against the tree it describes: every relative link in
README.md and docs/ resolves (file and heading), every page under docs/ is
reachable from the README, the README's first screen gives exactly the two
commands (the one CI runs among them), its DeepSpeed example runs as written,
docs/cli.md names every flag of every `tierflow` command in bench/cli/ and no
flag the code lacks, and every key the quick commands print with --json (run
for real when the tree is built)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
FIRST_SCREEN = 50  # lines: what a terminal or GitHub shows before any scrolling
SHELL = ("", "sh", "bash", "shell", "console")

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _split(text: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The fenced blocks of a Markdown text (language, lines) and its other
    lines, in order; an unclosed block runs to the end."""
    blocks: list[tuple[str, list[str]]] = []
    prose: list[str] = []
    fence = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            blocks.append((m.group(2).lower(), []))
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is not None:
            blocks[-1][1].append(line)
        else:
            prose.append(line)
    return blocks, prose


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, link targets and
    punctuation dropped (hyphens and underscores kept), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _split(page.read_text())[1]:
        m = _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    """The link targets in a page's prose; inline code spans are left out
    (their text may show a link without being one)."""
    out = []
    for line in _split(page.read_text())[1]:
        out += _LINK.findall(re.sub(r"`[^`]*`", "", line))
    return out


def _resolve(page: Path, target: str) -> tuple[Path, str] | None:
    """(file, anchor) for a relative link, None for one with a scheme."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        return None
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        resolved = _resolve(page, target)
        if resolved is None:
            continue
        path, anchor = resolved
        if ROOT not in path.parents and path != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_page_under_docs_is_reachable_from_the_readme():
    reached, todo = set(), [README]
    while todo:
        page = todo.pop()
        for target in _links(page):
            resolved = _resolve(page, target)
            if resolved and resolved[0].suffix == ".md" and resolved[0].exists() and resolved[0] not in reached:
                reached.add(resolved[0])
                todo.append(resolved[0])
    missing = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in reached]
    assert not missing, f"not linked from README.md (or a page it links): {missing}"


def _commands(lines: list[str]) -> list[str]:
    """The command lines of the shell blocks among ``lines`` (comments dropped)."""
    out = []
    for lang, body in _split("\n".join(lines))[0]:
        if lang in SHELL:
            out += [cmd for cmd in (line.split("#", 1)[0].strip() for line in body) if cmd]
    return out


def test_the_readme_first_screen_gives_exactly_the_two_commands():
    commands = _commands(README.read_text().splitlines()[:FIRST_SCREEN])
    assert commands == ["scripts/run.sh", "scripts/test.sh"]
    for command in commands:
        assert os.access(ROOT / command, os.X_OK), f"{command}: not an executable script"
    # CI runs the README's test command as it is written there.
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#") and not line.split()[0] in ("set", "cd")]
    assert ci and all(line in commands for line in ci), f".ci/run runs {ci}, the README gives {commands}"


class _Regression(torch.nn.Module):
    """The README's ``MyModel``: two layers and a loss, called as ``model(x, y)``."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.out(torch.relu(self.hidden(x))), y)


def test_the_readme_deepspeed_example_runs_as_written(tmp_path, monkeypatch):
    """The README's Python block, unchanged, over a DeepSpeed config of stage
    3 with parameters and optimizer on NVMe: the model is built into the
    store, every micro-batch steps, the checkpoint has DeepSpeed's layout and
    loads back."""
    code = next(body for lang, body in _split(README.read_text())[0] if lang == "python")
    nvme = tmp_path / "nvme"
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
        "tierflow": {"device_memory": "16M", "host_memory": "16M"},
    }
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    loader = [(x, x.sum(dim=1, keepdim=True))] * 6  # one batch again and again: the loss must fall
    namespace = {"MyModel": _Regression, "loader": loader}
    try:
        exec(compile("\n".join(code), str(README), "exec"), namespace)
        engine = namespace["engine"]
        import tierflow

        assert all(isinstance(p, tierflow.zero.StoredParameter) for p in engine.module.parameters())
        assert namespace["optimizer"] is engine.optimizer
        assert engine.global_steps == len(loader)
        tag = tmp_path / "checkpoints" / "global_step6"
        assert (tmp_path / "checkpoints" / "latest").read_text().strip() == tag.name
        assert (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()
        with torch.no_grad():
            first = engine(*loader[0]).item()
        for batch in loader:
            engine.backward(engine(*batch))
            engine.step()
        with torch.no_grad():
            assert engine(*loader[0]).item() < first
    finally:
        if "engine" in namespace:
            namespace["engine"].close()


_SUBCOMMAND = re.compile(r'(?:(bench|tune)_command\(app\)|app)\.add_subcommand\(\s*"([a-z]+)"')
_CODE_FLAG = re.compile(r'add_(?:option|flag)\(\s*"(--[a-z0-9-]+)"')
_DOC_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _code_flags() -> dict[str, set[str]]:
    """Each `tierflow` subcommand of bench/cli/ and the flags its source declares."""
    out = {}
    for source in sorted((ROOT / "bench" / "cli").glob("*.cpp")):
        text = source.read_text()
        m = _SUBCOMMAND.search(text)
        if m:
            out[" ".join(filter(None, m.groups()))] = set(_CODE_FLAG.findall(text))
    return out


def _doc_sections() -> dict[str, tuple[set[str], set[str]]]:
    """Each ``## `tierflow X``` section of docs/cli.md: (the flags its tables'
    first column names, every flag of its own that its prose mentions)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    name = None
    for line in _split((DOCS / "cli.md").read_text())[1]:
        m = re.match(r"^## `tierflow ([a-z ]+)`\s*$", line)
        if m:
            name = m.group(1)
            out[name] = (set(), set())
        elif line.startswith("#"):
            name = None
        elif name is not None:
            tabled, mentioned = out[name]
            if line.startswith("|"):
                tabled.update(_DOC_FLAG.findall(line.split("|")[1]))
            # `bench io --config` and the like name another command's flag
            mentioned.update(_DOC_FLAG.findall(re.sub(r"`(?:tierflow )?(?:bench|tune) [a-z]+ [^`]*`", "", line)))
    return out


def test_the_cli_page_documents_every_flag_of_every_command():
    code, docs = _code_flags(), _doc_sections()
    assert set(code) == {"info", "bench io", "tune io", "bench optim", "bench offload"}
    assert set(docs) == set(code), "docs/cli.md's sections and bench/cli's commands differ"
    for name, flags in code.items():
        tabled, mentioned = docs[name]
        assert tabled == flags, (f"tierflow {name}: undocumented {sorted(flags - tabled)}, "
                                 f"documented but not in the code {sorted(tabled - flags)}")
        assert mentioned <= flags, f"tierflow {name}: docs/cli.md mentions {sorted(mentioned - flags)}"


def test_the_cli_page_synopsis_names_only_real_flags():
    code = _code_flags()
    synopsis = _split((DOCS / "cli.md").read_text())[0][0][1]
    for line in synopsis:
        words = line.split()
        if words[:2] == ["tierflow", "--version"]:
            continue
        name = " ".join(words[1:3]) if words[1] in ("bench", "tune") else words[1]
        extra = set(_DOC_FLAG.findall(line)) - code[name]
        assert not extra, f"tierflow {name}'s synopsis names {sorted(extra)}"


def _json_keys(section: str) -> dict[str, str]:
    """The keys the ``| key | type | meaning |`` tables of a docs/cli.md
    section document (``numa[]`` as ``numa``), each with its row."""
    out: dict[str, str] = {}
    inside = in_table = False
    for line in _split((DOCS / "cli.md").read_text())[1]:
        if line.startswith("## "):
            inside = line.strip() == f"## `tierflow {section}`"
        elif inside and line.startswith("| key |"):
            in_table = True
        elif inside and in_table and line.startswith("|"):
            for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
                out[key.replace("[]", "")] = line
        else:
            in_table = False
    return out


def _undocumented(output: dict, documented: dict[str, str]) -> list[str]:
    """The keys of a command's JSON (two levels deep) its docs do not name:
    ``a.b`` is named as itself, or in the row of ``a`` as `b`."""
    missing = []
    for key, value in output.items():
        if key not in documented and not any(d.startswith(key + ".") for d in documented):
            missing.append(key)
        elif isinstance(value, dict) and key not in documented:
            missing += [f"{key}.{sub}" for sub in value if f"{key}.{sub}" not in documented]
        elif isinstance(value, dict):
            missing += [f"{key}.{sub}" for sub in value
                        if f"{key}.{sub}" not in documented and f"`{sub}`" not in documented[key]]
    return missing


def test_the_cli_page_names_every_key_the_commands_print(tmp_path):
    """The JSON of the quick commands, run for real, against docs/cli.md's key tables."""
    cli = ROOT / "build" / "bin" / "tierflow"
    if not os.access(cli, os.X_OK):
        pytest.skip(f"no {cli.relative_to(ROOT)}: build the tree first (scripts/build.sh)")
    runs = {
        "info": [["info", "--json", "--path", str(tmp_path)]],
        "bench io": [["bench", "io", "--json", "--path", str(tmp_path / "f"), "--size", "4M"]],
        "bench optim": [["bench", "optim", "--json", "--params", "64K", "--steps", "1"],
                        ["bench", "optim", "--json", "--optimizer", "muon", "--shape", "64x128", "--steps", "1"]],
        "tune io": [["tune", "io", "--json", "--path", str(tmp_path), "--size", "1M", "--block-sizes", "256K",
                     "--queue-depths", "4", "--threads", "1"]],
    }
    for section, commands in runs.items():
        documented = _json_keys(section)
        for args in commands:
            done = subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"tierflow {' '.join(args)}: {done.stderr.strip()}"
            missing = _undocumented(json.loads(done.stdout), documented)
            assert not missing, f"tierflow {section} --json prints keys docs/cli.md does not name: {missing}"

"""The README as a front door and the docs pages behind it: the README stays short, cites each
method's paper by title, authors and arXiv id and links its page; every link of the README, the
changelog and the docs pages reaches a file that exists; the generated reports say what generated
them; the shipped ds_configs' micro-batches are those docs/TRAINING.md tables; CITATION.cff and
LICENSE say what the README says."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted([README, REPO / "CHANGELOG.md", *REPO.glob("docs/**/*.md")])
METHOD_PAGES = sorted(REPO.glob("docs/methods/*.md"))


def cited_paper(page: Path) -> tuple[str, str, str]:
    """(method, title, arXiv id) as a method's page opens: `# ... (`--objective <method>`)`, then the
    paper's authors, *title.* and arXiv:<id>; "" for what it does not say."""
    text = page.read_text()
    method = re.match(r"# .*\(`--objective (\w+)`\)", text)
    title = re.search(r"\*([^*]+?)\.?\*", " ".join(text.split()))  # the first italic span
    arxiv = re.search(r"arXiv:(\d{4}\.\d{4,5})", text)
    return tuple(found.group(1) if found else "" for found in (method, title, arxiv))


# method -> (its page, title, arXiv id), as its page in docs/methods/ cites them
PAPERS = {method: (page.relative_to(REPO).as_posix(), title, arxiv)
          for page in METHOD_PAGES for method, title, arxiv in [cited_paper(page)]}
# the shipped methods' papers, written here too: a wrong id copied into the README and the page alike
CITED = {
    "mae": ("Masked Autoencoders Are Scalable Vision Learners", "2111.06377"),
    "mixedae": ("Mixed Autoencoder for Self-supervised Visual Representation Learning", "2303.17152"),
    "maeplus": ("AdPE: Adversarial Positional Embeddings for Pretraining Vision Transformers via MAE+", "2303.07598"),
    "mlomae": ("Downstream Task Guided Masking Learning in Masked Autoencoders Using Multi-Level Optimization",
               "2402.18128"),
    "energy": ("Energy-Inspired Self-Supervised Pretraining for Vision Models", "2302.01384"),
}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the detail into docs/"


@pytest.mark.parametrize("method", sorted(PAPERS))
def test_the_readme_and_the_methods_page_cite_the_paper(method):
    page, title, arxiv = PAPERS[method]
    row = next((line for line in README.read_text().splitlines() if f"`{method}`" in line and "arXiv:" in line), "")
    assert title in row and f"arXiv:{arxiv}" in row and f"({page})" in row, f"README.md's row for {method}: {row}"
    text = " ".join((REPO / page).read_text().split())
    assert title in text and f"arXiv:{arxiv}" in text and f"--objective {method}" in text, page


@pytest.mark.parametrize("method", sorted(CITED))
def test_the_shipped_methods_pages_cite_their_papers_as_published(method):
    assert PAPERS[method][1:] == CITED[method], PAPERS[method][0]


def test_there_is_one_page_per_method():
    """A method is an objective with a debug preset (train/configs/<name>/debug.json; fine-tuning and
    the linear probe have none); each has one page in docs/methods/ that cites its paper."""
    unread = [p.name for p in METHOD_PAGES if not all(cited_paper(p))]
    assert not unread, f"{unread}: open with '# Name (`--objective <name>`)', the paper's *title.* and arXiv:<id>"
    methods = {p.parent.name for p in REPO.glob("train/configs/*/debug.json")}
    assert len(PAPERS) == len(METHOD_PAGES), "two pages name the same --objective"
    assert set(PAPERS) == methods and set(CITED) <= methods, f"methods without a page: {sorted(methods - set(PAPERS))}"


def links(page: Path) -> list[tuple[int, str]]:
    return [(number, target) for number, line in enumerate(page.read_text().splitlines(), 1)
            for target in LINK.findall(line) if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_reaches_a_file(page):
    broken = [f"{page.relative_to(REPO)}:{number}: {target}" for number, target in links(page)
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_readme_indexes_every_docs_page():
    readme = README.read_text()
    pages = [p.relative_to(REPO).as_posix() for p in REPO.glob("docs/*.md")
             if not p.name.startswith("RESULTS_discussion") and p.name != "kernel_sweep.md"]
    missing = [p for p in pages if f"({p})" not in readme]
    assert not missing, f"docs pages the README's index does not link: {missing}"


@pytest.mark.parametrize("report", ["docs/RESULTS.md", "docs/RESULTS_ablation.md"])
def test_a_generated_report_says_what_generated_it(report):
    head = "\n".join((REPO / report).read_text().splitlines()[:5])
    assert re.search(r"(Written|Generated) by .*experiments/fashion_mnist/report\.py", head), head


def _globs(cell: str) -> list[re.Pattern]:
    """`vit_b_8x{v100_fp16,a100_bf16}_zero{1,2}.json` / `..._8x..._zero1.json` -> regexes of file names."""
    out = []
    for glob in re.findall(r"`([^`]+\.json)`", cell):
        regex = re.escape(glob).replace(r"\.\.\.", ".*")
        regex = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", regex)
        out.append(re.compile(regex + "$"))
    return out


def test_the_shipped_micro_batches_are_those_docs_training_tables():
    text = (REPO / "docs" / "TRAINING.md").read_text()
    table = text[text.index("## The shipped ds_configs"):].split("\n\n")[2]
    gpus = ("v100", "a100", "h100")
    checked = 0
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        values = re.fullmatch(r"(\d+) / (\d+) / (\d+)", cells[-1])
        if not values:
            continue
        for path in sorted((REPO / "ds_configs").glob("*.json")):
            if any(g.match(path.name) for g in _globs(cells[0])):
                gpu = next(g for g in gpus if f"8x{g}" in path.name)
                micro = json.loads(path.read_text())["train_micro_batch_size_per_gpu"]
                assert micro == int(values.group(gpus.index(gpu) + 1)), f"{path.name}: {micro}, docs/TRAINING.md: {row}"
                checked += 1
    assert checked >= 30, checked  # every shipped 8-GPU file


def test_citation_and_licence():
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "Apache-2.0" and cff["authors"]
    cited = {i["value"] for ref in cff["references"] for i in ref["identifiers"]}
    assert cited == {f"arXiv:{arxiv}" for _, _, arxiv in PAPERS.values()}
    assert {ref["title"] for ref in cff["references"]} == {title for _, title, _ in PAPERS.values()}
    licence = (REPO / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "Apache License 2.0" in README.read_text() and "(CITATION.cff)" in README.read_text()

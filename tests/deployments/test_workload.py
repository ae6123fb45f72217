"""The benchmark workloads are the same prompts on every checkout: nothing in them comes from
the project's own files, which change with every commit."""

import email.message
import importlib.metadata

from deployments import workload


class _Dist:
    """A distribution whose metadata is a README (what `importlib.metadata` gives per package)."""

    def __init__(self, name: str, body: str) -> None:
        self.metadata = email.message.Message()
        self.metadata["Name"] = name
        self.metadata.set_payload(body)


PARA = " ".join(["This paragraph is written for people and is long enough to count as prose."] * 4)


def test_the_projects_own_readme_is_not_a_source_of_docs_prompts(monkeypatch):
    others = [_Dist("alpha", PARA + "\n\n" + PARA.replace("people", "readers")), _Dist("beta", PARA.upper())]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **_: list(others))
    pool = workload._doc_paragraphs(400)
    assert len(pool) == 3  # the fake packages' paragraphs are read
    # Our own distribution, twice (the venv's dist-info and a checkout's egg-info, different
    # README snapshots): the pool is unchanged.
    ours = [_Dist("dcut", PARA.replace("people", f"users {i}") + "\n\n" + PARA) for i in range(2)]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **_: [*ours, *others])
    assert workload._doc_paragraphs(400) == pool


def test_no_docs_prompt_is_a_paragraph_of_readme():
    import pathlib

    readme = " ".join((pathlib.Path(__file__).parents[2] / "README.md").read_text().split())
    assert not [p for p in workload._doc_paragraphs(400) if p[:80] in readme]


def test_the_docs_pool_does_not_depend_on_what_was_imported_before(monkeypatch, tmp_path):
    """A folder put on `sys.path` with a distribution in it (as importing ray puts its
    thirdparty_files there) leaves the pool, and so the mixed workload, unchanged."""
    before = workload._doc_paragraphs(400)
    info = tmp_path / "extra_readme-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-readme\nVersion: 1.0\n\n" + PARA + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert any(d.metadata["Name"] == "extra-readme" for d in importlib.metadata.distributions())  # it is on the path
    assert workload._doc_paragraphs(400) == before
    assert workload.mixed_prompts(16, seed=3) == workload.mixed_prompts(16, seed=3)

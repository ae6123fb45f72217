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
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: list(others))
    pool = workload._doc_paragraphs(400)
    assert len(pool) == 3  # the fake packages' paragraphs are read
    # Our own distribution, twice (the venv's dist-info and a checkout's egg-info, different
    # README snapshots): the pool is unchanged.
    ours = [_Dist("dcut", PARA.replace("people", f"users {i}") + "\n\n" + PARA) for i in range(2)]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [*ours, *others])
    assert workload._doc_paragraphs(400) == pool


def test_no_docs_prompt_is_a_paragraph_of_readme():
    import pathlib

    readme = " ".join((pathlib.Path(__file__).parents[2] / "README.md").read_text().split())
    assert not [p for p in workload._doc_paragraphs(400) if p[:80] in readme]

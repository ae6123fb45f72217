"""Where a chained drafter stops (dcut_core/chains.py): exact cases and a brute-force reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut_core.chains import ChainStop, cut_lengths

IDENTITY = (0.0, 1.0, 0.0, 0.0)  # calibrated chance = the drafter's confidence


def rule(per_draft: float, per_pass: float) -> ChainStop:
    return ChainStop(IDENTITY, 8, per_draft, per_pass)


def test_no_rule_drafts_what_was_asked():
    conf = np.full((3, 5), 0.01)
    lengths, passes = cut_lengths(None, np.array([2, 5, 0]), conf, conf)
    assert lengths.tolist() == [2, 5, 0] and passes == 5


def test_a_draft_not_worth_verifying_is_not_drafted():
    """Survivals 0.9, 0.45, 0.405: with 0.42 a verified token's price, the third is cut (its pass
    was run: three passes)."""
    conf = np.array([[0.9, 0.5, 0.9, 0.9]])
    lengths, passes = cut_lengths(rule(0.42, 0.0), np.array([4]), conf, np.zeros_like(conf))
    assert lengths.tolist() == [2] and passes == 3


def test_the_chain_stops_when_its_requests_cannot_pay_a_pass():
    """Two requests at survivals 0.6 and 0.3 after the first pass: 0.9 < 1.0, the price of a
    pass, so the chain stops there and each keeps one draft, though both asked for three."""
    conf = np.array([[0.6, 0.99, 0.99], [0.3, 0.99, 0.99]])
    lengths, passes = cut_lengths(rule(0.0, 1.0), np.array([3, 3]), conf, np.zeros_like(conf))
    assert lengths.tolist() == [1, 1] and passes == 1
    lengths, passes = cut_lengths(rule(0.0, 0.5), np.array([3, 3]), conf, np.zeros_like(conf))
    assert lengths.tolist() == [3, 3] and passes == 3  # 0.9, 0.89, 0.88 ≥ 0.5: every pass pays


def test_the_first_draft_is_never_cut():
    conf = np.array([[0.05, 0.9]])
    lengths, passes = cut_lengths(rule(0.5, 0.0), np.array([2]), conf, np.zeros_like(conf))
    assert lengths.tolist() == [1] and passes == 1  # and no pass for a second: it could only be less likely


def test_the_calibration_is_the_kinds():
    """A calibration less sure than the drafter (−1.1 on the logit: 0.8 → 0.57) cuts where the
    raw confidence would not: survivals 0.57, 0.33 against 0.8, 0.64, with 0.5 the price."""
    conf = np.array([[0.8, 0.8]])
    raw, _ = cut_lengths(rule(0.5, 0.0), np.array([2]), conf, np.zeros_like(conf))
    shy = ChainStop((-1.1, 1.0, 0.0, 0.0), 8, 0.5, 0.0)
    calibrated, _ = cut_lengths(shy, np.array([2]), conf, np.zeros_like(conf))
    assert raw.tolist() == [2] and calibrated.tolist() == [1]


def reference(rule: ChainStop, wanted: list[int], conf: np.ndarray) -> tuple[list[int], int]:
    """Position by position, every row's survival known in full: at each pass, the rows still
    drafting whose draft there is under `per_draft` stop before it (after it, if it is their
    first); the chain ends after the
    pass where no row drafting wants more, or where those drafting sum under `per_pass` (they
    keep the pass's drafts). A row's cut is only known once its pass has run. Survivals are the
    rule's own calibrated chances multiplied up (an identity calibration rounds by an ulp, and
    hypothesis finds prices equal to a confidence: compared raw, such a tie went either way)."""
    per_draft, per_pass = rule.per_draft, rule.per_pass
    chances = np.stack([rule.chances(conf[:, j], np.zeros(len(conf)), j) for j in range(conf.shape[1])], axis=1)
    survival = np.cumprod(chances, axis=1)
    out, passes = list(wanted), 0
    for s in range(max(wanted, default=0)):
        passes = s + 1
        cut = [n > s and survival[i, s] < per_draft for i, n in enumerate(out)]
        out = [max(s, 1) if c else n for c, n in zip(cut, out, strict=True)]
        live = [i for i, n in enumerate(out) if n > s and not cut[i]]
        if not any(out[i] > s + 1 for i in live):
            break
        if float(survival[live, s].sum()) < per_pass:
            out = [s + 1 if i in live else n for i, n in enumerate(out)]
            break
    return out, passes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.floats(0.01, 0.99), min_size=6, max_size=6)),
                min_size=1, max_size=5),
       st.floats(0.0, 0.8), st.floats(0.0, 3.0))
def test_the_cut_equals_a_brute_force_reference(rows, per_draft, per_pass):
    wanted = [n for n, _ in rows]
    conf = np.array([c for _, c in rows])
    lengths, passes = cut_lengths(rule(per_draft, per_pass), np.array(wanted), conf, np.zeros_like(conf))
    want_lengths, want_passes = reference(rule(per_draft, per_pass), wanted, conf)
    assert lengths.tolist() == want_lengths
    assert passes == (want_passes if max(wanted) > 0 else 0)
    assert (lengths <= np.array(wanted)).all()
    stricter, _ = cut_lengths(rule(per_draft + 0.1, per_pass), np.array(wanted), conf, np.zeros_like(conf))
    assert (stricter <= lengths).all()  # a dearer verification never drafts more

"""Speculative decoding's pure parts: prompt-lookup drafts and which drafted tokens survive."""

from __future__ import annotations

import random

import pytest

from pdd_sidecar.engine.speculative import ngram
from pdd_sidecar.engine.speculative.ngram import NgramConfig, NgramIndex, propose
from pdd_sidecar.engine.speculative.verify import accepted_tokens


def test_the_latest_occurrence_of_the_longest_ending_is_continued() -> None:
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # ending [2, 3] (n=2) occurs at 1 and 5; the latest (5) continues with 7, 8, 5
    assert propose(toks, NgramConfig(k=3, max_n=2)) == [7, 8, 5]
    # ending [5, 2, 3] never occurred before: n=3 finds nothing, n=2 answers
    assert propose(toks, NgramConfig(k=2, max_n=3)) == [7, 8]


def test_a_longer_ending_beats_a_later_shorter_one() -> None:
    toks = [4, 5, 6, 10, 0, 6, 11, 4, 5, 6]
    assert propose(toks, NgramConfig(k=1, max_n=3)) == [10]
    assert propose(toks, NgramConfig(k=1, max_n=1)) == [11]


def test_no_draft_without_an_earlier_occurrence_or_below_min_n() -> None:
    assert propose([1, 2, 3, 4], NgramConfig(k=3)) == []
    assert propose([], NgramConfig()) == []
    assert propose([7], NgramConfig()) == []
    assert propose([1, 2, 9, 2], NgramConfig(k=1, max_n=3, min_n=2)) == []
    assert propose([1, 2, 9, 2], NgramConfig(k=1, max_n=3, min_n=1)) == [9]


def test_drafts_stop_at_the_end_of_the_text() -> None:
    assert propose([3, 3], NgramConfig(k=4)) == [3]


def test_the_proposal_matches_a_brute_force_search() -> None:
    rng = random.Random(5)
    for _ in range(400):
        toks = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        cfg = NgramConfig(k=rng.randrange(1, 5), max_n=rng.randrange(1, 5))
        want: list[int] = []
        for n in range(cfg.max_n, cfg.min_n - 1, -1):
            if n >= len(toks):
                continue
            starts = [s for s in range(len(toks) - n) if toks[s:s + n] == toks[len(toks) - n:]]
            if starts:
                want = toks[max(starts) + n:max(starts) + n + cfg.k]
                break
        assert propose(toks, cfg) == want, (toks, cfg)


@pytest.mark.parametrize("k,max_n,min_n", [(0, 3, 1), (2, 2, 3), (2, 3, 0)])
def test_bad_settings_are_refused_naming_them(k: int, max_n: int, min_n: int) -> None:
    with pytest.raises(ValueError, match="speculative"):
        NgramConfig(k=k, max_n=max_n, min_n=min_n)


def test_drafts_are_kept_while_they_equal_the_draws() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, and a bonus
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the differing draw ends it
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accepted_tokens([], [4]) == [4]


def test_draws_must_cover_every_position() -> None:
    with pytest.raises(ValueError, match="need 3 draws for 2 drafts"):
        accepted_tokens([1, 2], [1, 2])


def test_the_incremental_index_proposes_what_the_scan_does() -> None:
    rng = random.Random(9)
    for _ in range(200):
        cfg = NgramConfig(k=rng.randrange(1, 5), max_n=rng.randrange(1, 5))
        cfg = NgramConfig(k=cfg.k, max_n=cfg.max_n, min_n=rng.randrange(1, cfg.max_n + 1))
        index = NgramIndex(cfg)
        toks: list[int] = []
        for _ in range(rng.randrange(1, 8)):
            more = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
            toks += more
            index.extend(more)
            assert index.propose() == propose(toks, cfg), (toks, cfg)
            assert index.propose(1) == propose(toks, cfg)[:1]


def test_a_prompt_indexed_in_bulk_proposes_what_the_scan_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long first feed goes into the hashed arrays; what follows into the dict: the proposals
    are the scan's, the latest occurrence winning across the two."""
    monkeypatch.setattr(ngram, "BULK_TOKENS", 8)
    rng = random.Random(11)
    for _ in range(300):
        max_n = rng.randrange(1, 6)
        cfg = NgramConfig(k=rng.randrange(1, 5), max_n=max_n, min_n=rng.randrange(1, max_n + 1))
        index = NgramIndex(cfg)
        toks = [rng.randrange(4) for _ in range(rng.randrange(8, 60))]
        index.extend(toks)
        assert index._bulk or len(toks) <= cfg.min_n, "the first feed was not indexed in bulk"
        assert index.propose() == propose(toks, cfg), (toks, cfg)
        for _ in range(rng.randrange(1, 6)):
            more = [rng.randrange(4) for _ in range(rng.randrange(0, 4))]
            toks += more
            index.extend(more)
            assert index.propose() == propose(toks, cfg), (toks, cfg)


def test_a_hash_collision_costs_a_draft_never_a_wrong_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """N-grams of equal sums hashed alike (a degenerate polynomial): a proposal is still the
    follower of an earlier occurrence of the text's ending, or nothing."""
    monkeypatch.setattr(ngram, "BULK_TOKENS", 8)
    monkeypatch.setattr(ngram, "_P", 1)
    rng = random.Random(12)
    cfg = NgramConfig(k=3, max_n=4, min_n=1)
    for _ in range(200):
        toks = [rng.randrange(5) for _ in range(rng.randrange(8, 40))]
        index = NgramIndex(cfg)
        index.extend(toks)
        got = index.propose()
        if got:
            assert any(toks[s:s + n] == toks[-n:] and toks[s + n:s + n + 3] == got
                       for n in range(1, 5) for s in range(len(toks) - n)), (toks, got)

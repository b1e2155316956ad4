"""n-gram drafts: what the drafter proposes from a sequence's own tokens, and how its draft length adapts."""

from __future__ import annotations

from lemonkit.backends.llamacpp.drafts import MAX_PAUSE, NgramDrafter, SpecSettings


def test_the_draft_is_what_followed_the_tail_last_time() -> None:
    drafter = NgramDrafter(SpecSettings("ngram-simple", draft_max=8))
    drafter.reset([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    assert drafter.draft(10) == [4]  # the first draft is one token: the length grows as drafts are accepted
    drafter.record(1, 1)
    assert drafter.draft(10) == [4, 5]
    drafter.record(2, 2)
    assert drafter.draft(10) == [4, 5, 6, 9]
    assert drafter.draft(2) == [4, 5]  # never more than the room the batcher gives
    drafter.extend([7])  # a tail never seen: nothing to draft
    assert drafter.draft(10) == []


def test_the_latest_occurrence_wins_and_the_tail_never_finds_itself() -> None:
    drafter = NgramDrafter(SpecSettings("ngram-simple", draft_max=4, draft_min=1))
    drafter.reset([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7])
    assert drafter.draft(4) == [2]
    drafter.reset([5, 6, 7])
    assert drafter.draft(4) == []


def test_failing_drafts_pause_longer_and_longer_and_a_success_resumes() -> None:
    drafter = NgramDrafter(SpecSettings("ngram-simple", draft_max=8))
    drafter.reset([1, 2, 3, 4, 1, 2, 3])
    pauses = []
    for _ in range(8):
        drafter.record(1, 0)
        waited = 0
        while not drafter.draft(8):
            waited += 1
        pauses.append(waited)
    assert pauses[0] == 0 and pauses == sorted(pauses) and pauses[-1] == MAX_PAUSE
    drafter.record(1, 1)
    assert drafter.draft(8)  # no pause after an accepted draft
    drafter.record(4, 2)
    assert len(drafter.draft(8)) == 3  # one more than the accepted part


def test_draft_min_holds_back_short_drafts() -> None:
    drafter = NgramDrafter(SpecSettings("ngram-simple", draft_max=8, draft_min=3))
    drafter.reset([1, 2, 3, 4, 5, 1, 2, 3])
    assert drafter.draft(2) == []  # less room than the floor
    assert drafter.draft(8) == [4, 5, 1]

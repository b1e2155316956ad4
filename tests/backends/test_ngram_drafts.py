"""n-gram drafts: what a sequence's own index (ngram-simple) and the model's shared pool (ngram-mod) propose, and how
the draft length adapts."""

from __future__ import annotations

from lemonkit.backends.llamacpp.drafts import MAX_PAUSE, NgramPool, SeqDrafts, SpecSettings


def _draft(drafts: SeqDrafts, fits: int) -> list[int]:
    """What the batcher drafts for a slot with room for ``fits`` tokens (its floor is --draft-min)."""
    floor = max(1, drafts.settings.draft_min)
    n = drafts.pacer.room(fits)
    draft = drafts.lookup(n) if n >= floor else []
    return draft if len(draft) >= floor else []


def _simple(**settings: int) -> SeqDrafts:
    return SeqDrafts(SpecSettings(("ngram-simple",), **settings))


def test_the_draft_is_what_followed_the_tail_last_time() -> None:
    drafts = _simple(simple_max=3)
    drafts.reset([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    assert _draft(drafts, 10) == [4, 5, 6]  # at most --spec-ngram-simple-size-m
    assert _draft(drafts, 2) == [4, 5]  # never more than the room the batcher gives
    drafts.extend([7])  # a tail never seen: nothing to draft
    assert _draft(drafts, 10) == []


def test_each_kind_drafts_up_to_its_own_cap() -> None:
    settings = SpecSettings(("ngram-simple", "ngram-mod", "draft-simple"), draft_max=4, simple_max=8, mod_max=16)
    assert [settings.cap(kind) for kind in settings.kinds] == [8, 16, 4] and settings.longest == 16
    assert SpecSettings(("draft-simple",), draft_max=4).longest == 4
    assert SeqDrafts(SpecSettings(("draft-simple",), draft_max=4)).pacer.room(10) == 4


def test_the_latest_occurrence_wins_and_the_tail_never_finds_itself() -> None:
    drafts = _simple(draft_max=4, draft_min=1)
    drafts.reset([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7])
    assert _draft(drafts, 4) == [2, 5, 6, 7]  # what followed the later 5, 6, 7
    drafts.reset([5, 6, 7])
    assert _draft(drafts, 4) == []


def test_failing_drafts_pause_longer_and_longer_and_a_success_resumes() -> None:
    drafts = _simple(draft_max=8)
    drafts.reset([1, 2, 3, 4, 1, 2, 3])
    pauses = []
    for _ in range(8):
        drafts.record(1, 0)
        waited = 0
        while not _draft(drafts, 8):
            waited += 1
        pauses.append(waited)
    assert pauses[0] == 0 and pauses == sorted(pauses) and pauses[-1] == MAX_PAUSE
    drafts.record(1, 1)
    assert _draft(drafts, 8)  # no pause after an accepted draft


def test_draft_min_holds_back_short_drafts() -> None:
    drafts = _simple(draft_max=8, draft_min=3)
    drafts.reset([1, 2, 3, 4, 5, 1, 2, 3])
    assert _draft(drafts, 2) == []  # less room than the floor
    assert _draft(drafts, 8) == [4, 5, 1, 2, 3]
    drafts.reset([1, 2, 3, 4, 1, 2, 3])
    assert _draft(drafts, 8) == [4, 1, 2, 3]
    drafts.reset([7, 7, 7, 7])
    assert _draft(drafts, 8) == []  # one token followed the tail's run: under the floor


def test_the_pool_drafts_what_another_sequence_wrote_after_the_same_run() -> None:
    settings = SpecSettings(("ngram-mod",), draft_max=16, mod_match=3, mod_min=2, mod_max=5)
    pool = NgramPool(settings.mod_match, settings.mod_min, settings.mod_max)
    first, second = SeqDrafts(settings, pool), SeqDrafts(settings, pool)
    first.reset([9, 1, 2, 3, 4, 5, 6, 7, 8])  # a template's answer, written by one slot
    second.reset([7, 7, 1, 2, 3])  # another slot reaches the template's run
    assert second.lookup(16) == [4, 5, 6, 7, 8]  # chained lookups, at most --spec-ngram-mod-n-max
    assert second.lookup(3) == [4, 5, 6]
    second.extend([4, 5, 6, 7, 8, 0])
    assert second.lookup(16) == []  # a run nobody wrote
    alone = SeqDrafts(SpecSettings(("ngram-simple",)))
    alone.reset([7, 7, 1, 2, 3])
    assert alone.lookup(16) == []  # its own index has never seen the run


def test_the_pool_holds_back_drafts_under_its_minimum_and_starts_over_when_they_keep_failing() -> None:
    settings = SpecSettings(("ngram-mod",), mod_match=2, mod_min=3, mod_max=8)
    pool = NgramPool(settings.mod_match, settings.mod_min, settings.mod_max)
    drafts = SeqDrafts(settings, pool)
    drafts.reset([1, 2, 3, 4, 9, 1, 2])
    assert drafts.lookup(8) == [3, 4, 9, 1, 2, 3, 4, 9]
    drafts.reset([5, 6, 7, 5, 6])
    assert drafts.lookup(8) == [7, 5, 6, 7, 5, 6, 7, 5]
    assert drafts.lookup(2) == [7, 5]  # less room than the minimum: the room is the floor
    drafts.reset([5, 6, 0, 1, 2])
    assert drafts.lookup(8) == [3, 4, 9, 1, 2, 3, 4, 9]
    for _ in range(NgramPool.failing_rounds):
        assert drafts.lookup(8)
        drafts.record(8, 1)
    assert drafts.lookup(8) == []  # cleared

from textkit.words import word_count


def test_counts_words():
    assert word_count("one two  three") == 3


def test_empty_text_has_no_words():
    assert word_count("   ") == 0

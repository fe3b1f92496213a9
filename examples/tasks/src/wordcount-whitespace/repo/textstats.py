"""Word statistics."""

import string
from collections import Counter


def words(text):
    """The words of `text`, lower-cased, without surrounding punctuation. Words are separated by
    any whitespace."""
    result = []
    for token in text.lower().split(" "):
        token = token.strip(string.punctuation)
        if token:
            result.append(token)
    return result


def word_count(text):
    return len(words(text))


def top_words(text, n=3):
    """The n most frequent words as (word, count), most frequent first, ties alphabetically."""
    counts = Counter(words(text))
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]

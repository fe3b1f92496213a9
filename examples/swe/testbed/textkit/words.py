def word_count(text: str) -> int:
    """How many whitespace-separated words `text` has."""
    return len(text.split())

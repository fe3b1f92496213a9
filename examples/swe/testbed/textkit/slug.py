import re


def slugify(text: str) -> str:
    """The lower-case words of `text` (letters and digits), joined by single dashes."""
    return re.sub(r"[^a-z0-9]", "-", text.lower())

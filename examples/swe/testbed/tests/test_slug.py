from textkit.slug import slugify


def test_words():
    assert slugify("Hello World") == "hello-world"


def test_empty():
    assert slugify("") == ""

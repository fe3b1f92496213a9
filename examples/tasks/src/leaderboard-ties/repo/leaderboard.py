"""Ranking of players by score."""


def rank(scores):
    """`scores` maps name -> score. Returns (place, name, score) tuples, highest score first;
    equal scores share a place (1, 1, 3, ...) and are ordered by name."""
    ordered = sorted(scores.items(), key=lambda item: (item[1], item[0]), reverse=True)
    result = []
    place = 0
    previous = None
    for index, (name, score) in enumerate(ordered, start=1):
        if score != previous:
            place = index
            previous = score
        result.append((place, name, score))
    return result


def top(scores, n):
    """The names of the first n players in ranking order."""
    return [name for _, name, _ in rank(scores)[:n]]

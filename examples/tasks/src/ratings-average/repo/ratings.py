"""Summaries of 1-5 star ratings."""

from stats import mean, percent


def summarize(ratings):
    """{"count": n, "mean": mean rounded to 2 decimals, "five_star_percent": share of 5s}."""
    ratings = list(ratings)
    for r in ratings:
        if not 1 <= r <= 5:
            raise ValueError(f"rating out of range: {r}")
    fives = sum(1 for r in ratings if r == 5)
    return {
        "count": len(ratings),
        "mean": round(mean(ratings), 2) if ratings else None,
        "five_star_percent": percent(fives, len(ratings)),
    }
